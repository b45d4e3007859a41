"""The planner (sim/planner.py): its candidates, token multipliers, ranking and JSON, and a figure
worked out by hand."""

from __future__ import annotations

import json
import math

import pytest

from noloco_swarm.model.presets import get_preset
from noloco_swarm.sim.costs import Gpu, gpu_named
from noloco_swarm.sim.planner import (
    BASELINE,
    Candidate,
    Problem,
    TokenCost,
    candidates,
    config_of,
    multiplier,
    plan,
    plan_json,
    project,
    rank_key,
)
from noloco_swarm.sim.wallclock import EXCHANGE_GOODPUT
from noloco_swarm.train.layering import valid_keys

TINY = get_preset("tiny")  # hidden 128, 4 layers, seq 128, vocabulary 4096


def problem(**kw: object) -> Problem:
    fields: dict = {
        "model": TINY,
        "stages": 2,
        "replicas": 2,
        "rate_mbit": 100.0,
        "rtt_s": 0.05,
        "gpu": Gpu("test", 100.0, None),
        "batches": (8,),
        "microbatches": (1, 4),
        "ranks": (32,),
        "inner_steps": (50, 100),
    } | kw
    return Problem(**fields)


def cost(wire: str, rank: int, H: int, ratio: float) -> TokenCost:
    return TokenCost.from_row(
        {
            "wire": wire,
            "rank": rank,
            "H": H,
            "seeds": 3,
            "steps": 2000,
            "tokens_to_dense_loss_ratio": ratio,
            "loss_ratio_at_equal_tokens": 1.01,
        }
    )


def test_candidates_cover_the_grid_the_memory_and_the_cuts_allow() -> None:
    got = candidates(problem(ranks=(32, 64, 128, 256)))
    # B = 8, M in {1, 4}, fp32/bf16/int8 and subspace at 32 and 64 (128 is not below hidden),
    # H in {50, 100}, each blocking and at k = H/2.
    assert len(got) == 2 * 5 * 2 * 2
    assert {c.rank for c in got} == {0, 32, 64}
    assert {(c.inner_steps, c.overlap_steps) for c in got} == {(50, 0), (50, 25), (100, 0), (100, 50)}
    assert not candidates(problem(microbatches=(3,)))  # 3 does not cut a batch of 8
    # A GPU with 2 GB holds B = 8 of the tiny preset (about 1 GB with the process) but not B = 512.
    small = problem(gpu=Gpu("small", 100.0, 2.0), batches=(8, 512))
    assert {c.batch for c in candidates(small)} == {8}


def test_a_multiplier_comes_only_from_its_own_measured_row() -> None:
    costs = [cost("subspace", 64, 50, 1.3), cost("subspace", 256, 50, 1.1), cost("bf16", 0, 100, 1.02)]

    def of(wire: str, rank: int, H: int, k: int = 0) -> float | None:
        return multiplier(Candidate(8, 1, wire, rank, H, k, True), costs)[0]

    assert of("fp32", 0, 50) == 1.0  # the dense run itself
    assert of("subspace", 64, 50) == 1.3 and of("bf16", 0, 100) == 1.02
    assert of("subspace", 128, 50) is None  # between two measured ranks: not interpolated
    assert of("subspace", 64, 100) is None  # another H: not carried over
    assert of("bf16", 0, 50) is None and of("fp32", 0, 100) is None
    assert of("subspace", 64, 50, k=25) == 1.3  # overlap up to H/2 as measured
    assert of("subspace", 64, 50, k=26) is None  # beyond what was measured
    source = multiplier(Candidate(8, 1, "int8", 0, 250, 0, True), costs)[1]
    assert source == "unmeasured: no token_cost.json row for int8 at H=250"


