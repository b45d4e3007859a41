"""Config precedence through the `noloco` command line: defaults < file < NOLOCO_SET < --set < flags.

Every case is one key of one kind, run through `noloco <command> ... --print-config` with every
subset of the four sources: the value printed is the highest given source's, or the default when
none is given, and the comment next to it names that source (which also tells apart two sources
that give the same value, as the two values of a bool must).
"""

from __future__ import annotations

import itertools
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from noloco_swarm.cli.main import main

LAYERS = ("file", "env", "set", "flag")
REFUSED = object()  # the command refuses to run without the key (peer.run_id for noloco join)


@pytest.fixture(autouse=True)
def no_noloco_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOLOCO_SET", raising=False)


def flatten(doc: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def sources(text: str) -> dict[str, str]:
    """Dotted key -> the source comment that --print-config wrote next to its value."""
    out, section = {}, ""
    for line in text.splitlines():
        if line.startswith("["):
            section = line.strip("[]") + "."
        elif " = " in line and "  # " in line and not line.startswith("#"):
            out[section + line.split(" = ")[0]] = line.rsplit("  # ", 1)[1]
    return out


def run(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, env: str = ""
) -> tuple[int, str, str]:
    if env:
        monkeypatch.setenv("NOLOCO_SET", env)
    else:
        monkeypatch.delenv("NOLOCO_SET", raising=False)
    code = main([*argv, "--print-config"])
    out, err = capsys.readouterr()
    return code, out, err


def printed(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, env: str = ""
):
    code, out, err = run(argv, capsys, monkeypatch, env)
    assert code == 0, err
    return flatten(tomllib.loads(out)), sources(out)


@dataclass(frozen=True)
class Case:
    """One key: the command that prints it, each source's spelling of a value, and what it reads as."""

    key: str
    command: tuple[str, ...]
    default: Any
    file: tuple[str, Any]  # TOML text, value printed
    env: tuple[str, Any]  # NOLOCO_SET text, value printed
    set: tuple[str, Any]  # --set text, value printed
    flag: tuple[tuple[str, ...], Any] | None = None  # argv, value printed


JOIN = ("join", "--run-id", "r")
PEERS = ["/ip4/10.0.0.1/tcp/1", "/ip4/10.0.0.2/tcp/2", "/ip4/10.0.0.3/tcp/3"]
CASES = [
    # int
    Case("num_replicas", ("local",), 4, ("num_replicas = 3", 3), ("num_replicas=2", 2),
         ("num_replicas=5", 5), (("--replicas", "6"), 6)),
    Case("num_stages", JOIN, 2, ("num_stages = 3", 3), ("num_stages=4", 4), ("num_stages=1", 1),
         (("--stages", "3"), 3)),
    Case("seed", JOIN, 0, ("seed = 1", 1), ("seed=2", 2), ("seed=3", 3), (("--seed", "4"), 4)),
    Case("outer.inner_steps", ("sim", "--methods", "noloco"), 50, ("[outer]\ninner_steps = 7", 7), ("outer.inner_steps=8", 8),
         ("outer.inner_steps=9", 9)),
    # float
    Case("inner.lr", JOIN, 1e-3, ("[inner]\nlr = 2e-3", 2e-3), ("inner.lr=3e-3", 3e-3), ("inner.lr=4e-3", 4e-3)),
    # bool
    Case("outer.random_routing", ("sim", "--methods", "local"), True, ("[outer]\nrandom_routing = false", False),
         ("outer.random_routing=on", True), ("outer.random_routing=no", False)),
    # str
    Case("data.dataset", JOIN, "allenai/c4", ('[data]\ndataset = "f"', "f"), ("data.dataset=e", "e"),
         ("data.dataset=s", "s")),
    # optional: a higher source may also unset it
    Case("outer.gamma", ("local", "--in-process"), "none", ("[outer]\ngamma = 0.25", 0.25),
         ("outer.gamma=0.5", 0.5), ("outer.gamma=none", "none")),
    # tuple
    Case("inner.betas", JOIN, [0.9, 0.999], ("[inner]\nbetas = [0.8, 0.9]", [0.8, 0.9]),
         ("inner.betas=0.7,0.95", [0.7, 0.95]), ("inner.betas=0.5, 0.6", [0.5, 0.6])),
    Case("stage_replicas", JOIN, [], ("stage_replicas = [3, 2]", [3, 2]), ("stage_replicas=1,1", [1, 1]),
         ("stage_replicas=2,4", [2, 4])),
    # preset and method
    # (presets but tiny have a 128k vocabulary: a Hugging Face tokenizer, not the embedded one)
    Case("preset", (*JOIN, "--set", "data.tokenizer=gpt2"), "tiny", ('preset = "small"', "small"), ("model.name=medium", "medium"),
         ("preset=large", "large"), (("--preset", "small"), "small")),
    Case("method", ("local",), "noloco", ('[outer]\nmethod = "diloco"', "diloco"), ("method=local", "local"),
         ("outer.method=noloco", "noloco"), (("--method", "diloco"), "diloco")),
    # peer.*
    Case("peer.run_id", ("join",), REFUSED, ('[peer]\nrun_id = "a"', "a"), ("peer.run_id=b", "b"),
         ("peer.run_id=c", "c"), (("--run-id", "d"), "d")),
    Case("peer.step_timeout", JOIN, 120.0, ("[peer]\nstep_timeout = 3", 3.0), ("peer.step_timeout=4", 4.0),
         ("peer.step_timeout=5", 5.0), (("--step-timeout", "6"), 6.0)),
    Case("peer.stage", (*JOIN, "--stages", "4"), "auto", ("[peer]\nstage = 1", 1), ("peer.stage=2", 2),
         ("peer.stage=auto", "auto"), (("--stage", "0"), 0)),
    Case("peer.device", JOIN, "cpu", ('[peer]\ndevice = "cuda"', "cuda"), ("peer.device=cpu", "cpu"),
         ("peer.device=cuda", "cuda"), (("--device", "cpu"), "cpu")),
    Case("peer.metrics", JOIN, "none", ('[peer]\nmetrics = "/f.jsonl"', "/f.jsonl"),
         ("peer.metrics=/e.jsonl", "/e.jsonl"), ("peer.metrics=/s.jsonl", "/s.jsonl"),
         (("--metrics", "/g.jsonl"), "/g.jsonl")),
    # network.*
    Case("network.initial_peers", JOIN, [], (f'[network]\ninitial_peers = ["{PEERS[0]}"]', PEERS[:1]),
         (f"network.initial_peers={PEERS[1]},{PEERS[2]}", PEERS[1:]),
         (f"network.initial_peers={PEERS[2]}", PEERS[2:]), (("--initial-peers", *PEERS), PEERS)),
    Case("network.host_maddrs", ("dht",), ["/ip4/0.0.0.0/tcp/0"],
         ('[network]\nhost_maddrs = ["/ip4/0.0.0.0/tcp/1"]', ["/ip4/0.0.0.0/tcp/1"]),
         ("network.host_maddrs=/ip4/0.0.0.0/tcp/2", ["/ip4/0.0.0.0/tcp/2"]),
         ("network.host_maddrs=/ip4/0.0.0.0/tcp/3", ["/ip4/0.0.0.0/tcp/3"]),
         (("--host-maddrs", "/ip4/0.0.0.0/tcp/4"), ["/ip4/0.0.0.0/tcp/4"])),
    Case("network.identity_path", JOIN, "none", ('[network]\nidentity_path = "/f.key"', "/f.key"),
         ("network.identity_path=/e.key", "/e.key"), ("network.identity_path=none", "none"),
         (("--identity", "/g.key"), "/g.key")),
    Case("network.use_relay", JOIN, True, ("[network]\nuse_relay = false", False),
         ("network.use_relay=true", True), ("network.use_relay=false", False), (("--no-relay",), False)),
    Case("network.use_auto_relay", ("status", "--run-id", "r", "--initial-peers", PEERS[0]), False,
         ("[network]\nuse_auto_relay = true", True), ("network.use_auto_relay=false", False),
         ("network.use_auto_relay=true", True), (("--auto-relay",), True)),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[f"{c.key}-{c.command[0]}" for c in CASES])
def test_the_highest_given_source_wins(
    case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "run.toml"
    config.write_text(case.file[0] + "\n")
    names = {"file": f"--config {config}", "env": "NOLOCO_SET", "set": "--set"}
    layers = LAYERS if case.flag else LAYERS[:-1]
    for n in range(len(layers) + 1):
        for given in itertools.combinations(layers, n):
            argv = list(case.command)
            argv += ["--config", str(config)] if "file" in given else []
            argv += ["--set", case.set[0]] if "set" in given else []
            argv += list(case.flag[0]) if case.flag and "flag" in given else []
            env = case.env[0] if "env" in given else ""
            top = given[-1] if given else None
            if top is None and case.default is REFUSED:
                code, _, err = run(argv, capsys, monkeypatch, env)
                assert code == 2 and "run id" in err, (given, err)
                continue
            values, origin = printed(argv, capsys, monkeypatch, env)
            expected = case.default if top is None else getattr(case, top)[1]
            assert values[case.key] == expected, (given, values[case.key])
            if top is not None:
                source = names.get(top) or case.flag[0][0]  # type: ignore[index]
                assert origin[case.key] == source, (given, origin.get(case.key))
            else:
                assert case.key not in origin or origin[case.key] == "default"


def test_the_two_bugs_of_issue_8(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    values, _ = printed(["local", "--set", "num_replicas=5"], capsys, monkeypatch)
    assert values["num_replicas"] == 5  # was 4... 2: the --replicas default overwrote it
    (tmp_path / "run.toml").write_text("num_stages = 3\n")
    values, _ = printed(["local", "--config", str(tmp_path / "run.toml")], capsys, monkeypatch)
    assert values["num_stages"] == 3
    values, _ = printed(["sim", "--methods", "noloco"], capsys, monkeypatch, env="num_replicas=3;seed=9")
    assert (values["num_replicas"], values["seed"]) == (3, 9)  # sim's default of 4 replicas yields to it


def test_total_steps_follow_steps_unless_a_source_sets_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    values, origin = printed(["local", "--steps", "40"], capsys, monkeypatch)
    assert values["inner.total_steps"] == 40 and origin["inner.total_steps"] == "--steps"
    (tmp_path / "run.toml").write_text("[inner]\ntotal_steps = 1000\n")
    for env in ("", "inner.total_steps=1000"):
        argv = ["local", "--steps", "40"] + (["--config", str(tmp_path / "run.toml")] if not env else [])
        values, _ = printed(argv, capsys, monkeypatch, env=env)
        assert values["inner.total_steps"] == 1000


def test_exchange_deadline_follows_the_step_deadline_unless_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    values, _ = printed([*JOIN, "--step-timeout", "7"], capsys, monkeypatch)
    assert values["peer.exchange_timeout"] == 7.0
    values, _ = printed([*JOIN, "--step-timeout", "7"], capsys, monkeypatch, env="peer.exchange_timeout=9")
    assert (values["peer.step_timeout"], values["peer.exchange_timeout"]) == (7.0, 9.0)
    (tmp_path / "run.toml").write_text("[peer]\nstep_timeout = 5\n")
    values, _ = printed([*JOIN, "--config", str(tmp_path / "run.toml")], capsys, monkeypatch)
    assert values["peer.exchange_timeout"] == 5.0


def test_method_sets_the_methods_paper_defaults_unless_a_source_overrides_them(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    values, _ = printed([*JOIN, "--method", "diloco"], capsys, monkeypatch)
    assert (values["outer.inner_steps"], values["outer.outer_momentum"]) == (100, 0.3)
    values, _ = printed([*JOIN, "--method", "diloco"], capsys, monkeypatch, env="outer.inner_steps=10")
    assert values["outer.inner_steps"] == 10
