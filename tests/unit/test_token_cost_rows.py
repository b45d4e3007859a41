"""bench/token_cost.py's rows: tokens to the dense loss against the dense run, and a stretched run
against the dense run stretched alike (its control), worked out by hand on made-up curves."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "token_cost.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("token_cost_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(wire: str, h: int, stretch: int, seed: int, curve: list[tuple[int, float]], **extra: object) -> dict:
    r = {
        "name": f"{wire}-H{h}-x{stretch}-seed{seed}",
        "wire": wire,
        "rank": 0,
        "H": h,
        "method": "noloco",
        "seed": seed,
        "steps": 1000 * stretch,
        "curve": [{"tokens": t, "val_loss": v} for t, v in curve],
        "final": {"val_loss": curve[-1][1], "val_tokens": 16},
    }
    return r | ({"stretch": stretch} if stretch > 1 else {}) | extra


def by_kind(rows: list[dict]) -> dict[tuple, dict]:
    return {(r["wire"], r["H"], r.get("stretch", 1)): r for r in rows}


def test_a_stretched_run_counts_against_the_dense_run_and_its_control(bench: ModuleType) -> None:
    runs = {}
    for seed, (late, control_at) in enumerate([(3.3, 300), (3.5, 250)]):
        runs[f"d{seed}"] = run("fp32", 50, 1, seed, [(0, 5.0), (100, 4.0), (200, 3.0)])
        # The control reaches the dense final loss (3.0) at `control_at` tokens and stops there.
        control = [(0, 5.0), (100, 4.0), (200, 3.5), (control_at, 3.0)]
        runs[f"c{seed}"] = run("fp32", 50, 2, seed, control, stopped_at_step=control_at)
        # H = 100 is at `late` at 300 tokens and 2.5 at 400: it reaches 3.0 in between.
        runs[f"h{seed}"] = run("fp32", 100, 2, seed, [(0, 5.0), (100, 4.2), (300, late), (400, 2.5)])
    rows = by_kind(bench.rows(runs))
    h100 = rows[("fp32", 100, 2)]
    # Seed 0: 300 + 0.3/0.8 x 100 = 337.5 tokens; seed 1: 300 + 0.5/1.0 x 100 = 350.
    assert h100["tokens_to_dense_loss_ratio_per_seed"] == pytest.approx([337.5 / 200, 350 / 200])
    assert h100["tokens_to_dense_loss_ratio_same_schedule_per_seed"] == pytest.approx(
        [337.5 / 300, 350 / 250]
    )
    assert h100["same_schedule_seeds"] == 2 and h100["final_loss_ratio"] == pytest.approx(2.5 / 3.0)
    control = rows[("fp32", 50, 2)]
    assert control["tokens_to_dense_loss_ratio_per_seed"] == pytest.approx([1.5, 1.25])
    # A control stopped at the target: no final loss to compare, and no control of its own.
    assert control["final_loss_ratio"] is None and control["final_val_loss"] is None
    assert "tokens_to_dense_loss_ratio_same_schedule" not in control
    assert rows[("fp32", 50, 1)]["tokens_to_dense_loss_ratio"] == 1.0


def test_a_seed_that_never_reaches_the_loss_leaves_the_mean_unmeasured(bench: ModuleType) -> None:
    runs = {
        "d": run("fp32", 50, 1, 0, [(0, 5.0), (200, 3.0)]),
        "c": run("fp32", 50, 2, 0, [(0, 5.0), (300, 3.0)]),
        "h": run("fp32", 250, 2, 0, [(0, 5.0), (400, 3.1)]),
    }
    h250 = by_kind(bench.rows(runs))[("fp32", 250, 2)]
    assert h250["tokens_to_dense_loss_ratio"] is None
    assert h250["tokens_to_dense_loss_ratio_same_schedule"] is None
    assert h250["tokens_to_dense_loss_ratio_same_schedule_per_seed"] == [None]


def test_only_the_stretched_dense_runs_stop_at_the_dense_loss(bench: ModuleType) -> None:
    stopping = [r["name"] for r in bench.plan(3, stretched=True) if r.get("stop_at_dense_loss")]
    assert stopping == [f"noloco-fp32-k0-H50-x2-seed{s}" for s in range(3)]
    assert not any(r.get("stop_at_dense_loss") for r in bench.plan(3))