def test_token_cost_rows_are_checked() -> None:
    with pytest.raises(ValueError, match="lacks seeds, steps"):
        TokenCost.from_row({"wire": "bf16", "rank": 0, "H": 50})
    with pytest.raises(ValueError, match="must be a number > 0"):
        cost("bf16", 0, 50, -1.0)
    assert cost("bf16", None, 50, 1.0).rank == 0  # type: ignore[arg-type]
    # A stretched run (longer than the dense one) has a multiplier but no equal-token loss.
    row = {"wire": "subspace", "rank": 14, "H": 50, "seeds": 3, "steps": 2000}
    stretched = TokenCost.from_row(
        row | {"tokens_to_dense_loss_ratio": 1.7, "loss_ratio_at_equal_tokens": None}
    )
    assert stretched.loss_ratio_at_equal_tokens is None and stretched.tokens_to_dense_loss_ratio == 1.7
    assert stretched.multiplier == 1.7  # no control of its stretch: against the dense run itself
    with pytest.raises(ValueError, match="same_schedule must be a number > 0"):
        TokenCost.from_row(
            row
            | {
                "tokens_to_dense_loss_ratio": 1.7,
                "loss_ratio_at_equal_tokens": None,
                "tokens_to_dense_loss_ratio_same_schedule": math.nan,
            }
        )


def test_a_stretched_row_with_a_control_counts_against_the_dense_run_stretched_alike() -> None:
    row = {"rank": 0, "seeds": 3, "steps": 2000, "loss_ratio_at_equal_tokens": None}
    control = TokenCost.from_row(row | {"wire": "fp32", "H": 50, "tokens_to_dense_loss_ratio": 1.25})
    longer_h = TokenCost.from_row(
        row
        | {
            "wire": "fp32",
            "H": 100,
            "tokens_to_dense_loss_ratio": 1.35,
            "tokens_to_dense_loss_ratio_same_schedule": 1.08,
        }
    )
    # A longer run of the same schedule without a control ranks after the one with.
    uncontrolled = TokenCost.from_row(
        row | {"wire": "fp32", "H": 100, "steps": 3000, "tokens_to_dense_loss_ratio": 1.5}
    )
    costs = [control, uncontrolled, longer_h]
    dense, source_dense = multiplier(Candidate(8, 1, "fp32", 0, 50, 0, True), costs)
    h100, source = multiplier(Candidate(8, 1, "fp32", 0, 100, 0, True), costs)
    assert dense == 1.0 and source_dense.startswith("the dense run itself")  # not its control's 1.25
    assert h100 == 1.08 and source.endswith("against the dense run stretched alike")


def test_measured_schedules_rank_first_by_time_then_unmeasured_by_tokens_per_s() -> None:
    # Subspace at rank 32, H = 50 is measured, at a cost; fp32 at H = 50 is the dense run.
    result = plan(problem(), [cost("subspace", 32, 50, 1.5)])
    keys = [rank_key(p) for p in result.schedules]
    assert keys == sorted(keys)
    measured = [p for p in result.schedules if p.measured]
    assert {(p.candidate.wire, p.candidate.inner_steps) for p in measured} == {("fp32", 50), ("subspace", 50)}
    assert measured == result.schedules[: len(measured)]
    times = [p.time_to_target_s for p in measured]
    assert times == sorted(times)
    rest = [p.timing.tokens_per_s for p in result.schedules[len(measured) :]]
    assert rest == sorted(rest, reverse=True) and all(
        p.time_to_target_s is None for p in result.schedules[len(measured) :]
    )
    # The time is tokens needed / tokens/s, with the row's multiplier.
    sub = next(p for p in measured if p.candidate.wire == "subspace")
    assert sub.time_to_target_s == pytest.approx(result.problem.dense_tokens * 1.5 / sub.timing.tokens_per_s)


def test_json_has_the_issues_fields_and_null_for_unmeasured() -> None:
    result = plan(problem(microbatches=(1,), inner_steps=(50,)))
    data = json.loads(json.dumps(plan_json(result)))
    assert data["candidates"] == len(data["schedules"]) == 2 * 4  # 4 wires, overlap on and off
    for row in data["schedules"] + [data["baseline"]]:
        assert {"utilisation", "tokens_per_s", "bytes_per_step", "time_to_target_s", "config"} <= set(row)
        assert 0 < row["utilisation"] <= 1 and row["tokens_per_s"] > 0
        assert (row["time_to_target_s"] is None) == (row["config"]["wire.activations"] != "fp32")
    assert data["baseline"]["label"] == "B=8 M=1 bf16 H=50 blocking"
    assert data["problem"]["exchange_goodput"] == EXCHANGE_GOODPUT["capped"]
    assert len(plan_json(result, top=3)["schedules"]) == 3


