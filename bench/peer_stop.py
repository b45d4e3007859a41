"""How long a training peer takes to stop on a second signal, and how it ends.

Each rep runs a fresh launcher process from one checkout (--trees; PYTHONPATH and cwd set to it),
which starts a 2 x 2 swarm of the tiny preset with `local_swarm` (peers forked from the
preloader), waits until every peer trains, then signals every peer's process group (the peer and
its p2pd) as `end_groups` does: SIGTERM, 0.5 s, SIGTERM. It reports the seconds from the second
signal until each peer has exited, and each exit status (130: stopped by the signal; the launcher
waits up to --wait seconds, then SIGKILLs what is left: -9). Trees alternate over --reps, so all
see the same machine state; the ratio is of the medians of the slowest peer per rep.

    python bench/peer_stop.py --trees /path/to/old-checkout,. --reps 3 --out docs/results/peer_stop.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path


def child(wait: float) -> None:
    """In the launcher process: start the swarm, stop it with two signals, print what happened."""
    from noloco_swarm.harness.local import local_swarm
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
        for sig_round in range(2):
            for proc in procs:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            if sig_round == 0:
                time.sleep(0.5)
        second = time.monotonic()
        exited: dict[int, float] = {}
        while len(exited) < len(procs) and time.monotonic() < second + wait:
            for i, proc in enumerate(procs):
                if i not in exited and proc.poll() is not None:
                    exited[i] = time.monotonic() - second
            time.sleep(0.02)
        for i, proc in enumerate(procs):
            if i not in exited:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                exited[i] = time.monotonic() - second
        codes = [proc.returncode for proc in procs]
        print(json.dumps({"seconds": [round(exited[i], 3) for i in range(len(procs))], "codes": codes}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=".", help="comma-separated checkouts to compare")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--wait", type=float, default=40.0, help="seconds to wait for the peers to exit")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.wait)
        return
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    runs: dict[str, list[dict]] = {str(t): [] for t in trees}
    for rep in range(args.reps):
        for tree in trees:
            argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--wait", str(args.wait)]
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
            "slowest_seconds_median": statistics.median(max(r["seconds"]) for r in reps),
            "codes": sorted({c for r in reps for c in r["codes"]}),
        }
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
