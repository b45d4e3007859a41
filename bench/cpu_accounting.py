"""Where a swarm's CPU goes per inner step, against the simulator doing the same arithmetic.

`bench/swarm_throughput.py` gives one ratio (swarm tokens/s over the simulator's); this splits
the swarm's side into parts. A 2x2 swarm of the tiny preset (seq 64, batch 4, H=10, one torch
thread per peer, uvloop) trains; after --warm steps, the CPU time of every thread under every
peer is read from /proc twice, --window seconds apart, and divided by the inner steps taken in
between: core-ms per step, by part: the peers' compute threads (`asyncio.to_thread` workers:
forward, backward, optimizer), their event-loop threads (messages, streams, the outer exchange's
bookkeeping, the DHT node), their p2pd daemons, and anything else. The simulator runs the same
replicas' steps in one process with one thread, alone and as --contenders copies at once (the
swarm's 2P x D processes share the machine's cores and caches too), giving the arithmetic's own
core-ms per step and what contention alone adds to it.

Each checkout in --trees runs in its own child process (its own `noloco_swarm`), alternating
over --reps, so builds are compared side by side on the same machine state.

    python bench/cpu_accounting.py --trees /path/to/old-checkout,. --out runs/cpu_accounting.json
    # another schedule or setting: --set KEY=VALUE on top of the bench's config (repeatable); the
    # current figures (docs/benchmarks.md) are this, and the same without the microbatches (m1)
    python bench/cpu_accounting.py --reps 1 --window 20 --set model.seq_len=128 --set inner.batch_size=16 \
        --set outer.inner_steps=50 --set inner.microbatches=5 --set inner.microbatch_sizes=2,4,4,4,2 \
        --set wire.activations=int8 --set peer.release_memory=off --out docs/results/cpu_accounting_b16_m5_off.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from noloco_swarm.train.layering import ConfigError, parse_assignments

CONFIG = {
    "num_stages": "2",
    "num_replicas": "2",
    "model.seq_len": "64",
    "inner.batch_size": "4",
    "outer.inner_steps": "10",
    "eval_windows": "4",
}
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(path: str) -> float:
    """utime + stime of /proc/PID or /proc/PID/task/TID (0 if it is gone)."""
    try:
        stat = Path(path, "stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def descendants(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        parent = stack.pop()
        for task in os.listdir(f"/proc/{parent}/task") if os.path.isdir(f"/proc/{parent}/task") else []:
            try:
                kids = [int(c) for c in Path(f"/proc/{parent}/task/{task}/children").read_text().split()]
            except OSError:
                continue
            found += kids
            stack += kids
    return found


def by_part(peer_pids: list[int]) -> dict[str, float]:
    """CPU seconds so far of every thread under the peers, by part."""
    parts: dict[str, float] = defaultdict(float)
    for pid in peer_pids:
        for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
            part = "event loop" if int(task) == pid else "compute threads"
            parts[part] += cpu_seconds(f"/proc/{pid}/task/{task}")
        for child in descendants(pid):
            try:
                name = Path(f"/proc/{child}/comm").read_text().strip()
            except OSError:
                continue
            parts["p2pd" if name == "p2pd" else "other"] += cpu_seconds(f"/proc/{child}")
    return dict(parts)


def swarm_child(warm: int, window: float, config: dict[str, str]) -> dict[str, object]:
    """Runs in the tree under test: the swarm's core-ms per step by part."""
    import dataclasses

    from noloco_swarm.harness.local import local_swarm
    from noloco_swarm.peer.events import Step, of_kind
    from noloco_swarm.train.layering import build_config

    cfg = build_config("tiny", "noloco", assignments=config, env={})
    cfg = cfg.replace(peer=dataclasses.replace(cfg.peer, event_loop="uvloop"))
    # Peers started from scratch (preload=False), children of this process, as the figures recorded
    # before were measured.
    with local_swarm(cfg, 100_000, step_timeout=120, preload=False) as swarm:
        deadline = time.monotonic() + 600
        while min(len(of_kind(p.events(), Step)) for p in swarm.peers) < warm:
            if time.monotonic() > deadline or any(p.proc.poll() is not None for p in swarm.peers):
                raise SystemExit("the swarm did not reach its warm-up steps: " + swarm.peers[0].log_tail())
            time.sleep(0.2)
        pids = [p.proc.pid for p in swarm.peers]
        steps0, cpu0 = [len(of_kind(p.events(), Step)) for p in swarm.peers], by_part(pids)
        time.sleep(window)
        steps1, cpu1 = [len(of_kind(p.events(), Step)) for p in swarm.peers], by_part(pids)
    steps = statistics.mean(b - a for a, b in zip(steps0, steps1, strict=True))  # swarm steps, every replica
    per_step = {part: 1000 * (cpu1[part] - cpu0.get(part, 0.0)) / steps for part in cpu1}
    return {"steps": steps, "seconds": window, "core_ms_per_step": per_step}


