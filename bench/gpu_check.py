"""GPU checks (issue 14): a stage trains on the GPU, a GPU swarm reproduces the simulator, and
one stage's tokens/s against a plain training loop.

1. train: the stages of a 2-stage pipeline (StageReplica, the class the peers and the simulator
   use) train a few steps on `--device` with bf16 autocast on one fixed batch. Passes if every
   loss is finite, the last is below the first, a matmul really ran in bf16 while the weights
   and gradients stayed fp32, and the weights changed.
2. swarm: a 2x2 swarm of real `noloco join` processes with `--device DEVICE` (as the integration
   tests launch them on the CPU) trains with bf16 autocast; the simulator then runs the same
   config on the same device in this process. Passes if every replica's final state hash
   equals the simulator's. On CUDA both sides use deterministic kernels (`peer.deterministic`,
   `noloco_swarm.train.cuda`): some default CUDA kernels sum in a different order every run.
3. throughput: tokens/s of one stage (the whole model as one StageReplica: its input checks,
   per-sample losses, clipping, AdamW) against a hand-written loop over the same layers (the same
   modules copied, token-mean cross-entropy, the same clipping and AdamW), on the same batch, both
   under bf16 autocast, in alternating timed blocks; the ratio of medians must reach
   `--min-ratio` (0.8).

Without a CUDA device a `--device cuda` run prints "skipped: ..." and exits 0. Not yet run on a
GPU: the project has had none. The same code runs on the CPU as a smoke test:

    bash scripts/gpu_check.sh                                    # GPU defaults, a few minutes
    python bench/gpu_check.py --device cpu --preset tiny --seq-len 32 --batch-size 2 \\
        --train-steps 4 --bench-steps 2 --rounds 1 --min-ratio 0            # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from noloco_swarm.harness.local import local_swarm, wait
from noloco_swarm.model import Stage
from noloco_swarm.model.presets import get_preset
from noloco_swarm.sim.engine import Simulator
from noloco_swarm.sim.run import data_batches
from noloco_swarm.train.config import RunConfig
from noloco_swarm.train.cuda import CUBLAS_WORKSPACE, deterministic_cuda
from noloco_swarm.train.layering import build_config
from noloco_swarm.train.replica import StageReplica

SKIP = "skipped: no CUDA device (torch.cuda.is_available() is False)"
CHECKS = ("train", "swarm", "throughput")
Row = dict[str, Any]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--checks", default=",".join(CHECKS), help="which checks, comma-separated")
    ap.add_argument("--preset", default="small", help="model preset of the train and throughput checks")
    ap.add_argument("--seq-len", type=int, default=512, help="train and throughput checks")
    ap.add_argument("--batch-size", type=int, default=8, help="train and throughput checks")
    ap.add_argument("--train-steps", type=int, default=10)
    ap.add_argument("--swarm-steps", type=int, default=7, help="H = 3: two outer steps and one more")
    ap.add_argument("--swarm-seq-len", type=int, default=128)
    ap.add_argument("--swarm-batch-size", type=int, default=4)
    ap.add_argument(
        "--swarm-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config of the swarm check (repeatable), e.g. model.attn_implementation=eager "
        "to take SDPA's attention kernels out of a hash mismatch",
    )
    ap.add_argument("--swarm-timeout", type=float, default=300.0, help="seconds for the whole swarm run")
    ap.add_argument("--bench-steps", type=int, default=10, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=3, help="alternating timed blocks of each loop")
    ap.add_argument("--min-ratio", type=float, default=0.8, help="throughput goal: stage / plain")
    ap.add_argument("--out", type=Path, default=None, help="JSON results here (default: $OUT/gpu_check.json)")
    args = ap.parse_args()
    checks = [c for c in args.checks.split(",") if c]
    if unknown := set(checks) - set(CHECKS):
        ap.error(f"unknown checks {sorted(unknown)}; choose from {', '.join(CHECKS)}")
    if bad := [kv for kv in args.swarm_set if "=" not in kv]:
        ap.error(f"--swarm-set takes KEY=VALUE, got {bad}")
    out = args.out or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else None)
    result: Row = {
        "command": " ".join(["python", "bench/gpu_check.py", *sys.argv[1:]]),
        "config": vars(args) | {"out": str(out) if out else None},
        "torch": torch.__version__,
    }
    if args.device == "cuda" and not torch.cuda.is_available():
        print(SKIP)
        write(out, result | {"skipped": SKIP})
        return 0
    if args.device == "cuda":
        # Read when this process first creates a cuBLAS handle: set before any CUDA work, so that
        # the swarm check's simulator can use deterministic cuBLAS later in this process.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        result["gpu"] = torch.cuda.get_device_name()
    torch.manual_seed(0)
    runners = {"train": check_train, "throughput": check_throughput, "swarm": check_swarm}
    result["checks"] = {}
    # The swarm check last: it turns deterministic kernels on in this process.
    for name in sorted(checks, key=lambda c: c == "swarm"):
        t0 = time.perf_counter()
        print(f"--- {name}", flush=True)
        try:
            row = runners[name](args)
        except Exception as e:  # noqa: BLE001  (a failed check, recorded; the others still run and report)
            traceback.print_exc()
            row = {"ok": False, "summary": f"raised {e!r}"[:300], "error": traceback.format_exc()[-4000:]}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        print(
            f"{name}: {'ok' if row['ok'] else 'FAILED'} ({row['seconds']} s) {row.get('summary', '')}",
            flush=True,
        )
        result["checks"][name] = row
    result["ok"] = all(r["ok"] for r in result["checks"].values())
    print(json.dumps(result, indent=1))
    write(out, result)
    return 0 if result["ok"] else 1


def write(out: Path | None, result: Row) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")


def config(preset: str, stages: int, replicas: int, seq_len: int, batch: int, **extra: str) -> RunConfig:
    """A run config with bf16 autocast; the same for every check but its shape."""
    if get_preset(preset).vocab_size > 65536:  # beyond the embedded tokenizer: name the paper's
        # (Llama-3) instead; the train and throughput checks draw random token ids, never loading it.
        extra = {"data.source": "hf", "data.tokenizer": "meta-llama/Meta-Llama-3-8B", **extra}
    assignments = {
        "num_stages": str(stages),
        "num_replicas": str(replicas),
        "model.seq_len": str(seq_len),
        "inner.batch_size": str(batch),
        "model.autocast_bf16": "true",
        "eval_windows": "4",
        **extra,
    }
    return build_config(preset, "noloco", assignments=assignments, env={})


def random_batch(cfg: RunConfig, device: str) -> torch.Tensor:
    """One fixed (B, seq_len + 1) window of token ids, drawn on the CPU so every device gets it."""
    g = torch.Generator().manual_seed(cfg.seed)
    shape = (cfg.inner.batch_size, cfg.model.seq_len + 1)
    return torch.randint(0, cfg.model.vocab_size, shape, generator=g).to(device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------- 1. a stage trains


def check_train(args: argparse.Namespace) -> Row:
    """A 2-stage pipeline of StageReplicas overfits one batch under bf16 autocast on the device."""
    cfg = config(
        args.preset, 2, 1, args.seq_len, args.batch_size,
        **{"inner.warmup_steps": "1", "inner.total_steps": "1000"},
    )  # fmt: skip
    stages = [StageReplica(cfg, s, device=args.device) for s in range(2)]
    before = [r.state_hash() for r in stages]
    seen: set[torch.dtype] = set()
    first_linear = next(m for m in stages[0].module.modules() if isinstance(m, nn.Linear))
    first_linear.register_forward_hook(lambda _m, _i, o: seen.add(o.dtype))
    w = random_batch(cfg, args.device)
    losses = []
    for step in range(args.train_steps):
        hidden = stages[0].module(w[:, :-1])
        received = hidden.detach().requires_grad_(True)  # what crosses to the next stage, as a peer
        sample_losses = stages[1].module(received, w[:, 1:])
        stages[1].backward_losses(sample_losses)
        hidden.backward(received.grad)
        lr = stages[0].lr_at(step)
        for r in stages:
            r.optimizer_step(lr)
        losses.append(float(sample_losses.detach().mean()))
    params = [p for r in stages for p in r.module.parameters()]
    on_device = all(p.device.type == args.device for p in params)
    fp32 = all(p.dtype == torch.float32 for p in params)
    finite = all(math.isfinite(x) for x in losses)
    changed = all(r.state_hash() != h for r, h in zip(stages, before, strict=True))
    ok = finite and losses[-1] < losses[0] and torch.bfloat16 in seen and fp32 and on_device and changed
    return {
        "ok": ok,
        "summary": f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, linear outputs {sorted(map(str, seen))}",
        "losses": losses,
        "finite": finite,
        "decreased": losses[-1] < losses[0],
        "bf16_matmuls": torch.bfloat16 in seen,
        "weights_fp32": fp32,
        "on_device": on_device,
        "weights_changed": changed,
        "preset": args.preset,
        "parameters": sum(p.numel() for p in params),
    }


# ---------------------------------------------------------------------- 2. swarm == simulator


def check_swarm(args: argparse.Namespace) -> Row:
    """A 2x2 swarm of peer processes on the device against the simulator on the same device."""
    cfg = config(
        "tiny", 2, 2, args.swarm_seq_len, args.swarm_batch_size,
        **{"outer.inner_steps": "3", "inner.warmup_steps": "2", "inner.total_steps": str(args.swarm_steps + 1)},
        **dict(kv.split("=", 1) for kv in args.swarm_set),
    )  # fmt: skip
    cuda = args.device == "cuda"
    cfg = cfg.replace(peer=dataclasses.replace(cfg.peer, device=args.device, deterministic=cuda))
    with local_swarm(cfg, args.swarm_steps, step_timeout=120) as swarm:
        wait(swarm, timeout=args.swarm_timeout)
        summaries = swarm.summaries()
    got = {(s.stage, s.rank): s.state_hash for s in summaries}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the peers run: more threads may order CPU sums differently
    if cuda:
        deterministic_cuda()
    try:
        sim = Simulator(cfg, data_batches(cfg), device=args.device)
        for _ in range(args.swarm_steps):
            sim.inner_step()
        sim.finish()
        expected = sim.replica_hashes()
    finally:
        torch.set_num_threads(threads)
    differ = [f"stage {s} replica {r}" for (s, r), h in sorted(got.items()) if h != expected[s][r]]
    ok = len(got) == 4 and not differ and all(s.steps == args.swarm_steps for s in summaries)
    return {
        "ok": ok,
        "summary": f"{len(got)} peers; differ from the simulator: {', '.join(differ) or 'none'}",
        "peer_hashes": {f"{s}/{r}": h for (s, r), h in sorted(got.items())},
        "simulator_hashes": expected,
        "differ": differ,
        "steps": args.swarm_steps,
        "val_loss": [s.val_loss for s in summaries if s.val_loss is not None],
    }


# ---------------------------------------------------------------------- 3. tokens/s


class PlainLM(nn.Module):
    """The stage's layers (copies) in a textbook forward: embed, decoder layers, norm, head."""

    def __init__(self, stage: Stage) -> None:
        super().__init__()
        assert stage.embed_tokens is not None and stage.norm is not None and stage.lm_head is not None
        self.embed, self.norm, self.head = (
            copy.deepcopy(m) for m in (stage.embed_tokens, stage.norm, stage.lm_head)
        )
        self.layers = copy.deepcopy(stage.layers)
        self.rotary = copy.deepcopy(stage.rotary_emb)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        rope = self.rotary(h, pos)
        for layer in self.layers.values():
            h = layer(h, position_embeddings=rope, position_ids=pos, attention_mask=None, is_causal=True)
        return self.head(self.norm(h))


