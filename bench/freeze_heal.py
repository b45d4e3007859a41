"""How long one frozen middle-stage peer holds a swarm: a 4 x R swarm of tiny peers on the
namespace testbed (every link 10 ms each way), one stage-1 peer and its daemon stopped (SIGSTOP)
for 15 s at step 20, step deadline 20 s. Recorded per run: the seconds from the freeze to the
swarm healed (every running peer in one view that holds exactly them, two rounds after the
freeze ended: noloco_swarm/harness/chaos.py), the steps after the thaw that took longer than 5 s
(any peer), the longest of them, and the pace before and after.

Before c103ad9 every step after the thaw waited the 20 s deadline until the views dropped the
frozen peer (docs/notebook.md, 2026-12-07).

    python bench/freeze_heal.py --replicas 3 --runs 1 --out docs/results/freeze_heal.json
    (root; about 4 minutes a run)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from noloco_swarm.harness.chaos import Chaos, Fault
from noloco_swarm.harness.local import wait
from noloco_swarm.harness.namespaces import namespace_swarm
from noloco_swarm.peer.events import Step, of_kind
from noloco_swarm.train.layering import build_config

STAGES, H, STEPS, STOP_AT, STOP_S, STEP_TIMEOUT = 4, 5, 80, 20, 15.0, 20.0


def one_run(replicas: int, workdir: Path) -> dict:
    cfg = build_config(
        "tiny",
        "noloco",
        assignments={
            "num_stages": str(STAGES),
            "num_replicas": str(replicas),
            "model.seq_len": "32",
            "inner.batch_size": "2",
            "outer.inner_steps": str(H),
            "inner.warmup_steps": "2",
            "inner.total_steps": str(STEPS),
            "eval_windows": "2",
        },
        env={},
    )
    faults = [Fault("stop", 1, 1, STOP_AT, STOP_S)]
    with namespace_swarm(cfg, STEPS, step_timeout=STEP_TIMEOUT, delay_ms=10.0, workdir=workdir) as ns:
        record = Chaos(ns, faults, inner_steps=H, window_steps=2 * H, phase_timeout=600).play()
        wait(ns.swarm, timeout=1200, ignore=record.killed)
        events = [p.events() for p in ns.swarm.peers]
    began, thawed = record.started["stop"], record.ended["stop"]
    slow = [s.seconds for ev in events for s in of_kind(ev, Step) if s.time > thawed and s.seconds > 5.0]
    healthy, after = record.windows[0].pace, record.windows[-1].pace
    return {
        "stages": STAGES,
        "replicas": replicas,
        "stop_s": STOP_S,
        "step_timeout_s": STEP_TIMEOUT,
        "freeze_to_healed_s": record.healed["stop"] - began,
        "steps_over_5s_after_thaw": len(slow),
        "longest_step_after_thaw_s": max(slow, default=0.0),
        "healthy_steps_per_second": healthy,
        "pace_after_healed_ratio": after / healthy,
        "logs": str(workdir),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs = []
    for _ in range(args.runs):
        workdir = Path("runs/freeze_heal") / time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
        workdir.mkdir(parents=True, exist_ok=True)
        runs.append(one_run(args.replicas, workdir))
        print(json.dumps(runs[-1], indent=1), flush=True)
    if args.out is not None:
        command = "python bench/freeze_heal.py " + " ".join(sys.argv[1:])
        args.out.write_text(json.dumps({"command": command, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