def simulator_child(steps: int, config: dict[str, str]) -> dict[str, object]:
    """The simulator's core-ms per step, one thread (the tree's own simulator)."""
    import resource

    import torch

    from noloco_swarm.sim.engine import Simulator
    from noloco_swarm.sim.run import data_batches
    from noloco_swarm.train.layering import build_config

    torch.set_num_threads(1)
    cfg = build_config("tiny", "noloco", assignments=config, env={})
    sim = Simulator(cfg, data_batches(cfg))
    for _ in range(5):
        sim.inner_step()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(steps):
        sim.inner_step()
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"core_ms_per_step": 1000 * cpu / steps, "wall_ms_per_step": 1000 * wall / steps}


def run_child(tree: Path, sets: list[str], *args: str) -> subprocess.Popen[str]:
    env = os.environ | {"PYTHONPATH": str(tree)}
    argv = [sys.executable, str(Path(__file__).resolve()), *(f"--set={kv}" for kv in sets), "--child", *args]
    return subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.PIPE, text=True)


def result_of(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"a measuring child failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=".", help="noloco-swarm checkouts to compare, comma-separated")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--warm", type=int, default=30, help="inner steps every peer takes before measuring")
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured")
    ap.add_argument("--sim-steps", type=int, default=60)
    ap.add_argument("--contenders", type=int, default=4, help="simulators run at once for contention")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config value on top of the bench's (repeatable), for example inner.microbatches=5",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:  # each --set as `noloco --set` reads it
        config = CONFIG | parse_assignments(";".join(args.set))
    except ConfigError as e:
        ap.error(f"--set: {e}")
    if args.child:
        kind, *values = args.child
        if kind == "swarm":
            print(json.dumps(swarm_child(int(values[0]), float(values[1]), config)))
        else:
            print(json.dumps(simulator_child(int(values[0]), config)))
        return
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    here = Path(__file__).resolve().parents[1]
    swarms: dict[str, list[dict[str, float]]] = {str(t): [] for t in trees}
    alone, contended = [], []
    for _ in range(args.reps):
        for tree in trees:
            swarms[str(tree)].append(
                result_of(run_child(tree, args.set, "swarm", str(args.warm), str(args.window)))[
                    "core_ms_per_step"
                ]
            )
        alone.append(result_of(run_child(here, args.set, "sim", str(args.sim_steps)))["core_ms_per_step"])
        crowd = [run_child(here, args.set, "sim", str(args.sim_steps)) for _ in range(args.contenders)]
        contended.append(statistics.mean(result_of(p)["core_ms_per_step"] for p in crowd))
    sim = {"alone": statistics.median(alone), f"{args.contenders} at once": statistics.median(contended)}
    print(
        f"simulator, one thread: {sim['alone']:.1f} core-ms per step alone, "
        f"{sim[f'{args.contenders} at once']:.1f} with {args.contenders} running at once"
    )
    result = {}
    for tree, reps in swarms.items():
        parts = sorted({k for rep in reps for k in rep})
        median = {k: statistics.median(rep.get(k, 0.0) for rep in reps) for k in parts}
        total = statistics.median(sum(rep.values()) for rep in reps)
        commit = subprocess.run(
            ["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        result[tree] = {
            "commit": commit,
            "reps": reps,
            "median_core_ms_per_step": median,
            "median_total": total,
        }
        shown = ", ".join(f"{k} {v:.1f}" for k, v in median.items())
        print(
            f"{tree} ({commit}): swarm {total:.1f} core-ms per step ({shown}); "
            f"{total / sim['alone']:.2f}x the simulator's arithmetic"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = "python bench/cpu_accounting.py " + " ".join(sys.argv[1:])
        payload = {"command": command, "config": config, "simulator_core_ms_per_step": sim, "trees": result}
        args.out.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
