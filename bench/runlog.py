"""Resumable simulator sweeps for the benchmarks (convergence, wire formats, overlap).

Every finished run is one JSON line in OUT/runs.jsonl, so an interrupted sweep continues where it
stopped: a job whose key fields match a recorded run is not run again. Runs go to a pool of
spawned workers (each a fresh interpreter with one torch thread). A job is a dict of the run's
shape (replicas, stages, seed, steps, warmup, seq_len, batch_size, eval_every, eval_windows) plus
whatever the sweep varies; `simulate` runs one, and `seed_summary` / `paired` compare variants
run on the same tokens and held-out windows.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def add_run_flags(
    ap: argparse.ArgumentParser, *, steps: int, warmup: int, eval_every: int, eval_windows: int
) -> None:
    """The flags every sweep shares: seeds, run length, window shape, evaluation, workers."""
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=eval_every)
    ap.add_argument("--eval-windows", type=int, default=eval_windows)
    ap.add_argument("--workers", type=int, default=2)


def run_pending(
    out: Path,
    jobs: list[Row],
    key: tuple[str, ...],
    run_one: Callable[[Row], Row],
    describe: Callable[[Row], str],
    workers: int,
) -> list[Row]:
    """Run the jobs not yet recorded in OUT/runs.jsonl (matched on `key`), recording each as it
    ends; returns every recorded run, earlier ones included."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    done = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    finished = {tuple(r[k] for k in key) for r in done}
    todo = [job for job in jobs if tuple(job[k] for k in key) not in finished]
    print(f"{len(done)} runs already done, {len(todo)} to go, {workers} workers", flush=True)
    with mp.get_context("spawn").Pool(workers) as pool, log.open("a") as file:
        for row in pool.imap_unordered(run_one, todo):
            file.write(json.dumps(row) + "\n")
            file.flush()
            done.append(row)
            print(describe(row), flush=True)
    return done


def simulate(job: Row, method: str, extra: Row, *, window_losses: bool = True) -> Row:
    """Run one job in the simulator (`method`, the job's shape, then `extra` config keys); the job
    with its evaluations, state hash, seconds and (if asked) the last evaluation's per-window
    losses, for paired comparisons."""
    import torch

    torch.set_num_threads(1)
    from noloco_swarm.sim.run import run_simulation
    from noloco_swarm.train.layering import build_config

    assignments = {
        "num_replicas": job["replicas"],
        "num_stages": job["stages"],
        "seed": job["seed"],
        "model.seq_len": job["seq_len"],
        "inner.batch_size": job["batch_size"],
        "inner.total_steps": job["steps"],
        "inner.warmup_steps": job["warmup"],
        "eval_every": job["eval_every"],
        "eval_windows": job["eval_windows"],
        **extra,
    }
    cfg = build_config("tiny", method, assignments={k: str(v) for k, v in assignments.items()}, env={})
    windows: list[float] = []
    start = time.perf_counter()
    result = run_simulation(
        cfg,
        job["steps"],
        on_eval=lambda sim, _: windows.__setitem__(slice(None), sim.last_window_losses.tolist()),
    )
    row = {**job, "evals": result.evals}
    if window_losses:
        row["window_losses"] = windows  # per held-out window at the last evaluation
    return row | {"state_hash": result.state_hash, "seconds": time.perf_counter() - start}


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """ppl(b) / ppl(a) from per-window losses, and the standard error of its log (paired over windows)."""
    diffs = [y - x for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return math.exp(statistics.fmean(diffs)), se


def seed_summary(runs: list[Row]) -> Row:
    """One variant's seeds: final perplexity per seed, its mean and sd, the evaluated tokens, the
    seconds, and the mean perplexity over seeds at every evaluation."""
    ppl = [r["evals"][-1]["val_ppl"] for r in runs]
    steps = [e["step"] for e in runs[0]["evals"]]
    return {
        "val_ppl": ppl,
        "val_ppl_mean": statistics.fmean(ppl),
        "val_ppl_sd": statistics.stdev(ppl) if len(ppl) > 1 else 0.0,
        "val_tokens": runs[0]["evals"][-1]["val_tokens"],
        "seconds": [round(r["seconds"], 1) for r in runs],
        "curve": {
            str(t): statistics.fmean(r["evals"][i]["val_ppl"] for r in runs) for i, t in enumerate(steps)
        },
    }


def ratios(pairs: list[tuple[Row, Row]], name: str) -> Row:
    """`paired` over (reference run, run) pairs of one seed each, as ratio_to_{name} fields."""
    got = [paired(ref["window_losses"], run["window_losses"]) for ref, run in pairs]
    if not got:
        return {}
    return {
        f"ratio_to_{name}": [g[0] for g in got],
        f"ratio_to_{name}_se_log": [g[1] for g in got],
        f"ratio_to_{name}_mean": statistics.fmean(g[0] for g in got),
    }
