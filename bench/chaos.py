"""Goodput under the chaos schedule: the 2 x 3 swarm of tests/integration/test_chaos.py played the
seeded fault schedule (noloco_swarm/harness/chaos.py: a kill, a joiner, a peer and its daemon
frozen for 15 s, a 20 s link cut, a 300 ms delay spike for 10 s, a graceful leave), against the
same swarm left alone, side by side in one run, on the namespace testbed (5 ms each way on every
peer's link). Needs root.

  goodput        samples trained by the chaos swarm from the first fault's start to the end of
                 the schedule (the leaver's exit), over what the calm swarm trains in the same
                 time (its samples per second from its reference's step H to the end). A sample
                 is trained when its gradient came back to stage 0 (harness.chaos.trained_samples)
  pace_ratios    the chaos swarm's inner steps per second in the window after each fault healed,
                 over its own healthy window before the first fault
  split_rounds   rounds after the schedule in which two running peers held different views
  val_loss       each stage-0 survivor's final validation loss, in both runs

    python bench/chaos.py --seeds 0 1 --out docs/results/chaos.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from noloco_swarm.harness.chaos import (
    BATCH,
    INNER_STEPS,
    REPLICAS,
    STAGES,
    Chaos,
    chaos_config,
    schedule,
    trained_samples,
    views_since,
)
from noloco_swarm.harness.local import wait
from noloco_swarm.harness.namespaces import namespace_swarm
from noloco_swarm.peer.events import Dropped, Final, Step, of_kind

DELAY_MS = 5.0
STEP_TIMEOUT = 8.0


def calm(steps: int) -> dict:
    """The swarm without faults: its trained samples per second after its first round."""
    with namespace_swarm(chaos_config(steps), steps, step_timeout=STEP_TIMEOUT, delay_ms=DELAY_MS) as ns:
        wait(ns.swarm, timeout=1200)
        events = [p.events() for p in ns.swarm.peers]
        ref = next(ev for p, ev in zip(ns.swarm.peers, events, strict=True) if (p.stage, p.replica) == (1, 0))
    times = {e.step: e.time for e in of_kind(ref, Step)}
    since, until = times[INNER_STEPS], times[steps] + 1e-3
    stage0 = [ev for ev in events if any(f.stage == 0 for f in of_kind(ev, Final))]
    trained = trained_samples(stage0, BATCH, since, until)
    return {
        "samples_per_second": trained / (until - since),
        "steps_per_second": (steps - INNER_STEPS) / (until - since),
        "val_loss": [f.val_loss for ev in stage0 for f in of_kind(ev, Final)],
        "dropped_samples": sum(
            e.samples for ev in events for e in of_kind(ev, Dropped) if e.side == "sender"
        ),
    }


def chaotic(steps: int, seed: int) -> dict:
    faults = schedule(seed, STAGES, REPLICAS, inner_steps=INNER_STEPS)
    spares = {faults[0].stage: 1}
    cfg = chaos_config(steps)
    with namespace_swarm(cfg, steps, step_timeout=STEP_TIMEOUT, delay_ms=DELAY_MS, spares=spares) as ns:
        record = Chaos(ns, faults, inner_steps=INNER_STEPS, window_steps=2 * INNER_STEPS).play()
        wait(ns.swarm, timeout=1200, ignore=record.killed)
        events = [p.events() for p in ns.swarm.peers]
        stage0 = [ev for p, ev in zip(ns.swarm.peers, events, strict=True) if p.stage == 0]
    since, until = record.started["kill"], record.ended["leave"]
    healthy = record.windows[0].pace
    views = views_since(events, until)
    return {
        "seed": seed,
        "schedule": record.summary(),
        "schedule_seconds": until - since,
        "trained_samples": trained_samples(stage0, BATCH, since, until),
        "pace_ratios": {w.after: w.pace / healthy for w in record.windows[1:]},
        "rounds_after_schedule": len(views),
        "split_rounds": sorted(r for r, v in views.items() if len(v) != 1),
        "val_loss": [f.val_loss for ev in stage0 for f in of_kind(ev, Final) if f.val_loss is not None],
        "dropped_samples": sum(
            e.samples for ev in events for e in of_kind(ev, Dropped) if e.side == "sender"
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs = []
    for seed in args.seeds:
        started = time.time()
        base = calm(args.steps)
        run = chaotic(args.steps, seed)
        run["goodput"] = run["trained_samples"] / (base["samples_per_second"] * run["schedule_seconds"])
        runs.append({"calm": base, "chaos": run, "wall_seconds": time.time() - started})
        print(
            f"seed {seed}: goodput {run['goodput']:.3f} over {run['schedule_seconds']:.0f} s of faults; "
            f"pace after each fault / healthy { ({k: round(v, 2) for k, v in run['pace_ratios'].items()}) }; "
            f"split rounds after the schedule {run['split_rounds']} of {run['rounds_after_schedule']}; "
            f"val loss chaos {run['val_loss']} calm {base['val_loss']}"
        )
    goodputs = [r["chaos"]["goodput"] for r in runs]
    print(f"goodput: median {statistics.median(goodputs):.3f} over seeds {args.seeds}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": "python bench/chaos.py " + " ".join(sys.argv[1:]),
            "config": {
                "preset": "tiny",
                "stages": STAGES,
                "replicas": REPLICAS,
                "inner_steps": INNER_STEPS,
                "batch": BATCH,
                "steps": args.steps,
                "delay_ms": DELAY_MS,
                "step_timeout": STEP_TIMEOUT,
            },
            "runs": runs,
            "goodput_median": statistics.median(goodputs),
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
