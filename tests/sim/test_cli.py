"""The `noloco` command line: config plumbing, the pure live view, and short real runs."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from noloco_swarm.cli.main import main
from noloco_swarm.cli.view import ReplicaStatus, RunStatus, render, sparkline
from noloco_swarm.model.presets import SCHEDULES
from noloco_swarm.train.layering import (
    ConfigError,
    build_config,
    coerce,
    load_file,
    parse_assignments,
    valid_keys,
)
from tests.small import SMALL_RUN


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'method = "diloco"\nseed = 3\n[outer]\ninner_steps = 30\n[inner]\nlr = 2e-3\nbetas = [0.9, 0.95]\n'
    )
    cfg = build_config(
        config_file=path, env={"NOLOCO_SET": "seed=4;outer.outer_momentum=0.2"}, assignments={"seed": "5"}
    )
    assert cfg.outer.method == "diloco" and cfg.outer.inner_steps == 30
    assert cfg.inner.lr == 2e-3 and cfg.inner.betas == (0.9, 0.95)
    assert cfg.outer.outer_momentum == 0.2  # env over file/defaults
    assert cfg.seed == 5  # flags over env
    assert load_file(path)["outer.inner_steps"] == 30


def test_derived_defaults_follow_the_preset() -> None:
    cfg = build_config(assignments={"model.seq_len": "64"}, env={})
    assert cfg.data.seq_len == 64 and cfg.inner.lr == SCHEDULES["tiny"]["lr"]
    assert build_config("tiny", "diloco", env={}).outer.inner_steps == 100


@pytest.mark.parametrize(
    ("assignments", "message"),
    [
        ({"outer.nope": "1"}, "unknown config key"),
        ({"model": "1"}, "unknown config key"),
        ({"inner.lr": "fast"}, "cannot read"),
        ({"outer.random_routing": "maybe"}, "cannot read"),
        ({"inner.betas": "0.9"}, "2 comma-separated"),
        ({"outer.inner_steps": "0"}, "inner_steps"),
        ({"num_stages": "9"}, "layers"),
    ],
)
def test_bad_config_is_a_clear_error(assignments: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(assignments=assignments, env={})


def test_coercion_and_assignment_parsing() -> None:
    assert coerce("outer.gamma", "none") is None
    assert coerce("outer.gamma", "0.5") == 0.5
    assert coerce("inner.total_steps", "1e3") == 1000
    assert coerce("outer.random_routing", "off") is False
    assert parse_assignments("a=1; b = x ;") == {"a": "1", "b": "x"}
    with pytest.raises(ConfigError):
        parse_assignments("novalue")
    assert "outer.inner_steps" in valid_keys() and "num_replicas" in valid_keys()


def snapshot() -> RunStatus:
    return RunStatus(
        title="local 2 stages x 2 replicas",
        method="noloco",
        step=120,
        total_steps=300,
        outer_steps=2,
        train_loss=5.4321,
        val_ppl=321.5,
        lr=9.5e-4,
        tokens=491520,
        tokens_per_second=4096.0,
        weight_spread=1.25e-3,
        elapsed=120.0,
        loss_history=(8.0, 7.0, 6.0, 5.5),
        replicas=(ReplicaStatus(0, 0, "1", "abcdef0123456789"), ReplicaStatus(1, 1, "0")),
    )


def test_view_is_a_pure_function_of_the_snapshot() -> None:
    def text() -> str:
        console = Console(width=100, color_system=None, record=True, file=io.StringIO())
        console.print(render(snapshot()))
        return console.export_text()

    out = text()
    assert out == text()
    for expected in (
        "120/300",
        "noloco",
        "5.432",
        "321.5",
        "491,520",
        "4,096 tok/s",
        "abcdef012345",
        "40%",
        "[noloco]",
    ):
        assert expected in out, expected
    assert sparkline((8.0, 7.0, 6.0, 5.5)) == "█▅▂▁"
    assert sparkline(()) == ""


def test_swarm_status_view_is_a_pure_function_of_the_snapshot() -> None:
    from noloco_swarm.cli.status import PeerRow, SwarmStatus, render_swarm
    from noloco_swarm.protocol.rpc import PeerStatus

    def row(peer: str, stage: int, rank: int, step: int, loss: float | None) -> PeerRow:
        return PeerRow(
            peer, stage, 0, "cpu", PeerStatus("run-9", peer, stage, step, step // 10, rank, 3, 4096, loss)
        )

    snap = SwarmStatus(
        "run-9",
        {"model.name": "tiny", "num_stages": "2", "outer.method": "noloco", "outer.inner_steps": "10"},
        (
            row("12D3KooWaaaaaaaa11111111", 0, 0, 41, None),
            row("12D3KooWbbbbbbbb22222222", 1, 0, 40, 5.25),
            PeerRow("12D3KooWcccccccc33333333", 1, 4, "cuda", error="peer is unreachable", relayed=True),
        ),
        gone=1,
    )

    def text(status: SwarmStatus) -> str:
        console = Console(width=120, color_system=None, record=True, file=io.StringIO())
        console.print(render_swarm(status))
        return console.export_text()

    out = text(snap)
    assert out == text(snap)
    for expected in (
        "run-9  [noloco]",
        "tiny, 2 stages, H=10",
        "3 announced (stage 0: 1, stage 1: 2), 2 answering",
        "40..41",
        "5.250 (mean over peers)",
        "1 reported",
        "…11111111",
        "4,096",
        "no answer: peer is",
        "…33333333: reachable only through a relay",
    ):
        assert expected in out, expected
    assert "no manifest" in text(SwarmStatus("gone-run", found=False))
    narrow = Console(width=80, color_system=None, record=True, file=io.StringIO())
    narrow.print(render_swarm(snap))
    rows = [line.split() for line in narrow.export_text().splitlines() if "…1111" in line or "…2222" in line]
    assert [r[3] for r in rows] == ["41", "40"]  # every column, step included, in 80 columns


def test_presets_and_keys_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets"]) == 0
    assert "small" in capsys.readouterr().out
    assert main(["keys"]) == 0
    assert "outer.group_size" in capsys.readouterr().out
    assert main(["keys", "--all"]) == 0
    assert "outer.gamma" in capsys.readouterr().out


def test_config_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["local", "--steps", "1", "--set", "outer.inner_steps=0"]) == 2
    assert "inner_steps" in capsys.readouterr().err
    assert main(["local", "--steps", "1", "--method", "allreduce"]) == 2  # simulator-only
    assert "--in-process" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_join_on_cuda_without_a_cuda_device_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["join", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--run-id", "r", "--device", "cuda"]
    assert main(argv) == 2
    assert "no usable CUDA device" in capsys.readouterr().err


def test_local_in_process_runs_and_prints_a_summary(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["local", "--in-process", "--steps", "4", "--plain", *SMALL_RUN, "--set", "outer.inner_steps=2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "summary" in out and "validation perplexity" in out and "outer steps" in out
    assert "MiB each way" in out


def test_sim_writes_json_csv_and_png(cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "sim"
    argv = [
        "sim",
        "--steps",
        "4",
        "--replicas",
        "2",
        "--methods",
        "noloco,local,noloco-fixed",
        "--out",
        str(out),
    ]
    assert main([*argv, *SMALL_RUN, "--set", "outer.inner_steps=2", "--set", "eval_every=2"]) == 0
    data = json.loads((out / "results.json").read_text())
    assert set(data) == {"noloco", "local", "noloco-fixed"}
    assert data["noloco-fixed"]["config"]["outer.random_routing"] is False
    assert len(data["noloco"]["replica_hashes"]) == 2 and data["noloco"]["state_hash"]
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["step"] for r in rows if r["method"] == "noloco"] == ["2", "4"]
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_methods_name_both_baselines_and_both_ablations() -> None:
    from noloco_swarm.cli.main import _sim_layer
    from noloco_swarm.train.layering import Layer, resolve

    def cfg(method: str):
        return resolve([Layer("default", {"preset": "tiny"}, explicit=False), _sim_layer(method)]).cfg

    assert (cfg("diloco").outer.diloco_variant, cfg("diloco").outer.outer_momentum) == ("heavyball", 0.3)
    assert (cfg("diloco-nesterov").outer.diloco_variant, cfg("diloco-nesterov").outer.outer_momentum) == (
        "nesterov",
        0.9,
    )
    assert cfg("diloco-heavyball").outer.outer_momentum == 0.3
    fixed = cfg("local-fixed").outer
    assert (fixed.method, fixed.random_routing) == ("local", False)
