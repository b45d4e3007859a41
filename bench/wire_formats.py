"""What each activation wire format (`wire.activations`: fp32, bf16, int8) costs in perplexity.

The simulator applies the same round trip as the swarm (protocol/wire.py) to every row going
forward and every gradient coming back, so it measures the formats' effect on training without a
network. Every format trains on the same tokens (same steps, batch, replicas, seed and data), and
is evaluated in fp32 on the same held-out windows, so formats are compared per seed, paired over
windows: the standard error of a perplexity ratio is that of the mean per-window loss difference.
Also prints the bytes a replica sends per hop per inner step in each format, for the tiny run
measured here and for the `small` preset's issue-11 shape (batch 8 x 1024 tokens x 768).

Runs go to a pool of worker processes (one torch thread each) and each finished run is appended to
a JSON-lines file; re-running the same command skips finished runs.

    nice -n 10 python bench/wire_formats.py --out runs/wire --json docs/results/wire_formats.json
    python bench/wire_formats.py --out runs/wire-smoke --steps 20 --seeds 1   # a smoke run
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

FORMATS = ("fp32", "bf16", "int8")
KEY = ("fmt", "seed", "replicas", "stages", "steps", "seq_len", "batch_size", "h", "eval_windows")


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    extra = {
        "outer.inner_steps": job["h"],
        "outer.seeded_groups": True,  # seeds vary the partners too, not only the data and init
        "wire.activations": job["fmt"],
    }
    return simulate(job, "noloco", extra)


def wire_bytes(batch: int, seq_len: int, hidden: int) -> dict[str, dict[str, int]]:
    """Bytes one replica sends per hop per inner step: activations + token ids forward, gradients back."""
    from noloco_swarm.protocol import wire

    shape, tokens = (batch, seq_len, hidden), batch * seq_len * 8
    return {
        f: {"forward": wire.nbytes(shape, f) + tokens, "backward": wire.nbytes(shape, f)} for f in FORMATS
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per format: final perplexity per seed, and its ratio to fp32 (paired per seed)."""
    by = {(r["fmt"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    out: dict[str, Any] = {}
    for f in FORMATS:
        runs = [by[(f, s)] for s in seeds if (f, s) in by]
        if runs:
            pairs = [(by[("fp32", s)], by[(f, s)]) for s in seeds if ("fp32", s) in by and (f, s) in by]
            out[f] = seed_summary(runs) | ratios(pairs, "fp32")
    return out


def table(summary: dict[str, Any], sizes: dict[str, dict[str, dict[str, int]]]) -> str:
    lines = [
        "| format | val ppl per seed | mean ± sd | ppl / fp32 per seed (± paired SE) | mean ratio "
        "| tiny run: bytes fwd / bwd per hop per step | small preset (8 x 1024 x 768): MiB fwd / bwd |",
        "|---|---|---|---|---|---|---|",
    ]
    for f, e in summary.items():
        ratios = ", ".join(
            f"{r:.4f} ± {r * se:.4f}" for r, se in zip(e.get("ratio_to_fp32", []), e.get("ratio_to_fp32_se_log", []), strict=True)
        )  # fmt: skip
        tiny, small = sizes["run"][f], sizes["small"][f]
        lines.append(
            f"| {f} | {', '.join(f'{p:.2f}' for p in e['val_ppl'])} | {e['val_ppl_mean']:.2f} ± {e['val_ppl_sd']:.2f} "
            f"| {ratios} | {e.get('ratio_to_fp32_mean', float('nan')):.4f} "
            f"| {tiny['forward']:,} / {tiny['backward']:,} "
            f"| {small['forward'] / 2**20:.2f} / {small['backward'] / 2**20:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/wire"))
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument(
        "--stages", type=int, default=4, help="4: every layer boundary of the tiny preset is a hop"
    )
    add_run_flags(ap, steps=200, warmup=20, eval_every=50, eval_windows=128)
    ap.add_argument("--h", type=int, default=10, help="NoLoCo H (paper: 50 of 25,000 steps)")
    args = ap.parse_args()
    jobs = []
    for seed in range(args.seeds):
        for f in args.formats.split(","):
            jobs.append({
                "fmt": f, "seed": seed, "replicas": args.replicas, "stages": args.stages, "steps": args.steps,
                "warmup": args.warmup, "seq_len": args.seq_len, "batch_size": args.batch_size, "h": args.h,
                "eval_every": args.eval_every, "eval_windows": args.eval_windows,
            })  # fmt: skip

    def describe(row: dict) -> str:
        return (
            f"{row['fmt']} seed {row['seed']}: ppl {row['evals'][-1]['val_ppl']:.3f} ({row['seconds']:.0f} s)"
        )

    done = run_pending(args.out, jobs, KEY, run_one, describe, args.workers)
    setup = {
        k: getattr(args, k)
        for k in ("replicas", "stages", "steps", "seq_len", "batch_size", "h", "eval_windows")
    }
    rows = [r for r in done if all(r[k] == v for k, v in setup.items())]
    from noloco_swarm.model.presets import get_preset

    hidden = get_preset("tiny").hidden_size
    sizes = {"run": wire_bytes(args.batch_size, args.seq_len, hidden), "small": wire_bytes(8, 1024, 768)}
    summary = summarise(rows)
    text = table(summary, sizes)
    (args.out / "summary.md").write_text(text + "\n")
    print(text)
    if args.json:
        command = "python bench/wire_formats.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in {**setup, "seeds": args.seeds, "warmup": args.warmup,
                                                         "eval_every": args.eval_every}.items()
        )  # fmt: skip
        record = {
            "command": command,
            "setup": {**setup, "preset": "tiny", "method": "noloco", "warmup": args.warmup, "seeds": args.seeds,
                      "outer.seeded_groups": True},
            "results": summary,
            "bytes_per_hop_per_step": sizes,
        }  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
