"""A peer's fixed memory: the PSS of every process a `noloco join` peer runs, on a training swarm.

Starts `noloco local` (2 stages x 2 replicas of the tiny preset, whose model is small beside the
fixed costs) from each checkout named in --trees, waits --after seconds into the run, and reads
every process's PSS (/proc/PID/smaps_rollup: shared pages are split between the processes that
map them, so the figures add up) and RSS (shared pages counted whole in each process: what `top`
shows a volunteer) under each peer, by kind: the peer's Python process, p2pd, a
forked DHT process, torch_shm_manager. Trees alternate over --reps, so builds are compared side by
side on the same machine state.

    python bench/fixed_overhead.py --trees /path/to/old-checkout,. --out docs/results/fixed_overhead_rss.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

MIB = 1 << 20


def pss(pid: int) -> float:
    """PSS of `pid` in MiB (0 if it is gone). Not USS: a peer's forked DHT process shares most
    of its pages with the peer, and private pages alone would count them for neither."""
    return _field(f"/proc/{pid}/smaps_rollup", "Pss:")


def rss(pid: int) -> float:
    """RSS of `pid` in MiB (0 if it is gone): shared pages count whole in every process, as a
    volunteer's `top` shows them and as issue 14 first measured the overhead."""
    return _field(f"/proc/{pid}/status", "VmRSS:")


def _field(path: str, name: str) -> float:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return 0.0
    return sum(int(line.split()[1]) * 1024 / MIB for line in lines if line.startswith(name))


def children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            kids[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))
    return kids


def kind(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    text = b" ".join(argv).decode(errors="replace")
    if "p2pd" in text:
        return "p2pd"
    if "torch_shm_manager" in text:
        return "torch_shm_manager"
    if " join " in f" {text} ":
        return "peer"
    return "other"


SIZES = {"pss": pss, "rss": rss}


def peer_trees(root: int) -> dict[str, list[dict[str, float]]]:
    """Per size (pss, rss) and `noloco join` peer under `root`: MiB by process kind (a forked child
    of the peer that runs the same command line is its DHT process). One walk of the process tree
    reads both sizes, so they describe the same processes."""
    kids = children()
    peers: dict[str, list[dict[str, float]]] = {name: [] for name in SIZES}

    def walk(pid: int) -> None:
        if kind(pid) == "peer":
            usage = {name: defaultdict(float) for name in SIZES}
            members = [("peer", pid)]
            stack = list(kids[pid])
            while stack:
                child = stack.pop()
                k = kind(child)
                members.append(("dht process" if k == "peer" else k, child))
                stack += kids[child]
            for k, member in members:
                for name, size in SIZES.items():
                    usage[name][k] += size(member)
            for name in SIZES:
                peers[name].append(dict(usage[name]))
            return
        for child in kids[pid]:
            walk(child)

    walk(root)
    return peers


def measure(tree: Path, after: float) -> dict[str, list[dict[str, float]]]:
    noloco = shutil.which("noloco", path=str(Path(sys.executable).parent)) or shutil.which("noloco")
    if noloco is None:
        raise SystemExit("no `noloco` entry point: install the package first (bash scripts/setup.sh)")
    argv = [sys.executable, noloco, "local", "--preset", "tiny", "--replicas", "2"]
    argv += ["--steps", "100000", "--plain"]
    env = os.environ | {"PYTHONPATH": str(tree)}
    proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        time.sleep(after)
        return peer_trees(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=".", help="noloco-swarm checkouts to compare, comma-separated")
    ap.add_argument("--after", type=float, default=30.0, help="seconds into the run to read the PSS")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    runs: dict[str, list[dict[str, list[dict[str, float]]]]] = {str(t): [] for t in trees}
    for _ in range(args.reps):
        for tree in trees:
            runs[str(tree)].append(measure(tree, args.after))
    result = {}
    for tree, reps in runs.items():
        commit = subprocess.run(
            ["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        result[tree] = {"commit": commit}
        for size in SIZES:
            peers = [p for rep in reps for p in rep[size]]
            totals = [sum(p.values()) for p in peers]
            kinds = sorted({k for p in peers for k in p})
            by_kind = {k: statistics.median(p.get(k, 0.0) for p in peers) for k in kinds}
            # "peers" and "per_peer_mib_median" stay PSS, as in the results written before RSS was read
            suffix = "" if size == "pss" else "_rss"
            result[tree] |= {
                f"peers{suffix}": [rep[size] for rep in reps],
                f"per_peer_mib_median{suffix}": statistics.median(totals),
                f"by_kind_mib_median{suffix}": by_kind,
            }
            shown = ", ".join(f"{k} {v:.0f}" for k, v in by_kind.items())
            print(
                f"{tree} ({commit}): {len(totals)} peers, {statistics.median(totals):.0f} MiB "
                f"{size.upper()} per peer (range {min(totals):.0f}-{max(totals):.0f}; median by kind: {shown})"
            )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = "python bench/fixed_overhead.py " + " ".join(sys.argv[1:])
        args.out.write_text(
            json.dumps({"command": command, "after_s": args.after, "trees": result}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
