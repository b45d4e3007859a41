"""What the `noloco` command line refuses before anything starts, and what it hands its peers.

Unknown keys and unreadable values are errors (exit 2) that name the key, its source and what to
give; settings a runner cannot honour are refused with what to change; `noloco local`'s peers
resolve the parent's config; `--print-config` reads back as the same config; `noloco keys`.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest

from noloco_swarm.cli.main import DEFAULT_IDENTITY, main
from noloco_swarm.harness.local import LOOPBACK, LocalSwarm
from noloco_swarm.train.layering import Layer, resolve
from tests.sim.test_config_precedence import JOIN, flatten, printed, run


@pytest.fixture(autouse=True)
def no_noloco_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOLOCO_SET", raising=False)


@pytest.mark.parametrize(
    ("argv", "env", "file", "message"),
    [
        ([*JOIN, "--set", "outer.nope=1"], "", "", "--set: unknown config key 'outer.nope' (`noloco keys"),
        (
            [*JOIN],
            "peer.step_timeot=3",
            "",
            "NOLOCO_SET: unknown config key 'peer.step_timeot'; did you mean peer.step_timeout",
        ),
        ([*JOIN], "", "[peer]\nfoo = 1\n", "run.toml: unknown config key 'peer.foo'"),
        (
            [*JOIN, "--set", "num_replicas=five"],
            "",
            "",
            "--set: num_replicas: cannot read 'five' as int; give a whole number",
        ),
        ([*JOIN], "", "seed = 1.5\n", "seed: cannot read 1.5 as int"),
        (
            [*JOIN],
            "network.use_relay=maybe",
            "",
            "NOLOCO_SET: network.use_relay: cannot read 'maybe' as bool; give true or false",
        ),
        (["local", "--set", "num_replicas=0"], "", "", "at least one stage and one replica"),
        (["local", "--stages", "9"], "", "", "lower --stages"),
        ([*JOIN, "--set", "peer.step_timeout=-1"], "", "", "peer.step_timeout must be > 0"),
        (["local"], "", 'preset = "huge"\n', "unknown model preset 'huge'"),
        (["local", "--set", "noequals"], "", "", "expected key=value"),
        ([*JOIN, "--preset", "small"], "", "", "with --set model.vocab_size=4096"),
        ([*JOIN, "--set", "peer.release_memory=never"], "", "", "peer.release_memory must be one of"),
        ([*JOIN], "peer.cpus=3-1", "", "peer.cpus: the range '3-1' ends before it starts"),
    ],
)
def test_bad_keys_and_values_exit_2_and_say_what_to_change(
    argv: list[str],
    env: str,
    file: str,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if file:
        (tmp_path / "run.toml").write_text(file)
        argv = [*argv, "--config", str(tmp_path / "run.toml")]
    code, _, err = run(argv, capsys, monkeypatch, env)
    assert code == 2 and message in err, err
    assert err.startswith("noloco: config error: ")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*JOIN, "--method", "allreduce"], "method allreduce (set by --method) runs only in the simulator"),
        (["local", "--set", "method=allreduce"], "use noloco sim or noloco local --in-process"),
        ([*JOIN, "--set", "eval_every=10"], "eval_every=10 (set by --set): peers evaluate only at the end"),
        (["local", "--set", "eval_every=10"], "set eval_every=0"),
        ([*JOIN, "--stage", "2"], "peer.stage 2 (set by --stage) is outside 0..1"),
        ([*JOIN, "--set", "network.client_mode=true"], "network.client_mode (set by --set)"),
        (["local", "--set", "peer.run_id=x"], "peer.run_id (set by --set): noloco local names its peers'"),
        (["local", "--set", "network.use_relay=false"], "network.use_relay (set by --set)"),
        (
            ["local", "--set", "peer.cpus=0"],
            "peer.cpus (set by --set): noloco local names its peers' run id, stages, CPUs",
        ),
        (["join"], "noloco join needs a run id: give --run-id NAME"),
        (["status", "--run-id", "r"], "noloco status needs --initial-peers"),
    ],
)
def test_settings_a_runner_cannot_honour_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = run(argv, capsys, monkeypatch)
    assert code == 2 and message in err, err
    assert out == ""  # refused before anything, even the printed config


def test_every_refusal_is_reported_at_once(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = run(["join", "--method", "allreduce", "--set", "eval_every=5"], capsys, monkeypatch)
    assert code == 2
    assert [line.split(":")[2].split()[0] for line in err.splitlines()] == [
        "noloco",
        "method",
        "eval_every=5",
    ]


@pytest.mark.parametrize(
    "argv",
    [
        [*JOIN],  # eval_every's default (50) is not the user's setting
        [*JOIN, "--set", "eval_every=0", "--set", "stage_replicas=3,2", "--stage", "1"],
        [*JOIN, "--set", "outer.random_routing=false", "--method", "local"],
        ["local", "--in-process", "--method", "allreduce", "--set", "eval_every=5"],
        ["local", "--set", "peer.step_timeout=30", "--set", "peer.device=cpu"],  # passed on to its peers
        [
            "sim",
            "--methods",
            "noloco",
            "--set",
            "stage_replicas=4,4",
            "--set",
            "peer.run_id=x",
        ],  # equal to num_replicas
    ],
)
def test_settings_runners_honour_are_accepted(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    printed(argv, capsys, monkeypatch)


def test_local_peers_resolve_the_parents_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run keys travel in the run config file (under every source of the peer), the parent's
    peer settings as flags, every one of them; eval_every's default is not refused there either."""
    settings = {
        "peer.join_timeout": 99,
        "peer.deadline_factor": 3.0,
        "peer.min_deadline": 4.0,
        "peer.release_memory": "trim",
        "peer.exchange_pacing": 0.5,
        "peer.checkpoint_keep": 5,
        "peer.deterministic": True,
    }
    parent = resolve(
        [
            Layer("default", {"method": "diloco"}, explicit=False),
            Layer("--set", {"num_replicas": 3, "outer.inner_steps": 4} | settings),
            Layer("--step-timeout", {"peer.step_timeout": 11}),
        ]
    ).cfg
    swarm = LocalSwarm(parent, 8, "local-1", tmp_path, bootstrap="/ip4/127.0.0.1/tcp/9/p2p/Qm")
    swarm.config_path.write_text(json.dumps(parent.manifest()))
    argv = swarm.join_argv(1, tmp_path / "peer-1-0.jsonl")
    # NOLOCO_SET is not inherited by the peers (start_peer drops it); their flags and files win anyway
    values, origin = printed(argv, capsys, monkeypatch)
    for key, value in parent.flat().items():
        expected = {
            "peer.run_id": "local-1",
            "peer.stage": 1,
            "peer.metrics": str(tmp_path / "peer-1-0.jsonl"),
            "network.initial_peers": ["/ip4/127.0.0.1/tcp/9/p2p/Qm"],
            "network.host_maddrs": list(LOOPBACK),
        }.get(key, value)
        shown = {"model.name": "preset", "outer.method": "method"}.get(key, key)
        unset = "auto" if key == "peer.exchange_max_mbit" else "none"  # None reads "auto" there
        assert values[shown] == (expected if expected is not None else unset), key
    assert origin["num_replicas"] == "noloco local's run config" and origin["peer.stage"] == "--stage"
    assert (values["peer.step_timeout"], values["peer.exchange_timeout"]) == (11.0, 11.0)
    assert {key: values[key] for key in settings} == settings


