"""Resumable simulator sweeps for the benchmarks (convergence, wire formats, overlap).

Every finished run is one JSON line in OUT/runs.jsonl, so an interrupted sweep continues where it
stopped: a job whose key fields match a recorded run is not run again. Runs go to a pool of
spawned workers (each a fresh interpreter with its own torch threads).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
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
