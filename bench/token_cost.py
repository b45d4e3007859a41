"""What a cheaper stage boundary or a longer H costs in tokens: simulator runs against a dense run.

Every run is a simulator run (P = 2 stages, N = 4 replicas, NoLoCo with the sweep's settings:
seeded pairs, alpha 0.5, beta = gamma = 0.7; bench/sweep.py) of the `mini` preset's shape (hidden
256, 6 layers) with the sweep's vocabulary, window and batch (1,024 tokens, 32, 4), evaluated on
the same validation windows every --eval-every steps. A run's JSON goes to --out; a run whose file
exists is skipped, so an interrupted measurement continues where it stopped. Runs are listed most
important first: the dense fp32 run of each seed, subspace at the two ranks, bf16, int8, then
NoLoCo at H = 100 and 250 and heavy-ball DiLoCo at 2H for H = 50, 100, 250.

Ranks: a bf16 boundary sends 2d bytes per token plus an 8-byte token id (d = 256: 520 bytes); a
subspace boundary 2k bytes plus a 4-byte id. k = 14 sends 32 bytes (16x fewer), k = 2 sends 8
(65x fewer): at this width the id alone is an eighth of the 64x budget, so 64x leaves k = 2.

Per (wire, rank, H) and seed, against the dense run of the same seed (fp32, H = 50):
- tokens to the dense run's final validation loss, over the dense run's tokens to it (the first
  evaluation at or below it, interpolated linearly between evaluations); `null` where the run
  never reaches it;
- the final validation loss over the dense run's at equal tokens, with the standard error of the
  ratio's mean over seeds (paired: each seed against its own dense run);
- where a run never reaches the dense loss: the tokens the dense run took to reach this run's
  final loss, over this run's tokens (what this run's tokens were worth in the dense run's; the
  dense run was then earlier in its learning-rate schedule, so it is a rough guide, not a bound);
- for NoLoCo fp32 at H: its final loss over heavy-ball DiLoCo's at 2H, paired by seed.

Stretched runs (--stretched; STRETCHED) train longer than the dense run, their cosine decay
stretched to the longer run (warmup and evaluation interval unchanged), so a format that never
reaches the dense loss in 1,000 steps gets a measured tokens-to-loss multiplier (subspace k = 14
over 2,000 steps). A stretched schedule by itself changes when a loss is reached (the dense run
stretched 2x reaches its 1,000-step final loss with 0.855x the tokens, its rate still high), so
the dense run stretched 2x is run too, as their control, stopped once it reaches that loss: a
stretched row's `tokens_to_dense_loss_ratio_same_schedule` is its tokens to the dense run's final
loss over the control's (same seed, same schedule), where `tokens_to_dense_loss_ratio` compares it
with the 1,000-step dense run.

    nice -n 19 python bench/token_cost.py --out docs/results/token_cost        # run or continue
    # on 2 cores: the same with --shard 0/2 and --shard 1/2, side by side; then --stretched
    python bench/token_cost.py --out docs/results/token_cost --summarise \\
        --json docs/results/token_cost.json                                     # the rows only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

BASE = {  # the sweep's data and optimiser (bench/sweep.py) on the mini preset's shape
    "model.vocab_size": 1024,
    "model.seq_len": 32,
    "inner.batch_size": 4,
    "inner.lr": 1e-3,
    "inner.min_lr": 1e-4,
    "num_stages": 2,
    "num_replicas": 4,
    "outer.seeded_groups": True,
}
DENSE = ("fp32", 0, 50, "noloco", 1)
# Runs longer than the dense one, each with its own schedule stretched (total steps x s): for a
# format that never reaches the dense loss in the dense run's steps, how many more tokens it takes.
# The dense run stretched alike is their control: the stretched schedule alone changes when a
# loss is reached, whatever the format.
STRETCHED = [("subspace", 14, 50, "noloco", 2), ("subspace", 2, 50, "noloco", 3),
             ("fp32", 0, 100, "noloco", 2), ("fp32", 0, 250, "noloco", 2), ("fp32", 0, 50, "noloco", 2),
             ("int8", 0, 50, "noloco", 2)]  # fmt: skip


def plan(seeds: int, stretched: bool = False) -> list[dict]:
    """Every run, most important first: (wire, rank, H, method, stretch) x seed; `stretched`:
    only the stretched runs."""
    kinds = [DENSE, ("subspace", 14, 50, "noloco", 1), ("subspace", 2, 50, "noloco", 1),
             ("bf16", 0, 50, "noloco", 1), ("int8", 0, 50, "noloco", 1)]  # fmt: skip
    kinds += [("fp32", 0, h, "noloco", 1) for h in (100, 250)]
    kinds += [("fp32", 0, 2 * h, "diloco", 1) for h in (50, 100, 250)]
    runs = []
    for wire, rank, h, method, stretch in STRETCHED if stretched else kinds:
        for seed in range(seeds):
            name = run_name((wire, rank, h, method, stretch), seed)
            runs.append({"name": name, "wire": wire, "rank": rank, "H": h, "method": method, "seed": seed}
                        | ({"stretch": stretch} if stretch > 1 else {})
                        | ({"stop_at_dense_loss": True} if stretch > 1 and (wire, rank, h, method) == DENSE[:-1] else {}))  # fmt: skip
    return runs


def run_name(kind: tuple[str, int, int, str, int], seed: int) -> str:
    """A run's name, and its file's under --out: (wire, rank, H, method, stretch) and seed."""
    wire, rank, h, method, stretch = kind
    return f"{method}-{wire}-k{rank}-H{h}" + (f"-x{stretch}" if stretch > 1 else "") + f"-seed{seed}"


class Reached(Exception):
    """A control run reached the dense run's final loss: what it measures is known."""


