"""The largest real swarm this machine holds: 4 stages x 8 replicas of real peer processes (each
with its own p2pd) on the namespace testbed, every peer behind its own one-way delay (5-40 ms,
drawn from the seed), playing the chaos schedule of noloco_swarm/harness/chaos.py: a kill, a
joiner, a peer and its daemon frozen past the deadline, a link cut, a delay spike (the victim's
DHT traffic is delayed with the rest of its link) and a graceful leave. Then the membership
simulator runs the same N, stages, round length and faults, for the comparison the issue asks
(in the peer's layout: records passed between members, no boundary read, no audits).

Recorded: rounds and the views each held (how many rounds every running peer agreed), the pace
(inner steps per second after each fault / healthy), samples lost (sender side), memory (the sum of
every peer's and daemon's PSS, sampled every 5 s: peak, and per peer at the peak), DHT calls per
peer and round (from each survivor's final event: stores and key reads of its directory, and the
records' bytes), and join time (from the joiner's start to its `joined` event, and the same for
the peers that rejoined).

    python bench/big_swarm.py --out docs/results/big_swarm.json --scale docs/results/membership_scale.json
    (root; about 15 minutes)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from fixed_overhead import children, pss

from noloco_swarm.harness.chaos import Chaos, schedule, trained_samples, views_since
from noloco_swarm.harness.local import wait
from noloco_swarm.harness.namespaces import namespace_swarm, peer_host
from noloco_swarm.peer.events import Dropped, Excluded, Final, Joined, Membership, of_kind
from noloco_swarm.sim.membership import Churn, Scenario, simulate
from noloco_swarm.train.layering import build_config

STAGES, REPLICAS, H, BATCH = 4, 8, 5, 2


class Memory:
    """Sums the PSS of every process under this one (the peers, their daemons) every `period` s."""

    def __init__(self, period: float = 5.0) -> None:
        self.period, self.peak, self.samples = period, 0.0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.wait(self.period):
            kids, total, todo, count = children(), 0.0, list(children().get(me, [])), 0
            while todo:
                pid = todo.pop()
                total += pss(pid)
                count += 1
                todo.extend(kids.get(pid, []))
            self.samples.append((time.time(), total, count))
            self.peak = max(self.peak, total)

    def __enter__(self) -> Memory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def config(steps: int):
    return build_config(
        "tiny",
        "noloco",
        assignments={
            "num_stages": str(STAGES),
            "num_replicas": str(REPLICAS),
            "model.seq_len": "32",
            "inner.batch_size": str(BATCH),
            "outer.inner_steps": str(H),
            "inner.warmup_steps": "2",
            "inner.total_steps": str(steps),
            "eval_windows": "2",
        },
        env={},
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-timeout", type=float, default=20.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--scale",
        type=Path,
        default=None,
        help="also put the real run's row into this membership_scale.json (replacing a real row of the same N)",
    )
    args = ap.parse_args()
    rng = random.Random(args.seed)
    faults = schedule(args.seed, STAGES, REPLICAS, inner_steps=H)
    hosts = [peer_host(s, r) for s in range(STAGES) for r in range(REPLICAS)] + [
        faults[1].host
    ]  # the joiner's
    delays = {host: float(rng.randint(5, 40)) for host in hosts}
    started = time.time()
    workdir = Path("runs/big_swarm") / time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
    workdir.mkdir(parents=True, exist_ok=True)  # the peers' logs and events stay there
    with (
        Memory() as memory,
        namespace_swarm(
            config(args.steps),
            args.steps,
            step_timeout=args.step_timeout,
            delays=delays,
            spares={faults[0].stage: 1},
            workdir=workdir,
        ) as ns,
    ):
        record = Chaos(ns, faults, inner_steps=H, window_steps=2 * H, phase_timeout=900).play()
        wait(ns.swarm, timeout=3600, ignore=record.killed)
        peers = list(ns.swarm.peers)
        events = [p.events() for p in peers]
    wall = time.time() - started
    finals = [f for ev in events for f in of_kind(ev, Final)]
    views = views_since(events, 0.0)
    rounds = sorted(views)
    counted = [(f.dht, max(1, (f.steps - f.joined_round * H) // H)) for f in finals if f.dht]
    dht = {
        key: statistics.median(calls[key] / rounds_in for calls, rounds_in in counted)
        for key in ("stores", "reads", "bytes_stored", "bytes_read")
    }
    joiner_joined = next(iter(of_kind(events[peers.index(record.joiners[0])], Joined)))
    rejoins = []
    for ev in events:
        for out in of_kind(ev, Excluded):
            back = [j for j in of_kind(ev, Joined) if j.time > out.time]
            if back:
                rejoins.append(back[0].time - out.time)
    ref = next(ev for p, ev in zip(peers, events, strict=True) if (p.stage, p.replica) == (1, 0))
    round_times = sorted(m.time for m in of_kind(ref, Membership))
    round_seconds = statistics.median(b - a for a, b in itertools.pairwise(round_times))
    at_peak = max(memory.samples, key=lambda s: s[1])
    stage0 = [ev for p, ev in zip(peers, events, strict=True) if p.stage == 0]
    healthy = record.windows[0].pace
    real = {
        "real": True,
        "peers": STAGES * REPLICAS,
        "stages": STAGES,
        "churn_per_hour": 6 / ((record.ended["leave"] - record.started["kill"]) / 3600),
        "dht_delay": "the testbed's: hivemind over p2pd, every link 5-40 ms each way",
        "rounds": len(rounds),
        "rounds_all_agree": sum(1 for r in rounds if len(views[r]) == 1),
        "longest_split_rounds": longest_run([len(views[r]) != 1 for r in rounds]),
        "stalls": sum(1 for w in record.windows[1:] if w.pace < 0.5 * healthy),
        "samples_lost": sum(e.samples for ev in events for e in of_kind(ev, Dropped) if e.side == "sender"),
        "dht_ops_per_peer_round": dht["stores"] + dht["reads"],
        "dht_bytes_per_peer_round": dht["bytes_stored"] + dht["bytes_read"],
        "busiest_dht_node_bytes_per_round": None,
        "join_seconds_median": joiner_joined.time - record.started["join"],
        "joins": 1 + len(rejoins),
        "dht": "testbed",
        "seconds": wall,
        "rejoin_seconds": rejoins,
        "round_seconds_median": round_seconds,
        "pace_ratios": {w.after: w.pace / healthy for w in record.windows[1:]},
        "healthy_steps_per_second": healthy,
        "trained_samples_during_schedule": trained_samples(
            stage0, BATCH, record.started["kill"], record.ended["leave"]
        ),
        "memory_peak_mib": memory.peak,
        "memory_processes_at_peak": at_peak[2],
        "memory_per_peer_mib_at_peak": at_peak[1] / (STAGES * REPLICAS),
        "dht_calls_per_peer_round": dht,
        "wall_seconds": wall,
        "schedule": record.summary(),
    }
    # The simulator at the same N, stages, round length and faults (seconds after round 0).
    t0 = min(m.time for ev in events for m in of_kind(ev, Membership))
    scripted = []
    for f in faults:
        kind = {"kill": "crash", "leave": "leave", "stop": "stall", "cut": "stall", "join": "join"}.get(
            f.kind
        )
        if kind is not None:
            # the simulator's peer i serves stage i % stages
            scripted.append((record.started[f.kind] - t0, kind, f.replica * STAGES + f.stage))
    sim = simulate(
        Scenario(
            peers=STAGES * REPLICAS,
            stages=STAGES,
            rounds=len(rounds),
            round_seconds=round_seconds,
            inner_steps=H,
            batch=BATCH,
            churn=Churn(stall_seconds=20.0),
            faults=tuple(sorted(scripted)),
            seed=args.seed,
            # the peer's layout since 2026-12-07: records passed between members, no boundary read,
            # no audits (its heartbeats still go to one key: the same operations, on fewer nodes),
            # joiners that ask members whom to join with
            records="gossip",
            directory="spread",
            audits=0,
            join="member",
        )
    )
    print(json.dumps({k: v for k, v in real.items() if k != "schedule"}, indent=1))
    print("simulator:", json.dumps(sim, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": "python bench/big_swarm.py " + " ".join(sys.argv[1:]),
            "logs": str(workdir),
            "runs": [real, {"real": False, **sim}],
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.scale is not None:
        add_real_row(args.scale, real)


def add_real_row(path: Path, real: dict) -> None:
    """Put the real run's row, with the simulator's keys and "real": true, into membership_scale.json."""
    scale = json.loads(path.read_text())
    keys = [k for k in scale["runs"][0] if k != "real"]
    row = {k: real.get(k) for k in keys} | {"real": True, "details": "docs/results/big_swarm.json"}
    scale["runs"] = [r for r in scale["runs"] if not (r.get("real") and r["peers"] == real["peers"])] + [row]
    path.write_text(json.dumps(scale, indent=1) + "\n")


def longest_run(flags: list[bool]) -> int:
    best = run = 0
    for flag in flags:
        run = run + 1 if flag else 0
        best = max(best, run)
    return best


if __name__ == "__main__":
    main()
