"""Throughput of a 2x2 swarm on emulated internet links: today's schedule against microbatches in
flight and smaller activation formats (needs root: the namespace testbed).

Every peer runs on its own emulated host (`noloco testbed`'s machinery). Each profile is a rate
(tbf on every peer's link) and a one-way delay (user space); each variant is a schedule:
`inner.microbatches` (M) and `wire.activations`. Per profile and variant: tokens/s over outer
periods 2 and 3 (steps H to 3H, outer steps included) and the utilisation, tokens/s over the
best tokens/s of the same swarm on an unshaped link (its compute-bound rate, the best of the
variants run unshaped); and the inner steps' utilisation alone (the best unshaped median step
time over this one's), which leaves out the outer exchange (its weights cross the same link).
Each profile also states the ratio of one hop's activation transfer (fp32, one direction) to a
stage's compute per step, measured from the unshaped run. With --rounds, everything runs again in
each round, each round's shaped runs are divided by that round's best unshaped one, and the
figures are medians over rounds (this machine's pace drifts by 20% within an hour).

    sudo nice -n 10 python bench/wan_throughput.py --out runs/wan_throughput.json
    # the current utilisation figure (docs/benchmarks.md)
    sudo nice -n 10 python bench/wan_throughput.py --batch-size 32 --inner-steps 50 --profiles 20:25 --rounds 3 \
        --variants "today: M=1 fp32,M=5 2:4:4:4:2 int8 overlap H/2 paced pinned" \
        --unshaped "today: M=1 fp32 pinned" --set peer.release_memory=off \
        --out docs/results/wan_throughput_h50_b32_off.json
    # the new schedule as a whole, H = 50, on a link whose fp32 hop transfer exceeds a stage's compute
    sudo nice -n 10 python bench/wan_throughput.py --inner-steps 50 --profiles 20:25 --rounds 3 \
        --variants "today: M=1 fp32,M=2 int8 overlap H/2" --unshaped "today: M=1 fp32,M=2 int8 overlap H/2"
    # a larger batch: more compute per step against the same round trips per step
    sudo nice -n 10 python bench/wan_throughput.py --batch-size 16 --inner-steps 50 --profiles 20:25 \
        --rounds 3 --variants "today: M=1 fp32,M=2 int8 overlap H/2,M=4 int8 overlap H/2" \
        --unshaped "today: M=1 fp32"
    # uneven microbatches against even ones (and the even schedule unshaped: its own overheads)
    EVEN="M=4 int8 overlap H/2" ENDS="M=5 2:4:4:4:2 int8 overlap H/2" MID="M=4 3:5:5:3 int8 overlap H/2"
    sudo nice -n 10 python bench/wan_throughput.py --batch-size 16 --inner-steps 50 --profiles 20:25 \
        --rounds 3 --variants "today: M=1 fp32,$EVEN,$ENDS,$MID" --unshaped "today: M=1 fp32,$EVEN"

A variant's name followed by " pinned" runs the same schedule with each peer and its p2pd on
their own share of the CPUs, as `noloco local` runs them (the testbed's default leaves them free).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from wallclock_validation import (
    measure,
    resolve_values,
    testbed_config,
)  # bench/ is the script's folder: on sys.path

from noloco_swarm.protocol import wire
from noloco_swarm.train.layering import ConfigError, parse_assignments

VARIANTS = {
    "today: M=1 fp32": {},
    "M=4 fp32": {"inner.microbatches": "4"},
    "M=8 fp32": {"inner.microbatches": "8"},
    "M=8 bf16": {"inner.microbatches": "8", "wire.activations": "bf16"},
    "M=8 int8": {"inner.microbatches": "8", "wire.activations": "int8"},
    # The new schedule as a whole: few microbatches (on a CPU each one costs the peer its own
    # handling: docs/benchmarks.md, "Swarm: the cost of real transport"), int8 rows, and the outer
    # exchange overlapped with half of the next period.
    "M=2 int8 overlap H/2": {
        "inner.microbatches": "2",
        "wire.activations": "int8",
        "outer.overlap_steps": "H/2",
    },
    "M=4 int8 overlap H/2": {
        "inner.microbatches": "4",
        "wire.activations": "int8",
        "outer.overlap_steps": "H/2",
    },
    # Uneven microbatches: smaller ones at the ends shorten the fill (the first rows to reach
    # stage 1) and the drain (the last gradients to return) that every step's flush pays on the
    # link. Sizes in sixteenths of the batch (B/16 x 2,4,4,4,2 is 2,4,4,4,2 at B = 16).
    "M=5 2:4:4:4:2 int8 overlap H/2": {
        "inner.microbatches": "5",
        "inner.microbatch_sizes": "2,4,4,4,2/16",
        "wire.activations": "int8",
        "outer.overlap_steps": "H/2",
    },
    # Six microbatches, the ends still the smallest: a shorter fill and drain than 2,4,4,4,2
    # (the wall-clock model: 0.321 s per step against 0.342 s with one GPU per peer), for one
    # more microbatch's handling in the peer.
    "M=6 2:3:3:3:3:2 int8 overlap H/2": {
        "inner.microbatches": "6",
        "inner.microbatch_sizes": "2,3,3,3,3,2/16",
        "wire.activations": "int8",
        "outer.overlap_steps": "H/2",
    },
    "M=4 3:5:5:3 int8 overlap H/2": {
        "inner.microbatches": "4",
        "inner.microbatch_sizes": "3,5,5,3/16",
        "wire.activations": "int8",
        "outer.overlap_steps": "H/2",
    },
}
# The 2,4,4,4,2 schedule with the outer exchange's sending spread over half of the overlap window
# (peer.exchange_pacing): at full speed it fills the link's queue, and every row of the steps it
# overlaps waits behind it.
VARIANTS["M=5 2:4:4:4:2 int8 overlap H/2 paced"] = VARIANTS["M=5 2:4:4:4:2 int8 overlap H/2"] | {
    "peer.exchange_pacing": "0.5"
}


def settings(name: str, inner_steps: int, batch_size: int) -> dict[str, str]:
    """A variant's config values, "H/2" resolved for this H and sizes "a,b,.../16" for this B."""
    return resolve_values(name, VARIANTS[name], inner_steps, batch_size)