def run_one(run: dict, steps: int, warmup: int, eval_every: int, stop_below: float | None = None) -> dict:
    """One run; with `stop_below`, it ends at its first evaluation at or below that loss (a
    control: only its tokens to the dense loss are wanted), its final point that evaluation."""
    from noloco_swarm.sim.run import run_simulation
    from noloco_swarm.train.layering import build_config

    steps *= run.get("stretch", 1)
    a: dict[str, Any] = {
        **BASE,
        "seed": run["seed"],
        "inner.total_steps": steps,
        "inner.warmup_steps": warmup,
        "eval_every": eval_every,
        "eval_windows": 100_000,  # as many as data.val_max_windows gives
        "outer.inner_steps": run["H"],
        "wire.activations": run["wire"],
        "model.subspace_rank": run["rank"],
    }
    if run["method"] == "diloco":
        a["outer.diloco_variant"] = "heavyball"
    else:
        a["outer.gamma"] = 0.7
    cfg = build_config("mini", run["method"], assignments={k: str(v) for k, v in a.items()}, env={})
    evals: list[dict] = []

    def seen(_sim: Any, row: dict) -> None:
        evals.append(row)
        if stop_below is not None and row["val_loss"] <= stop_below:
            raise Reached

    start = time.perf_counter()
    try:
        run_simulation(cfg, steps, on_eval=seen)
        stopped = {}
    except Reached:
        stopped = {"stopped_at_step": evals[-1]["step"]}
    curve = [{"step": e["step"], "tokens": e["tokens"], "val_loss": e["val_loss"]} for e in evals]
    return {**run, "steps": steps, "config": cfg.manifest(), "curve": curve, "final": evals[-1],
            "seconds": time.perf_counter() - start} | stopped  # fmt: skip


