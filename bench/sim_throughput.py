"""Simulator overhead: its tokens/s against plain single-model training on the same cores.

Plain training is the textbook loop (one unsplit tiny model, AdamW, clipping, the same schedule).
The simulator runs N replicas x P stages with random routes and NoLoCo outer steps; it does N
times the work per step, so equal tokens/s means zero overhead. The two are timed in alternating
blocks in one process so that machine noise hits both alike; the ratio of medians is reported.

    python bench/sim_throughput.py                       # N=2, P=2, batch 8, seq 128
    python bench/sim_throughput.py --replicas 4 --stages 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from noloco_swarm.model import build_model
from noloco_swarm.protocol.clock import lr_at
from noloco_swarm.sim.engine import Simulator
from noloco_swarm.train.layering import build_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument(
        "--inner-steps", type=int, default=10, help="H, so that outer steps fall inside the timing"
    )
    ap.add_argument("--block", type=int, default=10, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = build_config(
        "tiny",
        "noloco",
        assignments={
            "num_replicas": str(args.replicas),
            "num_stages": str(args.stages),
            "inner.batch_size": str(args.batch_size),
            "model.seq_len": str(args.seq_len),
            "outer.inner_steps": str(args.inner_steps),
        },
        env={},
    )
    B, T, D = args.batch_size, args.seq_len, args.replicas
    g = torch.Generator().manual_seed(0)
    pool = torch.randint(0, cfg.model.vocab_size, (D, 64, B, T + 1), generator=g)
    sim = Simulator(cfg, lambda d, t: pool[d, t % 64])

    model = build_model(cfg.model, cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr, betas=cfg.inner.betas, foreach=True)
    plain_step = 0

    def plain_block() -> None:
        nonlocal plain_step
        for _ in range(args.block):
            w = pool[0, plain_step % 64]
            (model(w[:, :-1], w[:, 1:]).sum() / B).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
            lr = lr_at(plain_step, base_lr=cfg.inner.lr, min_lr=cfg.inner.min_lr,
                       warmup_steps=cfg.inner.warmup_steps, total_steps=cfg.inner.total_steps)  # fmt: skip
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            opt.zero_grad(set_to_none=True)
            plain_step += 1

    def sim_block() -> None:
        for _ in range(args.block):
            sim.inner_step()

    plain_block()  # warm-up both
    sim_block()
    plain_tps, sim_tps = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        plain_block()
        plain_tps.append(args.block * B * T / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        sim_block()
        sim_tps.append(args.block * D * B * T / (time.perf_counter() - t0))
    ratios = [s / p for s, p in zip(sim_tps, plain_tps, strict=True)]
    print(f"config: N={D} P={args.stages} B={B} T={T} H={args.inner_steps}, {args.threads} threads, "
          f"{args.rounds} rounds of {args.block} steps; {sim.outer_steps} outer steps in the timed simulator")  # fmt: skip
    print(f"plain training : {statistics.median(plain_tps):8.0f} tokens/s (median)")
    print(f"simulator      : {statistics.median(sim_tps):8.0f} tokens/s (median)")
    print(f"ratio sim/plain: {statistics.median(ratios):.3f} (per-round {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
