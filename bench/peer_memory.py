"""A real model's peers on this machine: peak memory per peer against the state formula.

Starts a P x D swarm of `noloco join` processes (default: the `small` preset, 2 x 2, on the
embedded corpus, so with its tokenizer's 4096-token vocabulary) for a few inner steps and two outer
exchanges, and samples every process of every peer every 20 ms: its proportional set size (PSS,
/proc/PID/smaps_rollup; shared pages are split between the processes that share them, so the
forked DHT process is not charged for the parent's pages it never touched).

Per peer it reports:
  formula        6 x 4 bytes x stage parameters (weights, gradients, AdamW's two moments, phi, delta)
  main peak      the peer process's peak PSS, and that over the formula, split into the inner steps
                 and the outer exchanges (the windows between an exchange's start and its Outer event)
  idle           the peer process's PSS before its model exists (Python, torch, transformers,
                 hivemind) and the other processes' (the DHT process, p2pd): the fixed overhead
  peak - idle    what training adds, over the formula
and the exchange's seconds and bytes and the mean inner step, from the peers' own events.

    python bench/peer_memory.py --modes thp,map,off --repeat 2 --out docs/results/peer_memory.json
    python bench/peer_memory.py --modes thp,thp+arena_max=2   # a glibc tunable added to a setting
    python bench/peer_memory.py --preset tiny --steps 6 --inner-steps 3      # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from noloco_swarm.harness.local import local_swarm, wait
from noloco_swarm.peer.events import Outer, Started, Step, of_kind
from noloco_swarm.train.config import RunConfig
from noloco_swarm.train.layering import build_config
from noloco_swarm.train.memory import estimate

MIB = 2**20


def pss(pid: int) -> int:
    """Bytes of `pid`'s proportional set size (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