def tokens_to(curve: list[dict], target: float) -> float | None:
    """Tokens at which the validation loss first reaches `target` (linear between evaluations)."""
    before = None
    for point in curve:
        if point["val_loss"] <= target:
            if before is None:
                return float(point["tokens"])
            share = (before["val_loss"] - target) / (before["val_loss"] - point["val_loss"])
            return before["tokens"] + share * (point["tokens"] - before["tokens"])
        before = point
    return None


def mean_se(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan)


def kind_of(run: dict) -> tuple[str, int, int, str, int]:
    """What a run measures: (wire, rank, H, method, stretch); its seeds share it."""
    return run["wire"], run["rank"], run["H"], run["method"], run.get("stretch", 1)


def rows(runs: dict[str, dict]) -> list[dict]:
    """One row per (wire, rank, H, method, stretch) with every seed's dense run beside it. A
    stretched run has no point at equal tokens: its final loss over the dense run's is
    `final_loss_ratio`, and `loss_ratio_at_equal_tokens` is null."""
    dense = {r["seed"]: r for r in runs.values() if kind_of(r) == DENSE}
    out = []
    for kind in sorted({kind_of(r) for r in runs.values()}):
        paired = [(r, dense[r["seed"]]) for r in runs.values() if kind_of(r) == kind and r["seed"] in dense]
        if not paired:
            continue
        token_ratios: list[float | None] = []
        loss_ratios = []
        worth: list[float | None] = []
        for run, base in paired:
            target = base["final"]["val_loss"]
            ours, theirs = tokens_to(run["curve"], target), tokens_to(base["curve"], target)
            token_ratios.append(ours / theirs if ours is not None and theirs else None)
            loss_ratios.append(run["final"]["val_loss"] / target)
            dense_to_ours = tokens_to(base["curve"], run["final"]["val_loss"])
            worth.append(dense_to_ours / run["curve"][-1]["tokens"] if dense_to_ours is not None else None)
        reached = [x for x in token_ratios if x is not None]
        loss_mean, loss_se = mean_se(loss_ratios)
        tok_mean, tok_se = mean_se(reached) if len(reached) == len(token_ratios) else (None, None)
        wire, rank, h, method, stretch = kind
        equal = stretch == 1
        if any("stopped_at_step" in r for r, _ in paired):  # a control: its final loss means nothing
            loss_mean = loss_se = None
            worth = [None] * len(paired)
        out.append({
            "wire": wire, "rank": rank, "H": h, "method": method, "seeds": len(paired),
            "steps": paired[0][0]["steps"], "tokens_to_dense_loss_ratio": tok_mean,
            "tokens_to_dense_loss_ratio_se": tok_se, "tokens_to_dense_loss_ratio_per_seed": token_ratios,
            "loss_ratio_at_equal_tokens": loss_mean if equal else None,
            "loss_ratio_at_equal_tokens_se": loss_se if equal else None,
            **({} if equal else {"stretch": stretch, "final_loss_ratio": loss_mean, "final_loss_ratio_se": loss_se}),
            "dense_tokens_to_final_loss_ratio_per_seed": worth,
            "final_val_loss": statistics.fmean(r["final"]["val_loss"] for r, _ in paired) if loss_mean is not None else None,
            "val_tokens": paired[0][0]["final"]["val_tokens"],
        } | against_diloco(runs, kind) | same_schedule(runs, kind))  # fmt: skip
    return out


