"""Projected tokens/s and utilisation of the small, medium and large presets on H100-class GPUs.

Runs the wall-clock model (noloco_swarm/sim/wallclock.py) for every preset, link and schedule
below and writes a JSON file, a markdown table (printed) and a plot. Nothing here is measured:
the inputs are stated, the model is checked against hand-worked cases in
tests/unit/test_wallclock.py and against testbed runs in docs/results/wallclock_validation.json.

Assumptions (all flags):
- one GPU per peer at `--peak-tflops` (H100 SXM, dense bf16: 989) x `--mfu` (0.4); a stage's
  forward costs 2 FLOPs per matmul weight per token plus 4 x seq x hidden per layer for attention
  (no causal discount); backward 2x forward; optimizer and outer-step compute ignored;
- P = 4 stages, D = 4 replicas, B = 8 samples of the preset's 1024 tokens per replica and step;
- every peer's link symmetric at the given rate, RTT 50 ms between any two peers, 95.6% of the
  rate carrying payload (TCP over Ethernet at MTU 1500), links shared max-min fairly, messages on
  one peer pair in order;
- NoLoCo: H = 50, pairs; DiLoCo: H = 100, sharded all-reduce over the D replicas.

    python bench/wallclock_projection.py --out docs/results/wallclock_projection.json \\
        --plot docs/img/wallclock_projection.png
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from noloco_swarm.model.presets import get_preset
from noloco_swarm.sim.costs import preset_stages
from noloco_swarm.sim.wallclock import (
    TCP_EFFICIENCY,
    Link,
    Schedule,
    Swarm,
    compute_bound_tokens_per_s,
    resource_bound_s,
    simulate,
)


def schedules(m: int) -> list[tuple[str, Schedule, int]]:
    """(label, schedule, H): today's schedule first, then the new one's parts one at a time."""
    k_noloco, k_diloco = 10, 20  # H/5
    return [
        ("today: M=1 fp32, blocking", Schedule(microbatches=1, wire="fp32", overlap_steps=0), 50),
        (f"M={m} fp32, blocking", Schedule(microbatches=m, wire="fp32", overlap_steps=0), 50),
        (f"M={m} bf16, blocking", Schedule(microbatches=m, wire="bf16", overlap_steps=0), 50),
        (
            f"new: M={m} bf16, overlap k={k_noloco}",
            Schedule(microbatches=m, wire="bf16", overlap_steps=k_noloco),
            50,
        ),
        (
            f"new: M={m} int8, overlap k={k_noloco}",
            Schedule(microbatches=m, wire="int8", overlap_steps=k_noloco),
            50,
        ),
        ("DiLoCo today: M=1 fp32, blocking", Schedule(exchange="diloco"), 100),
        (
            f"DiLoCo new: M={m} bf16, overlap k={k_diloco}",
            Schedule(microbatches=m, wire="bf16", overlap_steps=k_diloco, exchange="diloco"),
            100,
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100 SXM)")
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rtt-ms", type=float, default=50.0)
    ap.add_argument(
        "--microbatches", type=int, default=8, help="M of the new schedule (at most the batch size)"
    )
    ap.add_argument("--presets", nargs="+", default=["small", "medium", "large"])
    ap.add_argument("--rates-mbit", nargs="+", type=float, default=[100.0, 1000.0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument(
        "--tables-from", type=Path, default=None, help="no model runs: tables and plot of this --out file"
    )
    args = ap.parse_args()
    if args.tables_from is not None:
        earlier = json.loads(args.tables_from.read_text())
        print(table(earlier["rows"]) + "\n\n" + summary(earlier["rows"]))
        if args.plot is not None:
            plot(earlier["rows"], earlier["assumptions"], args.plot)
        return
    flops = args.peak_tflops * 1e12 * args.mfu
    assumptions = {
        "gpu_peak_tflops": args.peak_tflops,
        "mfu": args.mfu,
        "sustained_tflops": flops / 1e12,
        "stages": args.stages,
        "replicas": args.replicas,
        "batch_size": args.batch_size,
        "microbatches": args.microbatches,
        "rtt_ms": args.rtt_ms,
        "tcp_payload_efficiency": TCP_EFFICIENCY,
    }
    rows = []
    for preset in args.presets:
        cfg = get_preset(preset)
        stages = preset_stages(cfg, args.stages, flops)
        for rate in args.rates_mbit:
            link = Link.symmetric(rate, rtt_s=args.rtt_ms / 1000, efficiency=TCP_EFFICIENCY)
            for label, schedule, H in schedules(args.microbatches):
                swarm = Swarm(
                    stages,
                    replicas=args.replicas,
                    batch=args.batch_size,
                    seq_len=cfg.seq_len,
                    hidden=cfg.hidden_size,
                    inner_steps=H,
                    link=link,
                )
                t = simulate(swarm, schedule)
                bound = resource_bound_s(swarm, schedule)
                rows.append(
                    {
                        "preset": preset,
                        "rate_mbit": rate,
                        "schedule": label,
                        "config": asdict(schedule) | {"inner_steps": H},
                        "tokens_per_s": t.tokens_per_s,
                        "utilisation": t.utilisation,
                        "utilisation_floor": swarm.tokens_per_step
                        / bound
                        / compute_bound_tokens_per_s(swarm),
                        "step_s": t.step_s,
                        "period_s": t.period_s,
                        "exchange_s": t.exchange_s,
                        "compute_per_step_s": [
                            args.batch_size * (s.forward_s + s.backward_s) for s in stages
                        ],
                        "busy": list(t.busy),
                    }
                )
                print(
                    f"{preset:6s} {rate:6g} Mbit/s  {label:36s} {t.tokens_per_s:10.0f} tok/s  util {t.utilisation:.3f}"
                )
    print()
    print(table(rows))
    print()
    print(summary(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": "python bench/wallclock_projection.py " + " ".join(sys.argv[1:]),
            "assumptions": assumptions,
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot is not None:
        plot(rows, assumptions, args.plot)


def link_label(rate_mbit: float) -> str:
    return f"{rate_mbit / 1000:g} Gbit/s" if rate_mbit >= 1000 else f"{rate_mbit:g} Mbit/s"


def groups(rows: list[dict]) -> list[tuple[str, float]]:
    """The (preset, rate) pairs of the rows, in order."""
    return list(dict.fromkeys((r["preset"], r["rate_mbit"]) for r in rows))


def summary(rows: list[dict]) -> str:
    """One line per preset and link: today's schedule against the new one (bf16 and int8)."""
    lines = [
        "| preset | link | today: tokens/s | today: util. | new, bf16: tokens/s | new, bf16: util. "
        "| new, int8: tokens/s | new, int8: util. | int8 floor util. | new int8 / today "
        "| DiLoCo today / new bf16: tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for preset, rate in groups(rows):
        # rows of a group come in the order of `schedules`
        a, _, _, b, c, dtoday, dnew = [r for r in rows if (r["preset"], r["rate_mbit"]) == (preset, rate)]
        lines.append(
            f"| {preset} | {link_label(rate)} | {a['tokens_per_s']:,.0f} | {a['utilisation']:.4f} "
            f"| {b['tokens_per_s']:,.0f} | {b['utilisation']:.3f} | {c['tokens_per_s']:,.0f} "
            f"| {c['utilisation']:.3f} | {c['utilisation_floor']:.3f} "
            f"| **{c['tokens_per_s'] / a['tokens_per_s']:.1f}x** "
            f"| {dtoday['tokens_per_s']:,.0f} / {dnew['tokens_per_s']:,.0f} |"
        )
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = [
        "| preset | link | schedule | tokens/s | utilisation | floor's utilisation | s per step | exchange s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        link = link_label(r["rate_mbit"])
        lines.append(
            f"| {r['preset']} | {link} | {r['schedule']} | {r['tokens_per_s']:,.0f} | {r['utilisation']:.3f} "
            f"| {r['utilisation_floor']:.3f} | {r['step_s']:.2f} | {r['exchange_s']:.1f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], assumptions: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["schedule"] for r in rows))
    pairs = groups(rows)
    fig, axes = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        by = {(r["preset"], r["rate_mbit"]): r for r in rows if r["schedule"] == label}
        xs = [g + (i - (len(labels) - 1) / 2) * width for g in range(len(pairs))]
        axes[0].bar(xs, [by[g]["tokens_per_s"] for g in pairs], width, label=label)
        axes[1].bar(xs, [by[g]["utilisation"] for g in pairs], width, label=label)
    axes[0].set_yscale("log")
    axes[0].set_ylabel(f"tokens/s ({assumptions['stages'] * assumptions['replicas']} GPUs)")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("utilisation of the busiest GPU")
    axes[1].set_xticks(range(len(pairs)))
    axes[1].set_xticklabels([f"{p}\n{link_label(r)}" for p, r in pairs])
    axes[0].legend(fontsize=8, ncol=2)
    a = assumptions
    axes[0].set_title(
        f"Wall-clock model: P={a['stages']} x D={a['replicas']} on H100s at {a['mfu']:.0%} MFU, "
        f"B={a['batch_size']} x 1024 tokens, RTT {a['rtt_ms']:g} ms"
    )
    for ax in axes:
        ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