class Sampler:
    """Samples each peer's processes every `interval` s in a thread: (time, main PSS, others' PSS)."""

    def __init__(self, pids: list[int], interval: float = 0.02) -> None:
        self.samples: dict[int, list[tuple[float, int, int]]] = {p: [] for p in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        trees: dict[int, list[int]] = {}
        last_tree = 0.0
        while not self._stop.wait(interval):
            now = time.time()
            if now - last_tree > 1.0:  # the DHT process and p2pd appear after the start
                trees = {p: tree(p) for p in self.samples}
                last_tree = now
            for p, members in trees.items():
                main = pss(p)
                if main:
                    self.samples[p].append((now, main, sum(pss(q) for q in members if q != p)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--inner-steps", type=int, default=3, help="H: 8 steps with H = 3 is two exchanges")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="more config keys, KEY=VALUE")
    ap.add_argument(
        "--modes",
        default="map,trim,off",
        help="peer.release_memory values to run side by side; MODE+NAME=V adds glibc.malloc.NAME=V to "
        "the peers' GLIBC_TUNABLES (e.g. thp+arena_max=1)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="run the modes this many times over, alternating")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--timeline", type=Path, default=None, help="write every sample and event time here")
    args = ap.parse_args()
    assignments = {
        "num_stages": str(args.stages),
        "num_replicas": str(args.replicas),
        "model.seq_len": str(args.seq_len),
        "inner.batch_size": str(args.batch_size),
        "outer.inner_steps": str(args.inner_steps),
        "eval_windows": "2",
        **({"model.vocab_size": "4096"} if args.preset != "tiny" else {}),
        **dict(kv.split("=", 1) for kv in args.set),
    }
    results: dict[str, list[dict]] = {}
    for repeat in range(args.repeat):
        for spec in args.modes.split(","):
            mode, *tunables = spec.split("+")
            cfg = build_config(
                args.preset, "noloco", assignments={**assignments, "peer.release_memory": mode}, env={}
            )
            print(f"peer.release_memory = {spec} (run {repeat + 1} of {args.repeat}):")
            tunables_env = ":".join(f"glibc.malloc.{t}" for t in tunables)
            timeline = f"{args.timeline}.{spec}.{repeat}" if args.timeline else None
            rows = measure(cfg, args, timeline, tunables_env)
            results.setdefault(spec, []).extend({**row, "repeat": repeat} for row in rows)
    # Per setting, over every peer of every run: the medians the claims are made of, and the step
    # time over the fastest setting's.
    summary = {
        spec: {
            "training_over_formula": statistics.median(r["training_over_formula"] for r in rows),
            "training_over_formula_range": [
                min(r["training_over_formula"] for r in rows),
                max(r["training_over_formula"] for r in rows),
            ],
            "inner_step_seconds": statistics.median(r["inner_step_seconds"] for r in rows),
        }
        for spec, rows in results.items()
    }
    fastest = min(s["inner_step_seconds"] for s in summary.values())
    for spec, s in summary.items():
        s["step_over_fastest"] = s["inner_step_seconds"] / fastest
        print(
            f"{spec}: training adds {s['training_over_formula']:.2f}x of the formula (median; "
            f"{s['training_over_formula_range'][0]:.2f}-{s['training_over_formula_range'][1]:.2f}), "
            f"inner step {s['inner_step_seconds']:.2f} s = {s['step_over_fastest']:.3f}x the fastest"
        )
    result = {
        "command": "python bench/peer_memory.py " + " ".join(sys.argv[1:]),
        "preset": args.preset,
        "assignments": assignments,
        "summary": summary,
        "by_release_memory": results,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def measure(cfg: RunConfig, args: argparse.Namespace, timeline: str | None, tunables: str = "") -> list[dict]:
    """Run the swarm once and sample it; one row of figures per peer (`tunables`: glibc's, for the
    peers' GLIBC_TUNABLES)."""
    formula = {s: estimate(cfg, s).state for s in range(cfg.num_stages)}  # 6 x 4 bytes x parameters
    # peer.* keys are each peer's own (not in the run config its launcher hands it): through its
    # environment, as a volunteer would set them.
    env = {"NOLOCO_SET": f"peer.release_memory={cfg.peer.release_memory}"}
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    # Each peer started from scratch (preload=False): a forked peer shares its imports' pages with the
    # preloader, which would change what RSS and PSS mean against the figures recorded before.
    with local_swarm(
        cfg, args.steps, step_timeout=600, peer_env=lambda stage, replica: env, preload=False
    ) as swarm:
        sampler = Sampler([p.proc.pid for p in swarm.peers])
        try:
            wait(swarm, timeout=3600)
        finally:
            sampler.stop()
        events = {p.proc.pid: p.events() for p in swarm.peers}
        peers = [(p.stage, p.replica, p.proc.pid) for p in swarm.peers]
    rows = []
    for stage, replica, pid in peers:
        ev, samples = events[pid], sampler.samples[pid]
        started = next(iter(of_kind(ev, Started)), None)
        outers, steps = of_kind(ev, Outer), of_kind(ev, Step)
        # The exchange windows: from the boundary's step end to its Outer event.
        step_end = {s.step: s.time for s in steps}
        windows = [(step_end.get(o.step, o.time - o.seconds), o.time) for o in outers]
        in_exchange = [m for t, m, _ in samples if any(a <= t <= b for a, b in windows)]
        # Idle: the last sample before the peer builds its model (its Started event comes once its
        # daemon, DHT node and stage are up, before the replica exists); the others at their peak.
        before = [m for t, m, _ in samples if started is not None and t <= started.time]
        idle = before[-1] if before else min(m for _, m, _ in samples)
        peak = max(m for _, m, _ in samples)
        others = max(o for _, _, o in samples)
        f = formula[stage]
        rows.append(
            {
                "stage": stage,
                "replica": replica,
                "formula_mib": f / MIB,
                "main_peak_mib": peak / MIB,
                "main_peak_over_formula": peak / f,
                "inner_peak_over_formula": max(
                    (m for t, m, _ in samples if not any(a <= t <= b for a, b in windows)), default=0
                )
                / f,
                "exchange_peak_over_formula": max(in_exchange, default=0) / f,
                "idle_main_mib": idle / MIB,
                "other_processes_peak_mib": others / MIB,
                "fixed_overhead_mib": (idle + others) / MIB,
                "training_over_formula": (peak - idle) / f,
                "whole_peer_peak_over_formula": max(m + o for _, m, o in samples) / f,
                "exchange_seconds": [o.seconds for o in outers],
                "exchange_sent_mib": [o.sent_bytes / MIB for o in outers],
                "inner_step_seconds": statistics.median(s.seconds for s in steps) if steps else None,
                "samples": len(samples),
            }
        )
    for r in rows:
        print(
            f"stage {r['stage']} replica {r['replica']}: formula {r['formula_mib']:.0f} MiB; main peak "
            f"{r['main_peak_mib']:.0f} MiB = {r['main_peak_over_formula']:.2f}x (inner {r['inner_peak_over_formula']:.2f}x, "
            f"exchange {r['exchange_peak_over_formula']:.2f}x); fixed {r['fixed_overhead_mib']:.0f} MiB "
            f"(main idle {r['idle_main_mib']:.0f}, others {r['other_processes_peak_mib']:.0f}); "
            f"training adds {r['training_over_formula']:.2f}x; exchanges {', '.join(f'{x:.1f}' for x in r['exchange_seconds'])} s, "
            f"{', '.join(f'{x:.0f}' for x in r['exchange_sent_mib'])} MiB sent; step {r['inner_step_seconds']:.2f} s"
        )
    if timeline:  # every sample and event time of each peer, for a closer look
        Path(timeline).write_text(
            json.dumps(
                {
                    f"{stage}-{replica}": {
                        "samples": [(t, m / MIB, o / MIB) for t, m, o in sampler.samples[pid]],
                        "events": [(e.time, e.KIND, getattr(e, "step", None)) for e in events[pid]],
                    }
                    for stage, replica, pid in peers
                }
            )
        )
    return rows


if __name__ == "__main__":
    main()
