"""How long training peers take to stop: on a second signal, or at the end of their run (--natural).

Each rep runs a fresh launcher process from one checkout (--trees; PYTHONPATH and cwd set to it),
which starts a 2 x 2 swarm of the tiny preset with `local_swarm` (peers forked from the
preloader), waits until every peer trains, then ends it with the harness's own `end_groups`:
SIGTERM to every peer's process group (the peer and its p2pd), 0.5 s, SIGTERM again, SIGKILL to
what is left --wait seconds later. It reports the seconds from the second signal until the last
peer has exited, and each exit status (130: stopped by the signal; -9: SIGKILLed). Trees
alternate over --reps, so all see the same machine state; the ratio is of the medians.

    python bench/peer_stop.py --trees /path/to/old-checkout,. --reps 3 --out docs/results/peer_stop.json

With --natural the swarm (2 x 2 tiny, the integration tests' small shape: 7 steps at H = 3)
trains to its end instead, and a rep reports the seconds from the last peer's `final` event to
the last peer's exit (polled every 20 ms), and from the start of the swarm to that exit.

    python bench/peer_stop.py --natural --trees /path/to/old-checkout,. --reps 5 --out docs/results/swarm_end.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STOP_GAP = 0.5  # end_groups' pause between its two SIGTERMs


def child(wait: float) -> None:
    """In the launcher process: start the swarm, stop it with two signals, print what happened."""
    from noloco_swarm.harness.local import end_groups, local_swarm
    from noloco_swarm.peer.events import Step, of_kind
    from noloco_swarm.train.layering import build_config

    cfg = build_config("tiny", "noloco", assignments={"num_stages": 2, "num_replicas": 2}, env={})
    with local_swarm(cfg, 100000, step_timeout=300) as swarm:
        deadline = time.monotonic() + 600
        while not all(len(of_kind(p.events(), Step)) >= 3 for p in swarm.peers):
            if time.monotonic() > deadline:
                raise SystemExit("the swarm did not train: " + swarm.peers[0].log_tail())
            time.sleep(0.1)
        procs = [p.proc for p in swarm.peers]
        began = time.monotonic()
        end_groups(procs, grace=wait)  # SIGTERM, 0.5 s, SIGTERM; SIGKILL after `grace`
        seconds = time.monotonic() - began - STOP_GAP
        print(json.dumps({"seconds": round(seconds, 3), "codes": [proc.returncode for proc in procs]}))


def natural() -> None:
    """In the launcher process: run a small swarm to its end, print how long its ending took."""
    from noloco_swarm.harness.local import local_swarm
    from noloco_swarm.peer.events import Final, of_kind
    from noloco_swarm.train.layering import build_config

    small = {"model.seq_len": 32, "inner.batch_size": 2, "outer.inner_steps": 3, "inner.warmup_steps": 2}
    assignments = small | {"inner.total_steps": 8, "eval_windows": 4, "num_stages": 2, "num_replicas": 2}
    cfg = build_config("tiny", "noloco", assignments=assignments, env={})
    began = time.time()
    with local_swarm(cfg, 7, step_timeout=60) as swarm:
        exited: dict[int, float] = {}
        while len(exited) < len(swarm.peers):
            if time.time() - began > 600:
                raise SystemExit("the swarm did not end: " + swarm.peers[0].log_tail())
            for i, peer in enumerate(swarm.peers):
                if i not in exited and peer.proc.poll() is not None:
                    exited[i] = time.time()
            time.sleep(0.02)
        finals = [e.time for p in swarm.peers for e in of_kind(p.events(), Final)]
        codes = [p.proc.returncode for p in swarm.peers]
    if len(finals) != len(swarm.peers):
        raise SystemExit(f"{len(finals)} of {len(swarm.peers)} peers ended with a final event; codes {codes}")
    last = max(exited.values())
    print(
        json.dumps(
            {"seconds": round(last - max(finals), 3), "run_seconds": round(last - began, 3), "codes": codes}
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=".", help="comma-separated checkouts to compare")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--wait", type=float, default=40.0, help="seconds to wait for the peers to exit")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--natural", action="store_true", help="time the end of a run, not a second signal")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        natural() if args.natural else child(args.wait)
        return
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    runs: dict[str, list[dict]] = {str(t): [] for t in trees}
    for rep in range(args.reps):
        for tree in trees:
            argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--wait", str(args.wait)]
            argv += ["--natural"] if args.natural else []
            env = os.environ | {"PYTHONPATH": str(tree)}
            out = subprocess.run(
                argv, check=False, cwd=tree, env=env, capture_output=True, text=True, timeout=900
            )
            if out.returncode != 0:
                raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            runs[str(tree)].append(result)
            print(f"rep {rep} {tree}: {result}", flush=True)
    summary = {
        tree: {
            "slowest_seconds_median": statistics.median(r["seconds"] for r in reps),
            "codes": sorted({c for r in reps for c in r["codes"]}),
        }
        | ({"run_seconds_median": statistics.median(r["run_seconds"] for r in reps)} if args.natural else {})
        for tree, reps in runs.items()
    }
    if len(trees) == 2:
        a, b = (summary[str(t)]["slowest_seconds_median"] for t in trees)
        summary["second_over_first"] = b / a if a else None
    record = {
        "command": "python bench/peer_stop.py " + " ".join(sys.argv[1:]),
        "runs": runs,
        "summary": summary,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