def test_sim_methods_are_the_flag_layer_of_the_method_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def configs(argv: list[str]) -> dict[str, dict]:
        code, out, err = run(["sim", *argv], capsys, monkeypatch)
        assert code == 0, err
        docs = out.split("# the config of noloco sim, method ")[1:]
        return {doc.split("\n", 1)[0]: flatten(tomllib.loads(doc.split("\n", 1)[1])) for doc in docs}

    every = configs([])
    assert list(every) == ["noloco", "diloco", "allreduce", "local"]
    assert {c["num_replicas"] for c in every.values()} == {4}
    (tmp_path / "run.toml").write_text('method = "diloco"\n[outer]\nrandom_routing = true\n')
    only = configs(["--config", str(tmp_path / "run.toml")])
    assert list(only) == ["diloco"]
    chosen = configs(["--config", str(tmp_path / "run.toml"), "--methods", "noloco-fixed,local"])
    assert list(chosen) == ["noloco-fixed", "local"]
    assert (
        chosen["noloco-fixed"]["method"] == "noloco"
        and chosen["noloco-fixed"]["outer.random_routing"] is False
    )
    assert chosen["local"]["outer.random_routing"] is True


def test_dht_keeps_its_identity_file_unless_told_otherwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    values, _ = printed(["dht"], capsys, monkeypatch)
    assert values["network.identity_path"] == str(DEFAULT_IDENTITY.expanduser())
    (tmp_path / "dht.toml").write_text('[network]\nidentity_path = "~/other.key"\n')
    values, _ = printed(["dht", "--config", str(tmp_path / "dht.toml")], capsys, monkeypatch)
    assert values["network.identity_path"] == str(Path("~/other.key").expanduser())
    values, _ = printed(["dht", "--identity", str(tmp_path / "id.key")], capsys, monkeypatch)
    assert values["network.identity_path"] == str(tmp_path / "id.key")


