"""Run the simulator on real data: wire the data streams, evaluate on a schedule, collect results."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from noloco_swarm.data.stream import TokenStream, embedded_stream, train_batches, validation_windows
from noloco_swarm.data.tokenizer import load_tokenizer
from noloco_swarm.sim.engine import BatchFn, Simulator, StepStats
from noloco_swarm.train.config import RunConfig


@dataclass
class SimResult:
    """Everything a simulator run reports: per-eval metrics, final hashes, throughput."""

    config: dict[str, Any]
    evals: list[dict[str, float]] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)
    replica_hashes: list[list[str]] = field(default_factory=list)
    state_hash: str = ""
    train_seconds: float = 0.0
    tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.train_seconds if self.train_seconds else 0.0

    @property
    def final(self) -> dict[str, float]:
        return self.evals[-1] if self.evals else {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "evals": self.evals,
            "train_losses": self.train_losses,
            "replica_hashes": self.replica_hashes,
            "state_hash": self.state_hash,
            "train_seconds": self.train_seconds,
            "tokens": self.tokens,
            "tokens_per_second": self.tokens_per_second,
        }


def check_vocab(cfg: RunConfig, cache_dir: str | os.PathLike[str] | None = None) -> None:
    """The model's vocabulary must match the tokenizer's, or token ids would index past the embedding."""
    vocab = load_tokenizer(cfg.data, cache_dir).vocab_size
    if vocab != cfg.model.vocab_size:
        raise ValueError(
            f"the tokenizer has {vocab} tokens but model.vocab_size is {cfg.model.vocab_size}; "
            f"set model.vocab_size={vocab}"
        )


def data_batches(cfg: RunConfig, cache_dir: str | os.PathLike[str] | None = None) -> BatchFn:
    """Training windows for every stage-0 replica: replica d reads shard d of D, indexed by step."""
    D, B = cfg.replica_counts[0], cfg.inner.batch_size
    if cfg.data.source == "embedded":
        streams: list[TokenStream] = [
            embedded_stream(cfg.data, d, D, B, cfg.seed, cache_dir) for d in range(D)
        ]
        return lambda d, step: streams[d].batch(step)
    # A streaming dataset cannot seek: read each shard forward and insist on sequential steps.
    iters = [train_batches(cfg.data, d, D, B, cfg.seed, 0, cache_dir) for d in range(D)]
    position = [0] * D

    def sequential(d: int, step: int) -> torch.Tensor:
        if step != position[d]:
            raise ValueError(f"streaming data is read in order: asked for step {step}, at {position[d]}")
        position[d] += 1
        return next(iters[d])

    return sequential


def run_simulation(
    cfg: RunConfig,
    steps: int,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    on_step: Callable[[Simulator, StepStats], None] | None = None,
    on_eval: Callable[[Simulator, dict[str, float]], None] | None = None,
) -> SimResult:
    """Train for `steps` inner steps, evaluating every `cfg.eval_every` steps and at the end."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    check_vocab(cfg, cache_dir)
    windows = validation_windows(cfg.data, cache_dir)[: cfg.eval_windows]
    sim = Simulator(cfg, data_batches(cfg, cache_dir))
    result = SimResult(config=cfg.manifest())
    start = time.perf_counter()
    eval_seconds = 0.0

    def evaluate() -> None:
        nonlocal eval_seconds
        t0 = time.perf_counter()
        metrics = sim.evaluate(windows)
        eval_seconds += time.perf_counter() - t0
        row = {
            "step": sim.step,
            "tokens": sim.tokens,
            "lr": last_lr,
            "train_loss": sum(result.train_losses[-10:]) / max(1, len(result.train_losses[-10:])),
            "weight_spread": sim.weight_spread(),
            "spread_before_outer": sim.spread_before_outer,
            "wall_seconds": time.perf_counter() - start - eval_seconds,
            **metrics,
        }
        result.evals.append(row)
        if on_eval:
            on_eval(sim, row)

    last_lr = 0.0
    for _ in range(steps):
        stats = sim.inner_step()
        last_lr = stats.lr
        result.train_losses.append(stats.loss)
        if on_step:
            on_step(sim, stats)
        if cfg.eval_every and sim.step % cfg.eval_every == 0 and sim.step != steps:
            evaluate()
    sim.finish()  # an overlapped outer step still under way: the run ends with it applied
    evaluate()
    result.train_seconds = time.perf_counter() - start - eval_seconds
    result.tokens = sim.tokens
    result.replica_hashes = sim.replica_hashes()
    result.state_hash = sim.state_hash()
    return result