def check_throughput(args: argparse.Namespace) -> Row:
    """One StageReplica holding the whole model against a plain loop over copies of its layers."""
    cfg = config(args.preset, 1, 1, args.seq_len, args.batch_size)
    dev, B, T = args.device, cfg.inner.batch_size, cfg.model.seq_len
    replica = StageReplica(cfg, 0, device=dev)
    plain = PlainLM(replica.module).to(dev)
    inner = cfg.inner
    opt = torch.optim.AdamW(
        plain.parameters(), lr=inner.lr, betas=inner.betas, weight_decay=inner.weight_decay
    )
    w = random_batch(cfg, dev)
    x, y = w[:, :-1], w[:, 1:]

    def stage_block() -> None:
        for step in range(args.bench_steps):
            replica.backward_losses(replica.module(x, y))
            replica.optimizer_step(replica.lr_at(step))

    def plain_block() -> None:
        for _ in range(args.bench_steps):
            with torch.autocast(dev, dtype=torch.bfloat16):
                logits = plain(x)
            F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), inner.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

    def timed(block) -> float:
        sync(dev)
        t0 = time.perf_counter()
        block()
        sync(dev)
        return args.bench_steps * B * T / (time.perf_counter() - t0)

    plain_block()  # warm-up both (kernel selection, allocator, AdamW state)
    stage_block()
    stage_tps, plain_tps = [], []
    for _ in range(args.rounds):
        plain_tps.append(timed(plain_block))
        stage_tps.append(timed(stage_block))
    ratios = [s / p for s, p in zip(stage_tps, plain_tps, strict=True)]
    ratio = statistics.median(stage_tps) / statistics.median(plain_tps)
    return {
        "ok": ratio >= args.min_ratio,
        "summary": f"stage {statistics.median(stage_tps):.0f} vs plain {statistics.median(plain_tps):.0f} "
        f"tokens/s: {ratio:.3f}x (goal >= {args.min_ratio})",
        "stage_tokens_per_second": stage_tps,
        "plain_tokens_per_second": plain_tps,
        "ratio_per_round": ratios,
        "ratio": ratio,
        "goal": args.min_ratio,
        "preset": args.preset,
        "tokens_per_step": B * T,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None,
    }


if __name__ == "__main__":
    sys.exit(main())
