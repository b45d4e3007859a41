"""`bench/swarm_throughput.py` across checkouts, side by side: has the swarm regressed on this machine?

The swarm/simulator ratio depends on the machine as much as on the code: the simulator's
arithmetic speeds up more on a faster CPU than the swarm's hand-overs do, so a ratio measured on
one machine type is no bar for another. This runs each checkout named in --trees with its *own*
`bench/swarm_throughput.py` (its own `noloco_swarm`, its own simulator) for one round at a time,
alternating over --rounds, so every tree sees the same machine state. A tree's bench gets the
flags it knows of `--loops uvloop` and `--pin on,off` (read from its `--help`); older trees run
their own defaults (asyncio peers, unpinned).

Per tree and swarm (a tree's bench may run several: pinned and unpinned), it reports the swarm's
tokens/s, the tree's own simulator's tokens/s and their ratio, and, per round, each swarm's
tokens/s against the first tree's first swarm of the same round.

    git worktree add /tmp/noloco-ed9ea3e ed9ea3e     # the tree that measured 0.892 on 2026-11-30
    python bench/swarm_trees.py --trees /tmp/noloco-ed9ea3e,. --rounds 5 --out docs/results/swarm_trees.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

SWARM = re.compile(r"^swarm\s*(?P<label>.*?)\s*\(processes, loopback\):\s*(?P<tps>[\d.]+) tokens/s", re.M)
SIMULATOR = re.compile(r"^simulator[^:]*:\s*(?P<tps>[\d.]+) tokens/s", re.M)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--trees", default=".", help="noloco-swarm checkouts, comma-separated; the first is the reference"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    for tree in trees:
        if not (tree / "bench" / "swarm_throughput.py").is_file():
            ap.error(f"{tree} has no bench/swarm_throughput.py")
    commands = {tree: command(tree, args.steps) for tree in trees}
    swarm: dict[str, list[float]] = {}  # "tree: label" -> tokens/s per round
    simulator: dict[str, list[float]] = {str(t): [] for t in trees}
    for r in range(args.rounds):
        for tree in trees:
            print(f"round {r}: {tree}", flush=True)
            out = run(tree, commands[tree])
            sims = [float(m["tps"]) for m in SIMULATOR.finditer(out)]
            swarms = [(m["label"] or "swarm", float(m["tps"])) for m in SWARM.finditer(out)]
            if len(sims) != 1 or not swarms:
                sys.exit(f"could not read {tree}'s figures from its output:\n{out}")
            simulator[str(tree)].append(sims[0])
            for label, tps in swarms:
                swarm.setdefault(f"{tree}: {label}", []).append(tps)
    reference = next(iter(swarm))
    result: dict[str, dict] = {}
    for key, tps in swarm.items():
        tree = key.split(": ", 1)[0]
        ratio = [a / b for a, b in zip(tps, simulator[tree], strict=True)]
        against = [a / b for a, b in zip(tps, swarm[reference], strict=True)]
        result[key] = {
            "swarm_tokens_per_second": tps,
            "simulator_tokens_per_second": simulator[tree],
            "ratio_per_round": ratio,
            "ratio_median": statistics.median(ratio),
            "against_reference_per_round": against,
            "against_reference_median": statistics.median(against),
        }
        print(f"{key}")
        print(
            f"  swarm {statistics.median(tps):8.0f} tokens/s, own simulator {statistics.median(simulator[tree]):8.0f}"
        )
        print(f"  swarm/simulator: {statistics.median(ratio):.3f} (rounds: {fmt(ratio)})")
        print(
            f"  tokens/s against the reference ({reference}), same round: {statistics.median(against):.3f} (rounds: {fmt(against)})"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "command": "python bench/swarm_trees.py " + " ".join(sys.argv[1:]),
            "trees": {str(t): {"commit": commit(t), "command": commands[t]} for t in trees},
            "reference": reference,
            "swarms": result,
        }
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


def command(tree: Path, steps: int) -> list[str]:
    """One round of the tree's own bench, with the options it knows of."""
    bench = ["bench/swarm_throughput.py"]
    helptext = run(tree, [*bench, "--help"])
    argv = [*bench, "--rounds", "1", "--steps", str(steps)]
    if "--loops" in helptext:
        argv += ["--loops", "uvloop"]
    if "--pin" in helptext:
        argv += ["--pin", "on,off"]
    return argv


def run(tree: Path, argv: list[str]) -> str:
    env = os.environ | {"PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, *argv], cwd=tree, env=env, capture_output=True, text=True, timeout=3600, check=False
    )
    if done.returncode != 0:
        sys.exit(f"{tree}: {' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def commit(tree: Path) -> str:
    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", "-C", str(tree), *argv], capture_output=True, text=True, check=True
        ).stdout

    return git("rev-parse", "HEAD").strip() + (
        " (with uncommitted changes)" if git("status", "--porcelain").strip() else ""
    )


def fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


if __name__ == "__main__":
    main()
