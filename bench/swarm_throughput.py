"""The cost of real transport: a 2x2 swarm of peer processes on loopback against the simulator.

Same config, same 2 cores: the swarm runs P x D `noloco join` processes with one torch thread
each (plus their p2pd daemons); the simulator runs the same replicas in one process with 2
threads. Reports tokens/s of each and their ratio (alternating runs, medians), and the bytes each
peer sends per outer step against the model-size floor (the stage's fp32 weights: 1.0x; the
official code sends slow weights and their difference, 2x).

Each round runs the swarm once per event loop named in --loops (the peers' `peer.event_loop`),
so uvloop and asyncio are compared side by side too (the swarm's step time, not the simulator's).

    python bench/swarm_throughput.py                 # 2x2, tiny, seq 64, batch 4, 60 steps, H=10
    python bench/swarm_throughput.py --rounds 1 --steps 30 --loops uvloop
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from noloco_swarm.cli.options import build_config
from noloco_swarm.cli.swarm import local_swarm, wait
from noloco_swarm.model import build_stage, num_flat
from noloco_swarm.peer.events import Outer, of_kind
from noloco_swarm.sim.engine import Simulator
from noloco_swarm.sim.run import data_batches


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
    ap.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = ap.parse_args()
    loops = args.loops.split(",")
    cfg = build_config(
        "tiny",
        "noloco",
        assignments={
            "num_stages": str(args.stages),
            "num_replicas": str(args.replicas),
            "model.seq_len": str(args.seq_len),
            "inner.batch_size": str(args.batch_size),
            "outer.inner_steps": str(args.inner_steps),
            "eval_windows": "4",
        },
        env={},
    )
    tokens_per_step = args.replicas * args.batch_size * args.seq_len
    swarm_tps: dict[str, list[float]] = {loop: [] for loop in loops}
    sim_tps, sent_ratio, recv_ratio = [], [], []
    floor = {
        s: num_flat(build_stage(cfg.model, s, cfg.num_stages, cfg.seed)) * 4 for s in range(cfg.num_stages)
    }
    for _ in range(args.rounds):
        for loop in loops:
            peer_cfg = dataclasses.replace(cfg, peer=dataclasses.replace(cfg.peer, event_loop=loop))
            with local_swarm(peer_cfg, args.steps, step_timeout=120) as swarm:
                wait(swarm, timeout=1800)
                summaries = swarm.summaries()
                outers = [(p.stage, e) for p in swarm.peers for e in of_kind(p.events(), Outer)]
            seconds = max(s.train_seconds for s in summaries if s.stage == 0)
            swarm_tps[loop].append(args.steps * tokens_per_step / seconds)
            sent_ratio += [e.sent_bytes / floor[s] for s, e in outers]
            recv_ratio += [e.received_bytes / floor[s] for s, e in outers]

        torch.set_num_threads(2)
        sim = Simulator(cfg, data_batches(cfg))
        start = time.perf_counter()
        for _ in range(args.steps):
            sim.inner_step()
        sim_tps.append(args.steps * tokens_per_step / (time.perf_counter() - start))
    ratio = {loop: [a / b for a, b in zip(tps, sim_tps, strict=True)] for loop, tps in swarm_tps.items()}
    print(
        f"config: {args.stages} stages x {args.replicas} replicas, tiny, seq {args.seq_len}, batch {args.batch_size}, "
        f"H={args.inner_steps}, {args.steps} steps, {args.rounds} alternating rounds"
    )
    for loop, tps in swarm_tps.items():
        rounds = ", ".join(f"{r:.3f}" for r in ratio[loop])
        print(f"swarm on {loop:8s} (processes, loopback): {statistics.median(tps):8.0f} tokens/s")
        print(f"  ratio swarm/simulator          : {statistics.median(ratio[loop]):.3f} (rounds: {rounds})")
    print(f"simulator (one process)          : {statistics.median(sim_tps):8.0f} tokens/s")
    loop_ratio = None
    if {"uvloop", "asyncio"} <= set(loops):
        per_round = [a / b for a, b in zip(swarm_tps["uvloop"], swarm_tps["asyncio"], strict=True)]
        loop_ratio = statistics.median(per_round)
        print(
            f"swarm uvloop/asyncio tokens/s   : {loop_ratio:.3f} (rounds: {', '.join(f'{r:.3f}' for r in per_round)})"
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
            "simulator_tokens_per_second": sim_tps,
            "ratio_per_round": ratio,
            "ratio_median": {loop: statistics.median(r) for loop, r in ratio.items()},
            "uvloop_over_asyncio_median": loop_ratio,
            "sent_bytes_per_stage_bytes_median": statistics.median(sent_ratio),
            "received_bytes_per_stage_bytes_median": statistics.median(recv_ratio),
            "exchanges": len(sent_ratio),
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
