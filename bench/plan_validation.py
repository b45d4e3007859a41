"""The wall-clock model against the testbed for the planner's kind of schedule: microbatches in
flight, a compressed boundary and an overlapped, capped exchange (needs root: the namespace
testbed).

A 2x2 tiny swarm, every peer on its own emulated host, pinned as `noloco local` pins it (on 2
cores, replica d's two stages share CPU d; the model is told so: `Swarm.colocated`). Per
schedule, one unshaped run calibrates the model's one free input, the compute of a step: the
compute scale at which the model, on an unbounded link, gives the unshaped run's tokens/s (its
pipeline bubble, per-microbatch handling and outer steps included). Each shaped run is then
predicted from the link's rate and RTT, the bytes of the schedule, the transport's round trips
per message (`--hop-rtts`) and the exchange's measured goodput (capped at 93% of the link, as the
planner's configs cap it), and compared with its tokens/s over outer periods 2 and 3.

    sudo nice -n 10 python bench/plan_validation.py --out docs/results/plan_validation.json \
        --runs docs/results/plan_validation_runs.json

With --rounds, everything runs again in each round (each round's shaped runs predicted from that
round's unshaped one): this machine's pace drifts.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from wallclock_validation import (
    measure,
    model_swarm,
    resolve_values,
    testbed_config,
)  # bench/ is the script's folder: on sys.path

from noloco_swarm.sim.wallclock import (
    EXCHANGE_CAP,
    EXCHANGE_GOODPUT,
    TCP_EFFICIENCY,
    Link,
    Schedule,
    Swarm,
    simulate,
)
from noloco_swarm.train.config import RunConfig

# Schedules the planner proposes, at the testbed's scale (tiny: hidden 128). Sizes are sixteenths
# of the batch. int8 sends 140 bytes per token each way (forward: with its token id); subspace at
# k = 8 sends 20, a seventh of that.
SCHEDULES: dict[str, dict[str, str]] = {
    "M=4 int8 overlap H/2 capped": {
        "inner.microbatches": "4",
        "wire.activations": "int8",
        "outer.overlap_steps": "H/2",
    },
    "M=5 2:4:4:4:2 int8 overlap H/2 capped": {
        "inner.microbatches": "5",
        "inner.microbatch_sizes": "2,4,4,4,2/16",
        "wire.activations": "int8",
        "outer.overlap_steps": "H/2",
    },
    "M=4 subspace k=8 overlap H/2 capped": {
        "inner.microbatches": "4",
        "wire.activations": "subspace",
        "model.subspace_rank": "8",
        "outer.overlap_steps": "H/2",
    },
}


def settings(name: str, inner_steps: int, batch_size: int, rate_mbit: float | None) -> dict[str, str]:
    """A schedule's config values for this H, B and link: "H/2" and "/16" sizes resolved, the
    exchange capped at 93% of a shaped link's rate."""
    out = resolve_values(name, SCHEDULES[name], inner_steps, batch_size)
    if rate_mbit:
        out["peer.exchange_max_mbit"] = f"{EXCHANGE_CAP * rate_mbit:g}"
    return out


def schedule_of(cfg: RunConfig) -> Schedule:
    sizes = cfg.inner.microbatch_sizes
    return Schedule(
        microbatches=cfg.inner.microbatches,
        wire=cfg.wire.activations,
        overlap_steps=cfg.outer.overlap_steps,
        microbatch_sizes=tuple(sizes) if sizes else (),
        rank=cfg.model.subspace_rank if cfg.wire.activations == "subspace" else 0,
    )


def swarm_of(cfg: RunConfig, compute_scale: float, link: Link, hop_rtts: float) -> Swarm:
    """The model's swarm: a step's compute of `compute_scale` seconds per stage, forward 1 :
    backward 2, both stages of a replica on one processor."""
    goodput = EXCHANGE_GOODPUT["capped"] if cfg.peer.exchange_max_mbit != 0 else None  # None: auto
    return model_swarm(
        cfg, compute_scale, link, per_stage=True, hop_rtts=hop_rtts, exchange_goodput=goodput, colocated=True
    )


def calibrate(cfg: RunConfig, unshaped_tokens_s: float) -> float:
    """The compute scale (seconds per stage per step) at which the model on an unbounded link
    gives the measured tokens/s; on such a link the model's time is linear in the compute."""
    unbounded = Link.symmetric(math.inf, efficiency=TCP_EFFICIENCY)
    unit = simulate(swarm_of(cfg, 1.0, unbounded, 0.0), schedule_of(cfg))
    return unit.tokens_per_s / unshaped_tokens_s