def same_schedule(runs: dict[str, dict], kind: tuple[str, int, int, str, int]) -> dict:
    """For a stretched run: its tokens to the dense run's final loss over those of the dense run
    stretched alike (the control, same seed), both on the same learning-rate schedule; {} for the
    control itself, for runs not stretched, or without a control of that stretch."""
    stretch = kind[-1]
    control_kind = (*DENSE[:-1], stretch)
    if stretch == 1 or kind == control_kind:
        return {}
    dense = {r["seed"]: r for r in runs.values() if kind_of(r) == DENSE}
    control = {r["seed"]: r for r in runs.values() if kind_of(r) == control_kind}
    ratios: list[float | None] = []
    for run in runs.values():
        if kind_of(run) != kind or run["seed"] not in control or run["seed"] not in dense:
            continue
        target = dense[run["seed"]]["final"]["val_loss"]
        ours, theirs = tokens_to(run["curve"], target), tokens_to(control[run["seed"]]["curve"], target)
        ratios.append(ours / theirs if ours is not None and theirs else None)
    if not ratios:
        return {}
    reached = [x for x in ratios if x is not None]
    mean, se = mean_se(reached) if len(reached) == len(ratios) else (None, None)
    return {"tokens_to_dense_loss_ratio_same_schedule": mean, "tokens_to_dense_loss_ratio_same_schedule_se": se,
            "tokens_to_dense_loss_ratio_same_schedule_per_seed": ratios, "same_schedule_seeds": len(ratios)}  # fmt: skip


def against_diloco(runs: dict[str, dict], kind: tuple[str, int, int, str, int]) -> dict:
    """For NoLoCo fp32 at H: its final loss over heavy-ball DiLoCo's at 2H, paired by seed (both
    run the same steps, so at equal tokens); {} for other kinds or without DiLoCo runs."""
    wire, rank, h, method, stretch = kind
    if (wire, rank, method, stretch) != ("fp32", 0, "noloco", 1):
        return {}
    diloco = {r["seed"]: r for r in runs.values() if kind_of(r) == ("fp32", 0, 2 * h, "diloco", 1)}
    ratios = [
        r["final"]["val_loss"] / diloco[r["seed"]]["final"]["val_loss"]
        for r in runs.values()
        if kind_of(r) == kind and r["seed"] in diloco
    ]
    if not ratios:
        return {}
    mean, se = mean_se(ratios)
    return {"loss_ratio_to_diloco_2H": mean, "loss_ratio_to_diloco_2H_se": se, "diloco_2H_seeds": len(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/results/token_cost"))
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument(
        "--shard", default="0/1", help="I/N: run only every N-th run from the I-th (one process per core)"
    )
    ap.add_argument("--stretched", action="store_true", help="run only the stretched runs (STRETCHED)")
    ap.add_argument("--only", default="", help="run only these runs (names, comma-separated) of the plan")
    ap.add_argument("--summarise", action="store_true", help="only write the rows")
    ap.add_argument("--json", type=Path, help="write the rows here (default: OUT/rows.json)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.summarise:
        import torch

        torch.set_num_threads(1)
        index, shards = (int(x) for x in args.shard.split("/"))
        todo = plan(args.seeds, args.stretched)[index::shards]
        if args.only:
            todo = [r for r in todo if r["name"] in args.only.split(",")]
        left = [r for r in todo if not (args.out / f"{r['name']}.json").exists()]
        print(f"{len(todo) - len(left)} of {len(todo)} runs done, {len(left)} to go", flush=True)
        for i, run in enumerate(left):
            if (args.out / f"{run['name']}.json").exists():  # another process took it meanwhile
                continue
            stop = None
            if run.get("stop_at_dense_loss"):
                dense = args.out / f"{run_name(DENSE, run['seed'])}.json"
                stop = json.loads(dense.read_text())["final"]["val_loss"]
            row = run_one(run, args.steps, args.warmup, args.eval_every, stop)
            tmp = args.out / f".{run['name']}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(row))
            os.replace(tmp, args.out / f"{run['name']}.json")  # a run counts once its file is whole
            f = row["final"]
            print(f"[{i + 1}/{len(left)}] {run['name']}: val loss {f['val_loss']:.4f} over "
                  f"{f['val_tokens']} tokens, {row['seconds']:.0f} s", flush=True)  # fmt: skip
    runs = {
        p.stem: json.loads(p.read_text()) for p in sorted(args.out.glob("*.json")) if p.name != "rows.json"
    }
    result = rows(runs)
    (args.json or args.out / "rows.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
