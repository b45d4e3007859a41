"""Model shapes and training defaults: the frozen `ModelConfig` and the named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# Attention backends under which `Stage` guarantees causality (see stage.py). Others
# (flash, flex) take their causality from flags we have not tested, so they are refused.
ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("eager", "sdpa")

# The Llama-3 tokenizer the paper used has 128,000 tokens plus 2 added special tokens.
LLAMA3_VOCAB: int = 128_002


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (its inner schedule's defaults: `SCHEDULES`)."""

    name: str
    """Preset name, carried into the swarm manifest and logs."""
    vocab_size: int
    """Rows of the input embedding and of the LM head; set from the tokenizer with `with_vocab`."""
    hidden_size: int
    """Width of the residual stream; must be divisible by `num_heads`."""
    intermediate_size: int
    """Width of the SwiGLU feed-forward block."""
    num_heads: int
    """Attention heads; keys and values use as many (no grouped-query attention, as in the paper)."""
    num_layers: int
    """Decoder layers in the whole model, before it is split into pipeline stages."""
    seq_len: int
    """Tokens per training sample (the model input; the sample on disk is one token longer)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 1e4
    """Base of the rotary position embedding."""
    init_std: float = 0.02
    """Std of the normal init of every linear and embedding weight (RMSNorm weights start at one)."""
    attn_implementation: str = "sdpa"
    """Attention backend, "sdpa" or "eager"; both are made causal by the stage (see stage.py)."""
    autocast_bf16: bool = False
    """Run forward matmuls in bf16 under `torch.autocast`; weights, grads and loss stay fp32."""
    subspace_rank: int = 0
    """k > 0 keeps every write into the residual stream before the last stage in a fixed rank-k
    subspace from the run seed (model/subspace.py), so boundaries may send k numbers per token; 0: off."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ModelConfig.name is empty; give the config a name (e.g. 'tiny').")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_layers", "seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{field} must be a positive integer, got {value!r}.")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                "change one of them so that each head gets a whole number of channels."
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"head dimension hidden_size/num_heads = {self.hidden_size // self.num_heads} is odd; "
                "rotary embeddings rotate channel pairs, so choose sizes that give an even head dimension."
            )
        for field in ("rms_norm_eps", "rope_theta", "init_std"):
            if not getattr(self, field) > 0:
                raise ValueError(f"ModelConfig.{field} must be > 0, got {getattr(self, field)!r}.")
        if not isinstance(self.subspace_rank, int) or not 0 <= self.subspace_rank <= self.hidden_size:
            raise ValueError(
                f"subspace_rank must be an integer within 0..hidden_size ({self.hidden_size}), got "
                f"{self.subspace_rank!r}: 0 turns the subspace off, k keeps k of the residual's directions"
            )
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation {self.attn_implementation!r} is not supported; "
                f"use one of {', '.join(ATTN_IMPLEMENTATIONS)}."
            )

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.hidden_size // self.num_heads

    def with_vocab(self, vocab_size: int) -> ModelConfig:
        """The same config with the vocabulary size of the tokenizer actually used."""
        return dataclasses.replace(self, vocab_size=vocab_size)


# Shapes of the paper's runs (the official code's configs); `tiny` is ours, sized to
# train on two CPU cores: about 2 M parameters, and a short schedule to match. `mini` (about 8 M)
# is wide enough (256) that subspace ranks of 16-64 keep a real fraction of the residual.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny",
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=512,
        num_heads=4,
        num_layers=4,
        seq_len=128,
    ),
    "mini": ModelConfig(
        name="mini",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=1024,
        num_heads=4,
        num_layers=6,
        seq_len=128,
    ),
    "small": ModelConfig(
        name="small",
        vocab_size=LLAMA3_VOCAB,
        hidden_size=768,
        intermediate_size=3072,
        num_heads=12,
        num_layers=12,
        seq_len=1024,
    ),
    "medium": ModelConfig(
        name="medium",
        vocab_size=LLAMA3_VOCAB,
        hidden_size=2048,
        intermediate_size=8192,
        num_heads=32,
        num_layers=24,
        seq_len=1024,
    ),
    "large": ModelConfig(
        name="large",
        vocab_size=LLAMA3_VOCAB,
        hidden_size=4096,
        intermediate_size=16384,
        num_heads=32,
        num_layers=32,
        seq_len=1024,
    ),
}


# Each preset's inner schedule (`inner.lr`, `inner.min_lr`, `inner.warmup_steps`,
# `inner.total_steps` default to it): the paper's peak rates for its shapes, with 1,000 warm-up
# steps of 25,000; tiny's short run to match its size.
SCHEDULES: dict[str, dict[str, float | int]] = {
    "tiny": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 100, "total_steps": 2000},
    "mini": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 100, "total_steps": 2000},
    "small": {"lr": 6e-4, "min_lr": 6e-5, "warmup_steps": 1000, "total_steps": 25_000},
    "medium": {"lr": 2e-4, "min_lr": 2e-5, "warmup_steps": 1000, "total_steps": 25_000},
    "large": {"lr": 1.2e-4, "min_lr": 1.2e-5, "warmup_steps": 1000, "total_steps": 25_000},
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The preset called `name`, with any field replaced by `overrides` (validated again)."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}.") from None
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {unknown}; valid fields are {sorted(fields)}.")
    return dataclasses.replace(base, **overrides)


def layer_parameters(cfg: ModelConfig, constrained: bool = False) -> int:
    """Parameters of one decoder layer: q/k/v/o projections, SwiGLU MLP, two RMSNorms; no biases.

    `constrained`: the layer writes into the rank-k subspace, so its output and down projections
    train k rows each (W = U A, model/subspace.py)."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    out = cfg.subspace_rank if constrained and cfg.subspace_rank else h
    return 3 * h * h + out * h + 2 * h * f + out * f + 2 * h


def count_stage_parameters(cfg: ModelConfig, layers: range, first: bool, last: bool) -> int:
    """Parameters of a stage holding `layers`, plus the embedding if `first`, norm and head if `last`.

    With `subspace_rank` k, a stage other than the last trains k columns of its embedding and of its
    layers' writes into the residual (model/subspace.py); the last stage is unconstrained."""
    constrained = bool(cfg.subspace_rank) and not last
    total = len(layers) * layer_parameters(cfg, constrained)
    if first:
        total += cfg.vocab_size * (cfg.subspace_rank if constrained else cfg.hidden_size)
    if last:
        # Final RMSNorm, then the untied LM head.
        total += cfg.hidden_size + cfg.vocab_size * cfg.hidden_size
    return total


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the whole model, computed from the shapes alone (nothing is built)."""
    return count_stage_parameters(cfg, range(cfg.num_layers), first=True, last=True)
