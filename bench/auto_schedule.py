"""The schedule that picks itself, against the best hand-tuned one, on the testbed.

The run-wide choices are the organiser's (`noloco plan --write` puts them in the run config): the
same in every variant, the schedule docs/benchmarks.md measured fastest on 20 Mbit/s (B = 32, M = 5
microbatches cut 4,8,8,8,4, int8 rows, H = 50, the exchange overlapping 25 steps). What differs
is what each peer decides for itself:

  auto        no peer option at all: the exchange capped at 93% of the rate partners measured
              (peer.exchange_max_mbit = auto, peer/net/uplink.py), spread over half the overlap
              window by the measured step time (peer.exchange_pacing = 0.5), the default allocator
  auto, off   the same with peer.release_memory=off (the allocator's share of the difference)
  hand-tuned  the best options set by hand: the cap at 93% of the profile's known rate
              (peer.exchange_max_mbit = 18.6 on 20 Mbit/s), pacing 0.5, peer.release_memory=off
  before      unshaped only: the peer defaults before the exchange capped and paced itself
              (peer.exchange_max_mbit = 0, peer.exchange_pacing = 0)

Every variant on a 2 x 2 tiny swarm, peers pinned as `noloco local` pins them, each on its own
namespace host; the shaped profile is 20 Mbit/s each way, RTT 50 ms. Tokens/s over steps 50-150
(bench/wallclock_validation.py's `measure`), so auto pays for its first, uncapped exchange at step
50. Each round runs every variant; the ratios are within a round.

    sudo nice -n 10 python bench/auto_schedule.py --rounds 3 --out docs/results/auto_schedule.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from wallclock_validation import measure, testbed_config  # bench/ is the script's folder: on sys.path

RATE, DELAY = 20.0, 25.0  # Mbit/s each way, one-way ms: the issue's profile
RUN = {  # the organiser's run-wide schedule
    "inner.microbatches": "5",
    "inner.microbatch_sizes": "4,8,8,8,4",
    "wire.activations": "int8",
    "outer.overlap_steps": "25",
}
VARIANTS = {
    "auto": {},
    "auto, off": {"peer.release_memory": "off"},
    "hand-tuned": {
        "peer.exchange_max_mbit": f"{0.93 * RATE:g}",
        "peer.exchange_pacing": "0.5",
        "peer.release_memory": "off",
    },
    "before": {"peer.exchange_max_mbit": "0", "peer.exchange_pacing": "0"},
}
SHAPED = ("auto", "auto, off", "hand-tuned")
UNSHAPED = ("auto", "before")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", type=Path, default=None, help="keep each run's logs and events here")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    H, B = 50, 32
    cfgs = {name: testbed_config(128, B, H, **RUN, **extra) for name, extra in VARIANTS.items()}

    def run(name: str, rate: float | None, round_: int) -> dict:
        keep = None if args.keep is None else args.keep / f"r{round_}-{name.replace(', ', '-')}"
        result = measure(cfgs[name], 3 * H, rate, DELAY if rate else 0.0, keep, pin=True)
        print(
            f"  {name:12s} {result['tokens_per_s']:8.0f} tokens/s, step {result['step_s']:.3f} s", flush=True
        )
        return result

    rounds = []
    for round_ in range(args.rounds):
        print(f"round {round_ + 1} of {args.rounds}: {RATE:g} Mbit/s, RTT {2 * DELAY:g} ms")
        shaped = {name: run(name, RATE, round_) for name in SHAPED}
        print(f"round {round_ + 1}: unshaped")
        unshaped = {name: run(name, None, round_) for name in UNSHAPED}
        rounds.append({"shaped": shaped, "unshaped": unshaped})

    def tokens(where: str, name: str) -> list[float]:
        return [r[where][name]["tokens_per_s"] for r in rounds]

    auto_over_best = [
        a / b for a, b in zip(tokens("shaped", "auto"), tokens("shaped", "hand-tuned"), strict=True)
    ]
    off_over_best = [
        a / b for a, b in zip(tokens("shaped", "auto, off"), tokens("shaped", "hand-tuned"), strict=True)
    ]
    unshaped = [a / b for a, b in zip(tokens("unshaped", "auto"), tokens("unshaped", "before"), strict=True)]
    summary = {
        "auto_over_best_median": statistics.median(auto_over_best),
        "auto_over_best_per_round": auto_over_best,
        "auto_off_over_best_median": statistics.median(off_over_best),
        "unshaped_auto_over_before_median": statistics.median(unshaped),
        "unshaped_auto_over_before_per_round": unshaped,
    }
    for key, value in summary.items():
        shown = ", ".join(f"{v:.3f}" for v in value) if isinstance(value, list) else f"{value:.3f}"
        print(f"{key}: {shown}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": "sudo nice -n 10 python bench/auto_schedule.py " + " ".join(sys.argv[1:]),
            "config": {"preset": "tiny", "stages": 2, "replicas": 2, "batch_size": B, "inner_steps": H}
            | {
                "steps": 3 * H,
                "seq_len": 128,
                "pinned": True,
                "profile": {"rate_mbit": RATE, "rtt_ms": 2 * DELAY},
            },
            "run_wide": RUN,
            "variants": VARIANTS,
            "rounds": [
                {
                    "auto_tokens_s": r["shaped"]["auto"]["tokens_per_s"],
                    "best_tokens_s": r["shaped"]["hand-tuned"]["tokens_per_s"],
                    "auto_off_tokens_s": r["shaped"]["auto, off"]["tokens_per_s"],
                    "unshaped_auto_tokens_s": r["unshaped"]["auto"]["tokens_per_s"],
                    "unshaped_before_tokens_s": r["unshaped"]["before"]["tokens_per_s"],
                }
                for r in rounds
            ],
            "summary": summary,
            "runs": rounds,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
