"""What churn costs: a 2x3 swarm of peer processes with peers killed, stopped and added on a
schedule, against the same swarm left alone, side by side in one run.

Schedule (seconds after every peer has taken its first step):
  t0       SIGKILL a stage-1 replica (no cleanup of its own: probes find it, a report drops it)
  t0 + 3   a replacement starts with --stage auto (it must take stage 1) and joins late
  t0 + 20  SIGTERM a stage-0 replica (it leaves gracefully at a boundary)
  t0 + 23  a replacement starts with --stage auto (it must take stage 0)
  t0 + 40  SIGKILL a stage-0 replica (another stage-0 replica reads its shard until the views
           drop it: `stood_in_samples`)

Reported per run: inner steps per minute of the swarm (the surviving peers' steps over their
training time), samples dropped (sender and receiver side), re-routed to a stand-in and fed by a
stage-0 stand-in from a dead replica's shard, refusals, peers that failed, and
whether no state was lost: every survivor ran to the end, and each joiner started from a state
that a live replica of its stage held at that boundary (hash equal to an outer-step hash).
Freezing a peer (SIGSTOP) and cutting links are not in the schedule yet: the first is a known
stall (issue 9), the second needs the namespace testbed.

    python bench/churn.py --out docs/results/churn.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from noloco_swarm.harness.local import LocalSwarm, PeerProcess, local_swarm, until
from noloco_swarm.peer.events import (
    Dropped,
    Final,
    Joined,
    Left,
    Outer,
    PeerGone,
    Refused,
    Rerouted,
    Step,
    StoodIn,
    of_kind,
)
from noloco_swarm.train.layering import build_config


def config(args: argparse.Namespace):
    return build_config(
        "tiny",
        "noloco",
        assignments={
            "num_stages": "2",
            "num_replicas": "3",
            "model.seq_len": str(args.seq_len),
            "inner.batch_size": str(args.batch_size),
            "outer.inner_steps": str(args.inner_steps),
            "inner.total_steps": str(args.steps),
            "eval_windows": "4",
        },
        env={},
    )


def run(args: argparse.Namespace, churn: bool) -> dict:
    cfg = config(args)
    started: list[PeerProcess] = []
    killed: list[PeerProcess] = []
    with local_swarm(cfg, args.steps, step_timeout=args.step_timeout) as swarm:
        until(lambda: all(of_kind(p.events(), Step) for p in swarm.peers), 300, "every peer's first step")
        t0 = time.monotonic()
        if churn:
            victim = next(p for p in swarm.peers if p.stage == 1 and p.replica == 2)
            os.kill(victim.proc.pid, signal.SIGKILL)
            killed.append(victim)
            pause_until(t0 + 3)
            started.append(swarm.start_peer(None))
            pause_until(t0 + 20)
            leaver = next(p for p in swarm.peers if p.stage == 0 and p.replica == 2)
            os.kill(leaver.proc.pid, signal.SIGTERM)
            pause_until(t0 + 23)
            started.append(swarm.start_peer(None))
            pause_until(t0 + 40)
            victim = next(p for p in swarm.peers if p.stage == 0 and p.replica == 1)
            os.kill(victim.proc.pid, signal.SIGKILL)
            killed.append(victim)
        until(
            lambda: all(p.proc.poll() is not None for p in swarm.peers if p not in killed),
            1800,
            "the run's end",
        )
        return summarise(swarm, killed, started, time.monotonic() - t0)


def pause_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


def summarise(
    swarm: LocalSwarm, killed: list[PeerProcess], started: list[PeerProcess], seconds: float
) -> dict:
    events = {id(p): p.events() for p in swarm.peers}
    finals = {id(p): next(iter(of_kind(events[id(p)], Final)), None) for p in swarm.peers}
    left = [p for p in swarm.peers if of_kind(events[id(p)], Left)]
    survivors = [p for p in swarm.peers if p not in killed and p not in left]
    failed = [p for p in swarm.peers if p not in killed and p.proc.returncode != 0]
    outer_hashes = {
        (p.stage, e.step, e.state_hash) for p in swarm.peers for e in of_kind(events[id(p)], Outer)
    }
    joins = []
    for p in started:
        final = finals[id(p)]
        joined = next(iter(of_kind(events[id(p)], Joined)), None)
        exact = (
            joined is not None
            and final is not None
            and any(stage == final.stage and step == joined.from_step and h == joined.state_hash for stage, step, h in outer_hashes)
        )  # fmt: skip
        joins.append(
            {
                "stage": final.stage if final else None,
                "joined_step": joined.step if joined else None,
                "exact": exact,
            }
        )
    full = [finals[id(p)] for p in survivors if finals[id(p)] is not None]
    train_seconds = (
        statistics.median(f.train_seconds for f in full if f.joined_round == 0) if full else float("nan")
    )
    return {
        "wall_seconds_after_start": seconds,
        "steps_per_minute": 60
        * statistics.median(f.steps for f in full if f.joined_round == 0)
        / train_seconds,
        "dropped_samples": sum(e.samples for ev in events.values() for e in of_kind(ev, Dropped)),
        "rerouted_samples": sum(e.samples for ev in events.values() for e in of_kind(ev, Rerouted)),
        "stood_in_samples": sum(e.samples for ev in events.values() for e in of_kind(ev, StoodIn)),
        "refusals": sum(len(of_kind(ev, Refused)) for ev in events.values()),
        "gone_reports_seen": sum(len(of_kind(ev, PeerGone)) for ev in events.values()),
        "failed_peers": [
            {
                "peer": f"stage {'auto' if p.stage is None else p.stage} #{p.replica}",
                "exit": p.proc.returncode,
                "log_tail": p.log_tail(8),
            }
            for p in failed
        ],
        "survivors_ran_to_the_end": all(f.steps == swarm.steps for f in full) and len(full) == len(survivors),
        "joiners": joins,
        "left": len(left),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=5)
    ap.add_argument("--step-timeout", type=float, default=20.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    calm = run(args, churn=False)
    churned = run(args, churn=True)
    ratio = churned["steps_per_minute"] / calm["steps_per_minute"]
    print(
        f"config: 2 stages x 3 replicas, tiny, seq {args.seq_len}, batch {args.batch_size}, H={args.inner_steps}, {args.steps} steps"
    )
    for name, r in (("no churn", calm), ("churn", churned)):
        print(
            f"{name:9s}: {r['steps_per_minute']:6.1f} steps/min, {r['dropped_samples']} samples dropped, "
            f"{r['rerouted_samples']} re-routed, {r['stood_in_samples']} fed by a stage-0 stand-in, "
            f"{r['refusals']} refusals, failed {[f['peer'] for f in r['failed_peers']] or 'none'}, survivors to the end: "
            f"{r['survivors_ran_to_the_end']}, joiners {r['joiners']}"
        )
    print(f"steps per minute with churn / without: {ratio:.3f}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": "python bench/churn.py " + " ".join(sys.argv[1:]),
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            "no_churn": calm,
            "churn": churned,
            "steps_per_minute_ratio": ratio,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
