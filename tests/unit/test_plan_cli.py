"""`noloco plan` on the command line: JSON and table, the token-cost file, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from noloco_swarm.cli.main import main

SMALL_GRID = [
    "plan",
    "--preset",
    "tiny",
    "--stages",
    "2",
    "--replicas",
    "2",
    "--rate-mbit",
    "100",
    "--rtt-ms",
    "50",
    "--gpu",
    "l4",
    "--batches",
    "8",
    "--microbatches",
    "1,4",
    "--ranks",
    "32",
    "--inner-steps",
    "50",
]


def test_json_ranks_measured_first_and_says_null_for_unmeasured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        {
            "wire": "subspace",
            "rank": 32,
            "H": 50,
            "seeds": 3,
            "steps": 1000,
            "tokens_to_dense_loss_ratio": 1.2,
            "loss_ratio_at_equal_tokens": 1.01,
        }
    ]
    # Rows the planner leaves out: a DiLoCo run's (bench/token_cost.py measures it beside NoLoCo)
    # and one that never reached the dense loss (no ratio).
    rows += [
        {**rows[0], "wire": "fp32", "rank": 0, "method": "diloco", "tokens_to_dense_loss_ratio": 0.5},
        {**rows[0], "wire": "bf16", "rank": 0, "tokens_to_dense_loss_ratio": None},
    ]
    (tmp_path / "cost.json").write_text(json.dumps({"rows": rows}))
    assert main([*SMALL_GRID, "--token-cost", str(tmp_path / "cost.json"), "--json", "--top", "0"]) == 0
    data = json.loads(capsys.readouterr().out)
    schedules = data["schedules"]
    assert data["candidates"] == len(schedules) == 2 * 4 * 2  # M, wires (subspace at 32), overlap
    measured = [s for s in schedules if s["time_to_target_s"] is not None]
    assert {s["config"]["wire.activations"] for s in measured} == {"fp32", "subspace"}
    assert {s["token_multiplier"] for s in measured if s["config"]["wire.activations"] == "fp32"} == {1.0}
    assert schedules[: len(measured)] == measured
    times = [s["time_to_target_s"] for s in measured]
    assert times == sorted(times)
    assert data["problem"]["gpu"] == "l4" and data["problem"]["gpu_peak_tflops"] == 121.0


def test_the_table_prints_config_lines_and_unmeasured(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main([*SMALL_GRID, "--token-cost", str(tmp_path / "none.json"), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "only the dense run (fp32, H=50) gets a time" in out
    assert "unmeasured" in out and "today's default (noloco join):" in out
    assert "--set inner.batch_size=8 --set inner.microbatches=" in out
    assert out.count("--set preset=tiny") == 4  # two measured and two unmeasured schedules


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--gpu", "v100"], "unknown GPU 'v100'"),
        (["--batches", "8,x"], "--batches takes whole numbers"),
        (["--top", "-1"], "--top must be >= 0"),
        (["--mfu", "2"], "0 < MFU <= 1"),
    ],
)
def test_bad_input_is_refused(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL_GRID, *extra]) == 2
    assert message in capsys.readouterr().err


def test_write_saves_the_first_schedule_as_a_config_the_run_reads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--write` turns the first schedule's config lines into a TOML file for `--config`: built
    from it, the run has exactly the schedule's settings (typed), as `--set` lines would give."""
    from noloco_swarm.train.layering import build_config

    out = tmp_path / "run.toml"
    cost = tmp_path / "none.json"  # no token costs: only the dense run is measured
    assert main([*SMALL_GRID, "--token-cost", str(cost), "--json", "--write", str(out)]) == 0
    first = json.loads(capsys.readouterr().out)["schedules"][0]["config"]
    keys = {k: v for k, v in first.items() if k not in ("preset", "method")}
    from_file = build_config(config_file=out, env={})
    from_set = build_config(first["preset"], first["method"], assignments=keys, env={})
    assert from_file.flat() == from_set.flat()
    assert from_file.flat() != build_config(env={}).flat()  # the schedule differs from the defaults
    assert "[outer]" in out.read_text() and out.read_text().startswith("# noloco plan's first schedule")
    # A folder that cannot be written: a clear error, not a traceback.
    assert main([*SMALL_GRID, "--token-cost", str(cost), "--write", str(tmp_path / "no" / "run.toml")]) == 2
    assert "cannot write" in capsys.readouterr().err
