"""How long a local swarm takes to start training: peers forked from the preloader, or each
started from scratch.

Each rep runs a fresh launcher process (as `noloco local` is one), which starts a P x D swarm of
the tiny preset with `local_swarm(..., preload=...)`, and reports the seconds from the launcher's
start until every peer has finished its first inner step: the launcher's own imports and DHT node,
the preloader's imports where it is used, the peers' start-up and the swarm's first round. The two
ways alternate over --reps, so both see the same machine state; the ratio is of the medians.

    python bench/swarm_startup.py --reps 5 --out docs/results/swarm_startup.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(preload: bool, stages: int, replicas: int) -> None:
    """In the launcher process: start the swarm, print when every peer has stepped once."""
    from noloco_swarm.harness.local import local_swarm
    from noloco_swarm.peer.events import Step, of_kind
    from noloco_swarm.train.layering import build_config

    cfg = build_config("tiny", "noloco", assignments={"num_stages": stages, "num_replicas": replicas}, env={})
    with local_swarm(cfg, 1000, step_timeout=300, preload=preload) as swarm:
        deadline = time.monotonic() + 600
        while not all(of_kind(p.events(), Step) for p in swarm.peers):
            if time.monotonic() > deadline or swarm.failed():
                raise SystemExit("the swarm did not step: " + swarm.peers[0].log_tail())
            time.sleep(0.05)
        print(json.dumps({"stepped_at": time.time()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", choices=["preload", "scratch"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child == "preload", args.stages, args.replicas)
        return
    seconds: dict[str, list[float]] = {"preload": [], "scratch": []}
    for rep in range(args.reps):
        for way in ("scratch", "preload") if rep % 2 else ("preload", "scratch"):
            argv = [sys.executable, __file__, "--child", way, "--stages", str(args.stages)]
            argv += ["--replicas", str(args.replicas)]
            started = time.time()
            done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=900)
            stepped = json.loads(done.stdout.strip().splitlines()[-1])["stepped_at"]
            seconds[way].append(round(stepped - started, 2))
            print(f"rep {rep} {way}: {seconds[way][-1]:.1f} s", flush=True)
    medians = {way: statistics.median(s) for way, s in seconds.items()}
    result = {
        "swarm": f"{args.stages} x {args.replicas} tiny",
        "seconds_to_every_peers_first_step": seconds,
        "median_s": medians,
        "preload_over_scratch": round(medians["preload"] / medians["scratch"], 3),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