def predict(cfg: RunConfig, scale: float, rate_mbit: float, rtt_ms: float, hop_rtts: float) -> float:
    link = Link.symmetric(rate_mbit, rtt_s=rtt_ms / 1000, efficiency=TCP_EFFICIENCY)
    return simulate(swarm_of(cfg, scale, link, hop_rtts), schedule_of(cfg)).tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument(
        "--profiles", default="10:25,20:25,40:10", help="RATE_MBIT:ONE_WAY_DELAY_MS, comma-separated"
    )
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="schedule names, comma-separated")
    ap.add_argument(
        "--hop-rtts", type=float, default=1.0, help="the model's round trips per pipeline message"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--measured", type=Path, default=None, help="no runs: the measurements of an earlier --runs"
    )
    ap.add_argument("--out", type=Path, default=None, help="write the rows, one per profile and schedule")
    ap.add_argument("--runs", type=Path, default=None, help="write the command, settings and every run")
    args = ap.parse_args()
    if args.measured is not None:  # the earlier runs' settings, not this command line's
        earlier = json.loads(args.measured.read_text())
        for key in ("seq_len", "batch_size", "inner_steps", "rounds", "profiles", "schedules"):
            setattr(args, key, earlier["config"][key])
    names = args.schedules.split(",")
    for name in names:
        if name not in SCHEDULES:
            raise SystemExit(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    profiles = [tuple(float(x) for x in p.split(":")) for p in args.profiles.split(",")]
    H, B, T = args.inner_steps, args.batch_size, args.seq_len

    def config(name: str, rate: float | None) -> RunConfig:
        return testbed_config(T, B, H, **settings(name, H, B, rate))

    if args.measured is not None:
        command, runs = earlier["command"], earlier["runs"]
    else:
        command = "sudo nice -n 10 python bench/plan_validation.py " + " ".join(sys.argv[1:])
        runs = []  # every measurement: round, schedule, rate (None: unshaped), delay
        for r in range(args.rounds):
            for name in names:
                for rate, delay in [(None, 0.0), *profiles]:
                    m = measure(config(name, rate), 3 * H, rate, delay, None, pin=True)
                    runs.append({"round": r, "schedule": name, "measured": m})
                    print(
                        f"round {r}, {name}, {rate or 'unshaped'}: {m['tokens_per_s']:.0f} tokens/s",
                        flush=True,
                    )
    rows = []
    for name in names:
        mine = [
            [x["measured"] for x in runs if x["round"] == r and x["schedule"] == name]
            for r in range(args.rounds)
        ]
        # Each round's compute scale, from that round's unshaped run of the schedule.
        unshaped = [next(m for m in ms if m["rate_mbit"] is None)["tokens_per_s"] for ms in mine]
        scales = [calibrate(config(name, None), tokens_s) for tokens_s in unshaped]
        for rate, delay in profiles:
            cfg = config(name, rate)
            model, measured, bare = [], [], []
            for ms, scale in zip(mine, scales, strict=True):
                shaped = next(m for m in ms if m["rate_mbit"] == rate and m["rtt_ms"] == 2 * delay)
                model.append(predict(cfg, scale, rate, 2 * delay, args.hop_rtts))
                bare.append(predict(cfg, scale, rate, 2 * delay, 0.0))
                measured.append(shaped["tokens_per_s"])
            row = {
                "profile": f"{rate:g} Mbit/s, RTT {2 * delay:g} ms",
                "schedule": name,
                "microbatches": cfg.inner.microbatches,
                "wire": cfg.wire.activations
                + (f" k={cfg.model.subspace_rank}" if cfg.model.subspace_rank else ""),
                "overlap_steps": cfg.outer.overlap_steps,
                "model_tokens_s": statistics.median(model),
                "measured_tokens_s": statistics.median(measured),
                "model_over_measured": statistics.median(a / b for a, b in zip(model, measured, strict=True)),
                "model_over_measured_per_round": [a / b for a, b in zip(model, measured, strict=True)],
                "model_tokens_s_without_hop_rtts": statistics.median(bare),
            }
            rows.append(row)
            print(
                f"{row['profile']}, {name}: measured {row['measured_tokens_s']:.0f}, model "
                f"{row['model_tokens_s']:.0f} (x{row['model_over_measured']:.3f}; "
                f"{row['model_tokens_s_without_hop_rtts']:.0f} without the hop round trips)"
            )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    if args.runs is not None:
        args.runs.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": command,
            "config": {"preset": "tiny", "stages": 2, "replicas": 2, "steps": 3 * H, "seq_len": T}
            | {"batch_size": B, "inner_steps": H, "rounds": args.rounds, "hop_rtts": args.hop_rtts}
            | {"profiles": args.profiles, "schedules": args.schedules},
            "model_inputs": "compute per step: calibrated on the schedule's unshaped run; link = rate x "
            "1448/1514, RTT = 2 x delay; exchange at its capped goodput; both stages of a replica on one CPU",
            "runs": runs,
        }
        args.runs.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