PINNED = " pinned"  # a variant's name ending so: its peers pinned to CPUs


def base(name: str) -> str:
    """The schedule of a variant's name (without " pinned")."""
    return name.removesuffix(PINNED)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--profiles", default="10:25", help="RATE_MBIT:ONE_WAY_DELAY_MS, comma-separated")
    ap.add_argument("--variants", default=",".join(list(VARIANTS)[:5]), help="variant names, comma-separated")
    ap.add_argument(
        "--unshaped",
        default="today: M=1 fp32,M=8 fp32",
        help="variants run unshaped (the best one is the 1.0)",
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="repeat everything; figures are the medians over rounds"
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config value for every variant, the unshaped ones included (repeatable)",
    )
    ap.add_argument("--keep", type=Path, default=None, help="keep each run's logs and events here")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    variants, unshaped_variants = args.variants.split(","), args.unshaped.split(",")
    names = {*variants, *unshaped_variants}
    unknown = {base(name) for name in names} - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
    try:  # each --set as `noloco --set` reads it
        common = parse_assignments(";".join(args.set))
    except ConfigError as e:
        ap.error(f"--set: {e}")
    H = args.inner_steps
    cfgs = {
        name: testbed_config(
            args.seq_len, args.batch_size, H, **(common | settings(base(name), H, args.batch_size))
        )
        for name in names
    }
    steps = 3 * H

    def run(name: str, rate: float | None, delay: float, round_: int) -> dict:
        keep = None
        if args.keep is not None:
            keep = args.keep / f"r{round_}-{name.replace(' ', '_').replace(':', '').replace('/', '')}"
        result = measure(cfgs[name], steps, rate, delay, keep, pin=name.endswith(PINNED))
        print(
            f"  {name:22s} rate {rate} Mbit/s, one-way {delay:g} ms: {result['tokens_per_s']:8.0f} tokens/s, "
            f"step {result['step_s']:.3f} s, exchange {result['exchange_s']:.2f} s",
            flush=True,
        )
        return result

    profiles = [tuple(float(x) for x in p.split(":")) for p in args.profiles.split(",")]
    rounds = []
    for round_ in range(args.rounds):  # each round runs everything, so rounds see alike machine states
        print(f"round {round_ + 1} of {args.rounds}, unshaped (the compute-bound rate):")
        unshaped = {name: run(name, None, 0.0, round_) for name in unshaped_variants}
        shaped = {}
        for rate, delay in profiles:
            print(f"round {round_ + 1}, {rate:g} Mbit/s, RTT {2 * delay:g} ms:")
            shaped[f"{rate:g}:{delay:g}"] = {name: run(name, rate, delay, round_) for name in variants}
        rounds.append({"unshaped": unshaped, "shaped": shaped})

    cfg = cfgs["today: M=1 fp32"] if "today: M=1 fp32" in cfgs else next(iter(cfgs.values()))
    rows = (args.batch_size, args.seq_len, cfg.model.hidden_size)
    # Half the unshaped M=1 step: two stages run in series with one batch in flight (pinned or
    # not: the first of today's schedule run unshaped).
    today = [name for name in unshaped_variants if base(name) == "today: M=1 fp32"]
    compute_s = statistics.median(r["unshaped"][today[0]]["step_s"] for r in rounds) / 2 if today else None
    # Each round's shaped runs against the same round's unshaped ones: the best tokens/s (the
    # utilisation) and the fastest inner step (the inner steps' utilisation alone).
    best = [max(r["tokens_per_s"] for r in round_["unshaped"].values()) for round_ in rounds]
    best_step = [min(r["step_s"] for r in round_["unshaped"].values()) for round_ in rounds]
    summary = []
    for rate, delay in profiles:
        tag = f"{rate:g}:{delay:g}"
        hop_s = wire.nbytes(rows, "fp32") * 8 / (rate * 1e6)
        entry = {
            "rate_mbit": rate,
            "rtt_ms": 2 * delay,
            "fp32_hop_transfer_s": hop_s,
            "hop_transfer_over_stage_compute": None if compute_s is None else hop_s / compute_s,
            "utilisation": {},
            "utilisation_per_round": {},
            "inner_step_utilisation": {},
            "tokens_per_s": {},
        }
        for name in variants:
            runs = [round_["shaped"][tag][name] for round_ in rounds]
            utilisation = [r["tokens_per_s"] / b for r, b in zip(runs, best, strict=True)]
            entry["utilisation_per_round"][name] = utilisation
            entry["utilisation"][name] = statistics.median(utilisation)
            entry["inner_step_utilisation"][name] = statistics.median(
                b / r["step_s"] for r, b in zip(runs, best_step, strict=True)
            )
            entry["tokens_per_s"][name] = statistics.median(r["tokens_per_s"] for r in runs)
        summary.append(entry)
        ratio = entry["hop_transfer_over_stage_compute"]
        print(
            f"{rate:g} Mbit/s, RTT {2 * delay:g} ms "
            f"(fp32 hop transfer / stage compute per step: {'?' if ratio is None else f'{ratio:.2f}'}); "
            f"medians over {args.rounds} round(s):"
        )
        for name, u in entry["utilisation"].items():
            shown = ", ".join(f"{x:.3f}" for x in entry["utilisation_per_round"][name])
            print(
                f"  {name:22s} utilisation {u:.3f} (rounds {shown}; {entry['tokens_per_s'][name]:.0f} tokens/s); "
                f"inner steps alone {entry['inner_step_utilisation'][name]:.3f}"
            )
    print(f"best unshaped per round: {', '.join(f'{b:.0f}' for b in best)} tokens/s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": "sudo nice -n 10 python bench/wan_throughput.py " + " ".join(sys.argv[1:]),
            "config": {"preset": "tiny", "stages": 2, "replicas": 2, "steps": steps}
            | {
                k: v
                for k, v in vars(args).items()
                if k in ("seq_len", "batch_size", "inner_steps", "profiles", "rounds")
            },
            "every_variant": common,
            "variants": {
                name: settings(base(name), H, args.batch_size)
                | ({"pinned": "true"} if name.endswith(PINNED) else {})
                for name in sorted(cfgs)
            },
            "stage_compute_per_step_s": compute_s,
            "stage_compute_note": "half the unshaped M=1 step (median over rounds): two stages run in "
            "series with one batch in flight",
            "best_unshaped_tokens_per_s_per_round": best,
            "profiles": summary,
            "rounds": rounds,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