def test_config_lines_are_the_runs_keys() -> None:
    pr = problem()
    config = config_of(pr, Candidate(16, 4, "subspace", 32, 100, 50, capped=True))
    assert config == {
        "preset": "tiny",
        "method": "noloco",
        "num_stages": "2",
        "num_replicas": "2",
        "inner.batch_size": "16",
        "inner.microbatches": "4",
        "wire.activations": "subspace",
        "outer.inner_steps": "100",
        "outer.overlap_steps": "50",
        "model.subspace_rank": "32",
    }
    # Every key but the subspace rank (which the subspace format's branch adds) is a key today.
    assert set(config) - {"preset", "method", "model.subspace_rank"} <= set(valid_keys())
    # The default caps the exchange from the measured link; an uncapped schedule says so.
    assert "peer.exchange_max_mbit" not in config_of(pr, BASELINE)
    uncapped = config_of(pr, Candidate(16, 4, "int8", 0, 100, 50, capped=False))
    assert uncapped["peer.exchange_max_mbit"] == "0"


def test_a_figure_worked_out_by_hand() -> None:
    # One stage, one replica, an unshaped link: no pipeline, no exchange, compute all the time.
    # tiny: a layer has 4 x 128^2 + 3 x 128 x 512 + 2 x 128 = 262,400 weights, so 2 x 262,400 +
    # 4 x 128 x 128 = 590,336 forward FLOPs per token; 4 layers and the head (2 x 128 x 4096)
    # make 3,409,920, and 3x that with the backward. At 100 TFLOP/s x 0.5: 5e13 / 10,229,760
    # tokens/s, and 1e9 tokens take 204.6 s.
    pr = problem(stages=1, replicas=1, rate_mbit=math.inf, rtt_s=0.0, mfu=0.5, target_tokens=1e9)
    p = project(pr, Candidate(8, 1, "fp32", 0, 50, 0, True), [])
    assert p.timing.tokens_per_s == pytest.approx(5e13 / 10_229_760)
    assert p.timing.utilisation == pytest.approx(1.0)
    assert p.time_to_target_s == pytest.approx(1e9 * 10_229_760 / 5e13)
    assert p.time_to_target_s == pytest.approx(204.595, abs=1e-3)


def test_bytes_per_step_of_the_busiest_peer_by_hand() -> None:
    # tiny on 2 stages x 2 replicas, B = 8 fp32 rows of 128 tokens: forward 8 x 128 x (128 x 4 + 8)
    # = 532,480 bytes, backward 8 x 128 x 512 = 524,288. Stage 1 holds 2 layers, the norm and the
    # head: 2 x 262,400 + 128 + 128 x 4096 = 1,049,216 parameters, 4 bytes each to its partner
    # every H = 50 steps: 83,937.28 a step. Its downlink is the busiest: 532,480 + 83,937.28.
    p = project(problem(), Candidate(8, 1, "fp32", 0, 50, 0, True), [])
    assert p.pipeline_bytes_per_step == pytest.approx(532_480)
    assert p.exchange_bytes_per_step == pytest.approx(83_937.28)
    assert p.bytes_per_step == pytest.approx(532_480 + 83_937.28)
    # The subspace format at rank 32 sends 32 x 2 + 4 bytes per token: 8 x 128 x 68 = 69,632.
    sub = project(problem(), Candidate(8, 1, "subspace", 32, 50, 0, True), [])
    assert sub.pipeline_bytes_per_step == pytest.approx(69_632)


def test_gpus_by_name_or_by_peak() -> None:
    assert gpu_named("H100") == Gpu("h100", 989.0, 80.0)
    assert gpu_named("rtx3090").peak_tflops == 71.0
    assert gpu_named("250", memory_gb=48) == Gpu("250 TFLOP/s", 250.0, 48.0)
    with pytest.raises(ValueError, match="unknown GPU 'v100'"):
        gpu_named("v100")
    with pytest.raises(ValueError, match="must be > 0"):
        gpu_named("-3")
