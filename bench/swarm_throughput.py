"""The cost of real transport: a 2x2 swarm of peer processes on loopback against the simulator.

Same config, same 2 cores: the swarm runs P x D `noloco join` processes with one torch thread
each (plus their p2pd daemons); the simulator runs the same replicas in one process with 2
threads, before and after each round's swarms (their geometric mean is the round's simulator
figure). Reports tokens/s of each and their ratio (alternating runs, medians), and the bytes each
peer sends per outer step against the model-size floor (the stage's fp32 weights: 1.0x; the
official code sends slow weights and their difference, 2x).

Each round runs the swarm once per event loop named in --loops (the peers' `peer.event_loop`),
so uvloop and asyncio are compared side by side too (the swarm's step time, not the simulator's),
and once per `inner.microbatches` value named in --microbatches, each against the simulator with
the same M (the same arithmetic) and against the first value's (the whole batch, when that is 1).
By default each peer and its p2pd run on their own share of the CPUs, as `noloco local` runs
them (`--pin on`); `--pin on,off` also runs the swarm unpinned in every round, side by side.

    python bench/swarm_throughput.py                 # 2x2, tiny, seq 64, batch 4, 60 steps, H=10
    python bench/swarm_throughput.py --rounds 1 --steps 30 --loops uvloop
    python bench/swarm_throughput.py --loops uvloop --microbatches 1,2,4   # microbatches in flight
    python bench/swarm_throughput.py --loops uvloop --pin on,off          # pinned against unpinned
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from noloco_swarm.harness.local import local_swarm, wait
from noloco_swarm.model import build_stage, num_flat
from noloco_swarm.peer.events import Outer, of_kind
from noloco_swarm.sim.engine import Simulator
from noloco_swarm.sim.run import data_batches
from noloco_swarm.train.layering import build_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--loops", default="uvloop,asyncio", help="peer event loops to run, comma-separated")
    ap.add_argument(
        "--microbatches", default="1", help="inner.microbatches values to run, comma-separated (e.g. 1,2,4)"
    )
    ap.add_argument(
        "--pin",
        default="on",
        help="on, off or on,off: peers pinned to CPUs as noloco local pins them, or not",
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config value for both sides"
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = ap.parse_args()
    loops = args.loops.split(",")
    ms = [int(m) for m in args.microbatches.split(",")]
    if not set(args.pin.split(",")) <= {"on", "off"}:
        ap.error(f"--pin takes on, off or on,off, not {args.pin!r}")
    pins = [p == "on" for p in args.pin.split(",")]
    base = {
        "num_stages": str(args.stages),
        "num_replicas": str(args.replicas),
        "model.seq_len": str(args.seq_len),
        "inner.batch_size": str(args.batch_size),
        "outer.inner_steps": str(args.inner_steps),
        "eval_windows": "4",
    } | dict(kv.split("=", 1) for kv in args.set)
    cfgs = {
        m: build_config("tiny", "noloco", assignments=base | {"inner.microbatches": str(m)}, env={})
        for m in ms
    }
    cfg = cfgs[ms[0]]
    tokens_per_step = args.replicas * args.batch_size * args.seq_len
    runs = [(m, loop, pin) for m in ms for loop in loops for pin in pins]
    swarm_tps: dict[str, list[float]] = {name(m, loop, pin, ms, pins): [] for m, loop, pin in runs}
    sim_tps: dict[int, list[float]] = {m: [] for m in ms}
    sim_drift: dict[int, list[float]] = {m: [] for m in ms}  # after / before, per round
    sent_ratio, recv_ratio = [], []
    floor = {
        s: num_flat(build_stage(cfg.model, s, cfg.num_stages, cfg.seed)) * 4 for s in range(cfg.num_stages)
    }

    def simulate(m: int) -> float:
        torch.set_num_threads(2)
        sim = Simulator(cfgs[m], data_batches(cfgs[m]))
        start = time.perf_counter()
        for _ in range(args.steps):
            sim.inner_step()
        return args.steps * tokens_per_step / (time.perf_counter() - start)

    for _ in range(args.rounds):
        # The simulator runs before and after the round's swarms, and a round's figure is their
        # geometric mean: the machine's pace drifts within minutes (by a third within an hour),
        # and one simulator run beside the swarms took that drift into the ratio.
        before = {m: simulate(m) for m in ms}
        for m, loop, pin in runs:
            peer_cfg = dataclasses.replace(cfgs[m], peer=dataclasses.replace(cfg.peer, event_loop=loop))
            with local_swarm(peer_cfg, args.steps, step_timeout=120, pin=pin) as swarm:
                wait(swarm, timeout=1800)
                summaries = swarm.summaries()
                outers = [(p.stage, e) for p in swarm.peers for e in of_kind(p.events(), Outer)]
            seconds = max(s.train_seconds for s in summaries if s.stage == 0)
            swarm_tps[name(m, loop, pin, ms, pins)].append(args.steps * tokens_per_step / seconds)
            sent_ratio += [e.sent_bytes / floor[s] for s, e in outers]
            recv_ratio += [e.received_bytes / floor[s] for s, e in outers]

        for m in ms:
            after = simulate(m)
            sim_tps[m].append(math.sqrt(before[m] * after))
            sim_drift[m].append(after / before[m])
    # Each swarm against the simulator of the same round: with the same M (the cost of transport)
    # and with M = the first value given (the whole-batch oracle, when that is 1).
    keys = {name(m, loop, pin, ms, pins): m for m, loop, pin in runs}
    ratio = {key: [a / b for a, b in zip(swarm_tps[key], sim_tps[m], strict=True)] for key, m in keys.items()}
    ratio_first = {key: [a / b for a, b in zip(swarm_tps[key], sim_tps[ms[0]], strict=True)] for key in keys}
    print(
        f"config: {args.stages} stages x {args.replicas} replicas, tiny, seq {args.seq_len}, batch {args.batch_size}, "
        f"H={args.inner_steps}, {args.steps} steps, {args.rounds} alternating rounds"
    )
    for key, m in keys.items():
        tps = swarm_tps[key]
        rounds = ", ".join(f"{r:.3f}" for r in ratio[key])
        print(f"swarm {key:20s} (processes, loopback): {statistics.median(tps):8.0f} tokens/s")
        print(f"  ratio swarm/simulator (same M)  : {statistics.median(ratio[key]):.3f} (rounds: {rounds})")
        if m != ms[0]:
            first = ", ".join(f"{r:.3f}" for r in ratio_first[key])
            print(
                f"  ratio swarm/simulator (M={ms[0]})   : {statistics.median(ratio_first[key]):.3f} (rounds: {first})"
            )
    for m in ms:
        drift = ", ".join(f"{d:.3f}" for d in sim_drift[m])
        print(f"simulator M={m} (one process)     : {statistics.median(sim_tps[m]):8.0f} tokens/s")
        print(f"  its pace after / before a round : {drift}")
    loop_ratio = pin_ratio = None
    if {"uvloop", "asyncio"} <= set(loops):
        loop_ratio = side_by_side(
            "uvloop/asyncio",
            swarm_tps[name(ms[0], "uvloop", pins[0], ms, pins)],
            swarm_tps[name(ms[0], "asyncio", pins[0], ms, pins)],
        )
    if {True, False} <= set(pins):
        pin_ratio = side_by_side(
            "pinned/unpinned",
            swarm_tps[name(ms[0], loops[0], True, ms, pins)],
            swarm_tps[name(ms[0], loops[0], False, ms, pins)],
        )
    print(
        f"bytes per outer step per peer / stage fp32 bytes: sent {statistics.median(sent_ratio):.4f}x, "
        f"received {statistics.median(recv_ratio):.4f}x ({len(sent_ratio)} exchanges; official code: 2x)"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": "python bench/swarm_throughput.py " + " ".join(sys.argv[1:]),
            "config": vars(args) | {"out": str(args.out)},
            "swarm_tokens_per_second": swarm_tps,
            "simulator_tokens_per_second": {f"M={m}": tps for m, tps in sim_tps.items()},
            "simulator_after_over_before": {f"M={m}": d for m, d in sim_drift.items()},
            "ratio_per_round": ratio,
            "ratio_median": {key: statistics.median(r) for key, r in ratio.items()},
            "ratio_to_first_m_simulator_median": {
                key: statistics.median(r) for key, r in ratio_first.items()
            },
            "uvloop_over_asyncio_median": loop_ratio,
            "pinned_over_unpinned_median": pin_ratio,
            "sent_bytes_per_stage_bytes_median": statistics.median(sent_ratio),
            "received_bytes_per_stage_bytes_median": statistics.median(recv_ratio),
            "exchanges": len(sent_ratio),
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def name(m: int, loop: str, pin: bool, ms: list[int], pins: list[bool]) -> str:
    """A run's label: the event loop, M when several values run, pinning when both ways run."""
    label = loop if ms == [1] else f"M={m} {loop}"
    return label if len(pins) == 1 else f"{label} {'pinned' if pin else 'unpinned'}"


def side_by_side(what: str, a: list[float], b: list[float]) -> float:
    """Print and return the median per-round ratio a/b of two swarms' tokens/s."""
    per_round = [x / y for x, y in zip(a, b, strict=True)]
    median = statistics.median(per_round)
    print(f"swarm {what} tokens/s : {median:.3f} (rounds: {', '.join(f'{r:.3f}' for r in per_round)})")
    return median


if __name__ == "__main__":
    main()
