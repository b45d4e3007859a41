"""What a join costs the swarm it joins: the round a joiner enters, against the same round of the
same swarm left alone, side by side in one run.

A 2 x 2 swarm (tiny's vocabulary, widened so that a stage's state, phi + delta + AdamW's two
moments, is about 300 MB) trains; in the `join` run a fifth peer starts on stage 1 after the
swarm's first steps and joins at round J (two rounds ahead, peer/joining.py). Per run:

  round_seconds     wall time of round J on the four first peers (median): from their step J*H
                    (the boundary that admits the joiner, its outer step included) to the end
                    of step J*H + H
  serving_seconds   from the donors' snapshot (`joiners` event) to the last chunk they served
  ready_seconds     from the snapshot to the joiner's `joined` event (downloaded, checked, loaded)
  slowest_step      the longest step of round J on the first peers, and which step it was

The `calm` run names the same J. The cost of a join is join's round_seconds minus calm's. On
this 2-core machine the joiner's own download, hashing and loading take CPU from the four
donors and neighbours, which a volunteer's joiner on its own machine would not.

    python bench/join_stall.py --reps 2 --out docs/results/join_stall.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from noloco_swarm.harness.local import local_swarm, until
from noloco_swarm.peer.events import Joined, Joiners, ServedState, Step, of_kind
from noloco_swarm.train.layering import build_config

WIDE = {
    "model.hidden_size": "512",
    "model.intermediate_size": "2048",
    "model.num_layers": "8",
    "model.num_heads": "8",
}


def config(args: argparse.Namespace):
    return build_config(
        "tiny",
        "noloco",
        assignments={
            "num_stages": "2",
            "num_replicas": "2",
            "model.seq_len": "64",
            "inner.batch_size": "4",
            "outer.inner_steps": str(args.inner_steps),
            "inner.total_steps": str(args.steps),
            **WIDE,
        },
        env={},
    )


def run(args: argparse.Namespace, join: bool, round_: int | None) -> dict:
    """One swarm; with `join`, a stage-1 joiner. Measures round `round_` (the joiner's if None)."""
    cfg = config(args)
    with local_swarm(cfg, args.steps, step_timeout=60) as swarm:
        first = list(swarm.peers)
        until(lambda: all(len(of_kind(p.events(), Step)) >= 3 for p in first), 600, "every peer's third step")
        joiner = swarm.start_peer(1) if join else None
        until(lambda: all(p.proc.poll() is not None for p in swarm.peers), 1800, "the run's end")
        if any(p.proc.returncode != 0 for p in swarm.peers):
            raise RuntimeError("a peer failed:\n" + "\n".join(p.log_tail(10) for p in swarm.peers))
        events = {id(p): p.events() for p in swarm.peers}
    row: dict = {"join": join}
    if joiner is not None:
        joined = of_kind(events[id(joiner)], Joined)[0]
        round_ = joined.round
        donors = [p for p in first if of_kind(events[id(p)], Joiners)]
        snapshot = min(of_kind(events[id(p)], Joiners)[0].time for p in donors)
        served = [e.time for p in donors for e in of_kind(events[id(p)], ServedState)]
        row |= {
            "chunks_served": len(served),
            "serving_seconds": max(served) - snapshot,
            "ready_seconds": joined.time - snapshot,
        }
    h = args.inner_steps
    rounds, slowest = [], []
    for p in first:
        at = {e.step: e.time for e in of_kind(events[id(p)], Step)}
        start, end = round_ * h, round_ * h + h
        rounds.append(at[end] - at[start])
        slowest.append(max((at[s] - at[s - 1], s) for s in range(start + 1, end + 1)))
    row |= {
        "round": round_,
        "round_seconds": statistics.median(rounds),
        "slowest_step": {"seconds": max(slowest)[0], "step": max(slowest)[1]},
    }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--inner-steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    reps = []
    for _ in range(args.reps):
        joined = run(args, True, None)
        calm = run(args, False, joined["round"])
        reps.append(
            {"join": joined, "calm": calm, "extra_seconds": joined["round_seconds"] - calm["round_seconds"]}
        )
        print(json.dumps(reps[-1]), flush=True)
    result = {
        "command": "python bench/join_stall.py " + " ".join(sys.argv[1:]),
        "config": {
            "preset": "tiny",
            "shape": WIDE,
            "stages": 2,
            "replicas": 2,
            "seq_len": 64,
            "batch_size": 4,
            "inner_steps": args.inner_steps,
            "steps": args.steps,
        },
        "reps": reps,
        "extra_seconds_median": statistics.median(r["extra_seconds"] for r in reps),
    }
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
