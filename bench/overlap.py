"""What an overlapped outer exchange (`outer.overlap_steps = k`) costs in perplexity.

With k > 0 a replica keeps training for k inner steps while its outer exchange is in flight, then
applies the outer step to the boundary's snapshot and carries the k steps' progress over
(protocol/outer.py `carry_over`). The simulator applies the same rule as the peers, so it measures
the cost without a network. Every k trains on the same tokens (same steps, batch, replicas, seed,
data and partners) and is evaluated on the same held-out windows, so each k is compared with k = 0
per seed, paired over windows: the standard error of a perplexity ratio is that of the mean
per-window loss difference. k runs over 0, 1, H/5 and H/2 for NoLoCo (and DiLoCo's heavy-ball
baseline with its own H, if asked).

Runs go to a pool of worker processes (one torch thread each) and each finished run is appended to
a JSON-lines file; re-running the same command skips finished runs.

    nice -n 10 python bench/overlap.py --out runs/overlap --json docs/results/overlap.json
    python bench/overlap.py --out runs/overlap-smoke --steps 20 --seeds 1 --h 10   # a smoke run
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from runlog import (  # bench/ is the script's folder: on sys.path
    add_run_flags,
    ratios,
    run_pending,
    seed_summary,
    simulate,
)

KEY = ("method", "k", "seed", "replicas", "stages", "steps", "seq_len", "batch_size", "h", "eval_windows")


def overlaps(h: int) -> list[int]:
    """k = 0, 1, H/5 and H/2 (rounded down, distinct, each below H)."""
    return sorted({k for k in (0, 1, h // 5, h // 2) if k < h})


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    base, _, variant = job["method"].partition("-")
    extra: dict[str, Any] = {"outer.inner_steps": job["h"], "outer.overlap_steps": job["k"]}
    if base == "noloco":
        extra["outer.seeded_groups"] = True  # seeds vary the partners too
    if variant:
        extra["outer.diloco_variant"] = variant
    return simulate(job, base, extra)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method and k: final perplexity per seed, and its ratio to k = 0 (paired per seed)."""
    by = {(r["method"], r["k"], r["seed"]): r for r in rows}
    out: dict[str, Any] = {}
    for method in sorted({r["method"] for r in rows}):
        seeds = sorted({s for m, _, s in by if m == method})
        for k in sorted({k for m, k, _ in by if m == method}):
            runs = [by[(method, k, s)] for s in seeds if (method, k, s) in by]
            pairs = [(by[(method, 0, s)], by[(method, k, s)]) for s in seeds if (method, 0, s) in by and (method, k, s) in by]  # fmt: skip
            entry = {"method": method, "k": k, "h": runs[0]["h"]} | seed_summary(runs) | ratios(pairs, "k0")
            out[f"{method} k={k}"] = entry
    return out


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| method | H | k | val ppl per seed | mean | ppl / (k = 0) per seed (± paired SE) | mean ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in summary.values():
        ratios = ", ".join(
            f"{r:.4f} ± {r * se:.4f}" for r, se in zip(e.get("ratio_to_k0", []), e.get("ratio_to_k0_se_log", []), strict=True)
        )  # fmt: skip
        lines.append(
            f"| {e['method']} | {e['h']} | {e['k']} | {', '.join(f'{p:.2f}' for p in e['val_ppl'])} "
            f"| {e['val_ppl_mean']:.2f} | {ratios} | {e.get('ratio_to_k0_mean', float('nan')):.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/overlap"))
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--methods", default="noloco", help="noloco and/or diloco-heavyball, diloco-nesterov")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    add_run_flags(ap, steps=200, warmup=20, eval_every=50, eval_windows=128)
    ap.add_argument("--h", type=int, default=10, help="H of every method (paper: 50 of 25,000 steps)")
    args = ap.parse_args()
    jobs = []
    for seed in range(args.seeds):
        for method in args.methods.split(","):
            for k in overlaps(args.h):
                jobs.append({
                    "method": method, "k": k, "seed": seed, "replicas": args.replicas, "stages": args.stages,
                    "steps": args.steps, "warmup": args.warmup, "seq_len": args.seq_len,
                    "batch_size": args.batch_size, "h": args.h, "eval_every": args.eval_every,
                    "eval_windows": args.eval_windows,
                })  # fmt: skip

    def describe(row: dict) -> str:
        return f"{row['method']} k={row['k']} seed {row['seed']}: ppl {row['evals'][-1]['val_ppl']:.3f} ({row['seconds']:.0f} s)"

    done = run_pending(args.out, jobs, KEY, run_one, describe, args.workers)
    setup = {
        k: getattr(args, k)
        for k in ("methods", "replicas", "stages", "steps", "seq_len", "batch_size", "h", "eval_windows")
    }
    methods = set(args.methods.split(","))
    rows = [
        r for r in done
        if r["method"] in methods and r["seed"] < args.seeds
        and all(r[k] == v for k, v in setup.items() if k != "methods")
    ]  # fmt: skip
    summary = summarise(rows)
    text = table(summary)
    (args.out / "summary.md").write_text(text + "\n")
    print(text)
    if args.json:
        command = "python bench/overlap.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in {**setup, "seeds": args.seeds, "warmup": args.warmup,
                                                         "eval_every": args.eval_every}.items()
        )  # fmt: skip
        record = {
            "command": command,
            "setup": {**setup, "preset": "tiny", "warmup": args.warmup, "seeds": args.seeds,
                      "overlaps": overlaps(args.h), "outer.seeded_groups (noloco)": True},
            "results": summary,
        }  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
