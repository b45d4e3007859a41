"""How long `noloco` commands take to start, for checkouts side by side.

A command that runs no model (the DHT bootstrap, the config tools, the launcher of a networked
`noloco local`, `noloco status`) should not pay for what only a peer or the simulator needs.
For each checkout in --trees and each command, alternating over --reps, this runs the command
with that checkout's `noloco_swarm` and reports its median wall time and CPU time (user + system,
the command and what it started): `keys` and `--help` to their exit, `dht` until it has written
its address file (it is then stopped), and the peer's imports (`import noloco_swarm.peer.launch`,
which builds a model: a control that should not move). Each command runs the installed `noloco`
entry point, as a volunteer does, under the chosen interpreter.

    python bench/cli_startup.py --trees /path/to/old-checkout,. --out docs/results/cli_startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = {
    "keys": ["keys"],
    "--help": ["--help"],
    "dht (to its address)": ["dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
    "peer's imports (control)": ["-c", "import noloco_swarm.peer.launch"],
}


def entry_point(python: str) -> str:
    """The `noloco` script installed beside `python` (or on PATH): what a volunteer runs."""
    script = shutil.which("noloco", path=str(Path(python).parent)) or shutil.which("noloco")
    if script is None:
        raise SystemExit("no `noloco` entry point: install the package first (bash scripts/setup.sh)")
    return script


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(tree: Path, args: list[str], python: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of `noloco ARGS` (`python -c ...` for a "-c") with
    `tree`'s package."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory(prefix="noloco-startup-") as tmp:
        argv = [python, *args] if args[0] == "-c" else [python, entry_point(python), *args]
        address = Path(tmp) / "address"
        if args[0] == "dht":
            argv += ["--identity", str(Path(tmp) / "key"), "--address-file", str(address)]
        cpu, start = children_cpu(), time.perf_counter()
        proc = subprocess.Popen(argv, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if args[0] == "dht":
            deadline = time.monotonic() + 120
            while not address.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"noloco dht gave no address: {proc.communicate()[1][-2000:]!r}")
                time.sleep(0.01)
            wall = time.perf_counter() - start
            proc.terminate()
            proc.communicate(timeout=30)
        else:
            _, err = proc.communicate(timeout=120)
            wall = time.perf_counter() - start
            if proc.returncode != 0:
                raise RuntimeError(f"noloco {' '.join(args)} failed: {err[-2000:]!r}")
        # A stopped dht's CPU counts its shutdown too: the same for every tree.
        return wall, children_cpu() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=".", help="checkouts, comma-separated (the first is the baseline)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--python", default=sys.executable, help="the interpreter (one environment for all)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    times: dict[str, dict[str, list[tuple[float, float]]]] = {
        str(t): {c: [] for c in COMMANDS} for t in trees
    }
    for rep in range(args.reps):
        for name, command in COMMANDS.items():
            for tree in trees if rep % 2 == 0 else reversed(trees):
                times[str(tree)][name].append(run_once(tree, command, args.python))
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
    result: dict[str, object] = {"command": " ".join(["python", *sys.argv]), "reps": args.reps, "trees": {}}
    base = str(trees[0])
    print(f"{'command':24s} " + " ".join(f"{t.name or str(t):>30s}" for t in trees))
    for name in COMMANDS:
        cells = []
        for tree in trees:
            runs = times[str(tree)][name]
            wall = statistics.median(w for w, _ in runs)
            cpu = statistics.median(c for _, c in runs)
            base_wall = statistics.median(w for w, _ in times[base][name])
            cells.append(f"{wall:6.2f} s ({cpu:5.2f} CPU, {wall / base_wall:4.2f}x)")
            result["trees"].setdefault(str(tree), {})[name] = {  # type: ignore[union-attr]
                "wall_s": [w for w, _ in runs],
                "cpu_s": [c for _, c in runs],
                "median_wall_s": wall,
                "median_cpu_s": cpu,
                "wall_vs_first_tree": wall / base_wall,
            }
        print(f"{name:24s} " + " ".join(f"{c:>30s}" for c in cells))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
