"""The long fuzz run: every target of tests/fuzz with many more inputs than CI, counted per target.

CI (tests/unit/test_fuzz.py) runs each target with its fixed, derandomized budget; this runs each
with `--scale` times that budget from a seeded random start, so it explores other inputs, counts
every input fed (hypothesis's generation, its shrinking and its explicit examples alike), and
records each failure with the minimal input hypothesis shrank it to. Hypothesis only: atheris
(coverage-guided) is not installed in this environment.

    PYTHONPATH=. nice -n 10 python bench/fuzz.py --scale 40 --json docs/results/fuzz.json
    PYTHONPATH=. python bench/fuzz.py --scale 1 --only 'wire|chunks'          # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Any

import hypothesis
import torch
from hypothesis import HealthCheck, given, seed, settings

from tests.fuzz import TARGETS, Target


def run_target(target: Target, examples: int, run_seed: int) -> dict[str, Any]:
    """Feed `target` about `examples` inputs; its input count, time, and failure if any."""
    fed = 0
    last_failing: str | None = None

    def counted(value: object) -> None:
        nonlocal fed, last_failing
        fed += 1
        try:
            target.check(value)
        except BaseException:
            last_failing = repr(value)[:2000]  # hypothesis replays the shrunk input last
            raise

    @seed(run_seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(target.strategy)
    def run(value: object) -> None:
        counted(value)

    start = time.perf_counter()
    failure = None
    try:
        run()
    except Exception as e:  # noqa: BLE001 - any failure of the target is recorded; the run goes on
        failure = f"{type(e).__name__}: {str(e)[:2000]}"
    return {
        "inputs": fed,
        "failures": int(failure is not None),
        "seconds": round(time.perf_counter() - start, 1),
        "contract": target.contract,
        "failure": failure,
        "minimal_failing_input": last_failing if failure else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scale", type=int, default=40, help="inputs per target, in CI budgets (default 40)")
    parser.add_argument("--seed", type=int, default=10, help="hypothesis seed (default 10)")
    parser.add_argument("--only", default="", help="regex: run only the targets whose name matches")
    parser.add_argument("--json", type=Path, help="write the counts here (docs/results/fuzz.json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    chosen = [t for name, t in sorted(TARGETS.items()) if re.search(args.only, name)]
    results = {}
    for target in chosen:
        results[target.name] = result = run_target(target, target.ci_examples * args.scale, args.seed)
        status = "ok" if not result["failures"] else f"FAILED {result['failure'][:200]}"
        print(
            f"{target.name:55s} {result['inputs']:8d} inputs {result['seconds']:7.1f} s  {status}", flush=True
        )
    total = sum(r["inputs"] for r in results.values())
    failures = sum(r["failures"] for r in results.values())
    print(f"{'total':55s} {total:8d} inputs, {failures} targets failed")
    if args.json:
        report = {
            "command": f"PYTHONPATH=. nice -n 10 python bench/fuzz.py --scale {args.scale} --seed {args.seed}"
            + (f" --only '{args.only}'" if args.only else ""),
            "engine": f"hypothesis {hypothesis.__version__} (atheris not installed)",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
            "total_inputs": total,
            "targets_failed": failures,
            "targets": results,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