@pytest.mark.parametrize(
    "argv",
    [
        [*JOIN, "--method", "diloco", "--stage", "1", "--initial-peers", "/ip4/1.2.3.4/tcp/5"],
        ["local", "--replicas", "3"],  # every peer.* and network.* key restates its default: accepted
        ["local", "--in-process", "--seed", "7"],
    ],
)
def test_printed_config_reads_back_as_the_same_config(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = [*argv, "--set", "outer.gamma=0.25", "--set", "inner.lr=5e-4", "--set", "data.dataset_config=none"]
    code, out, err = run(argv, capsys, monkeypatch)
    assert code == 0, err
    (tmp_path / "all.toml").write_text(out)
    command = [a for a in argv if a in ("join", "local", "--in-process")]
    code, again, err = run([*command, "--config", str(tmp_path / "all.toml")], capsys, monkeypatch)
    assert code == 0, err
    assert tomllib.loads(again) == tomllib.loads(out)
    assert tomllib.loads(out)["eval_every"] == (50 if "--in-process" in argv else 0)  # peers: at the end


def test_keys_lists_every_key_with_its_type_and_meaning(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "--all"]) == 0
    out = capsys.readouterr().out.splitlines()
    lines = {line.split()[0]: line for line in out if line and not line.startswith("#")}
    for key in ("preset", "method", "num_replicas", "stage_replicas", "outer.gamma", "peer.exchange_timeout"):
        assert key in lines, key
    assert (
        "float" in lines["peer.step_timeout"]
        and "deadline of one pipeline round trip" in lines["peer.step_timeout"]
    )
    assert (
        "tuple[str, ...]" in lines["network.initial_peers"] and "Multiaddrs" in lines["network.initial_peers"]
    )
    assert "int | None" in lines["peer.stage"]
    assert "The same key as method" in lines["outer.method"]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_a_peer_told_to_run_on_cpus_it_may_not_use_exits_2_before_it_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NOLOCO_SET", raising=False)
    before = os.sched_getaffinity(0)
    assert main(["join", "--run-id", "r", "--set", "peer.cpus=4095"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("noloco: config error: peer.cpus names CPUs [4095]"), err
    assert os.sched_getaffinity(0) == before
