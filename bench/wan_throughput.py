"""Throughput of a 2x2 swarm on emulated internet links: today's schedule against microbatches in
flight and smaller activation formats (needs root: the namespace testbed).

Every peer runs on its own emulated host (`noloco testbed`'s machinery). Each profile is a rate
(tbf on every peer's link) and a one-way delay (user space); each variant is a schedule:
`inner.microbatches` (M) and `wire.activations`. Per profile and variant: tokens/s over outer
periods 2 and 3 (steps H to 3H, outer steps included) and the utilisation, tokens/s over the
best tokens/s of the same swarm on an unshaped link (its compute-bound rate, the best of the
variants run unshaped); and the inner steps' utilisation alone (the best unshaped median step
time over this one's), which leaves out the outer exchange (its weights cross the same link). Each profile also states the ratio of one hop's activation transfer
(fp32, one direction) to a stage's compute per step, measured from the unshaped run.

    sudo nice -n 10 python bench/wan_throughput.py --out docs/results/wan_throughput.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from wallclock_validation import measure, testbed_config  # bench/ is the script's folder: on sys.path

from noloco_swarm.protocol import wire

VARIANTS = {
    "today: M=1 fp32": {},
    "M=4 fp32": {"inner.microbatches": "4"},
    "M=8 fp32": {"inner.microbatches": "8"},
    "M=8 bf16": {"inner.microbatches": "8", "wire.activations": "bf16"},
    "M=8 int8": {"inner.microbatches": "8", "wire.activations": "int8"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--profiles", default="10:25", help="RATE_MBIT:ONE_WAY_DELAY_MS, comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="variant names, comma-separated")
    ap.add_argument(
        "--unshaped",
        default="today: M=1 fp32,M=8 fp32",
        help="variants run unshaped (the best one is the 1.0)",
    )
    ap.add_argument("--keep", type=Path, default=None, help="keep each run's logs and events here")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cfgs = {
        name: testbed_config(args.seq_len, args.batch_size, args.inner_steps, **VARIANTS[name])
        for name in {*args.variants.split(","), *args.unshaped.split(",")}
    }
    steps = 3 * args.inner_steps

    def run(name: str, rate: float | None, delay: float) -> dict:
        keep = (
            None
            if args.keep is None
            else args.keep / f"{name.replace(' ', '_').replace(':', '')}-{rate}-{delay}"
        )
        result = measure(cfgs[name], steps, rate, delay, keep)
        print(
            f"  {name:18s} rate {rate} Mbit/s, one-way {delay:g} ms: {result['tokens_per_s']:8.0f} tokens/s, "
            f"step {result['step_s']:.3f} s, exchange {result['exchange_s']:.2f} s",
            flush=True,
        )
        return result

    print("unshaped (the compute-bound rate):")
    unshaped = {name: run(name, None, 0.0) for name in args.unshaped.split(",")}
    best = max(r["tokens_per_s"] for r in unshaped.values())
    best_step = min(r["step_s"] for r in unshaped.values())  # inner steps only, outer steps apart
    cfg = cfgs["today: M=1 fp32"] if "today: M=1 fp32" in cfgs else next(iter(cfgs.values()))
    rows = (args.batch_size, args.seq_len, cfg.model.hidden_size)
    compute_s = unshaped["today: M=1 fp32"]["step_s"] / 2 if "today: M=1 fp32" in unshaped else None
    profiles = []
    for profile in args.profiles.split(","):
        rate, delay = (float(x) for x in profile.split(":"))
        print(f"{rate:g} Mbit/s, RTT {2 * delay:g} ms:")
        hop_s = wire.nbytes(rows, "fp32") * 8 / (rate * 1e6)
        runs = {name: run(name, rate, delay) for name in args.variants.split(",")}
        profiles.append(
            {
                "rate_mbit": rate,
                "rtt_ms": 2 * delay,
                "fp32_hop_transfer_s": hop_s,
                "hop_transfer_over_stage_compute": None if compute_s is None else hop_s / compute_s,
                "runs": runs,
                "utilisation": {name: r["tokens_per_s"] / best for name, r in runs.items()},
                "inner_step_utilisation": {name: best_step / r["step_s"] for name, r in runs.items()},
            }
        )
    for p in profiles:
        ratio = p["hop_transfer_over_stage_compute"]
        print(
            f"{p['rate_mbit']:g} Mbit/s, RTT {p['rtt_ms']:g} ms "
            f"(fp32 hop transfer / stage compute per step: {'?' if ratio is None else f'{ratio:.1f}'})"
        )
        for name, u in p["utilisation"].items():
            print(
                f"  {name:18s} utilisation {u:.3f}  ({p['runs'][name]['tokens_per_s']:.0f} tokens/s); "
                f"inner steps alone {p['inner_step_utilisation'][name]:.3f}"
            )
    print(f"best unshaped: {best:.0f} tokens/s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": "sudo nice -n 10 python bench/wan_throughput.py " + " ".join(sys.argv[1:]),
            "config": {"preset": "tiny", "stages": 2, "replicas": 2, "steps": steps}
            | {
                k: v
                for k, v in vars(args).items()
                if k in ("seq_len", "batch_size", "inner_steps", "profiles")
            },
            "variants": {name: VARIANTS[name] for name in cfgs},
            "stage_compute_per_step_s": compute_s,
            "stage_compute_note": "half the unshaped M=1 step: two stages run in series with one batch in flight",
            "unshaped": unshaped,
            "best_unshaped_tokens_per_s": best,
            "profiles": profiles,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
