"""The one typed config tree of a run: model, data, inner optimiser, outer step and topology.

Every front end fills this same tree: `noloco sim` and `noloco local` flags, config files and
`NOLOCO_*` environment variables (see `noloco_swarm.cli.options`). It is also the swarm manifest's
content: `RunConfig.flat()` is what peers compare before joining a run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from noloco_swarm.data.config import DataConfig
from noloco_swarm.model.presets import ModelConfig, get_preset
from noloco_swarm.protocol.config import InnerConfig, OuterConfig


@dataclass(frozen=True)
class RunConfig:
    """A whole run. Replicas of one stage share every field; peers of one run share the tree."""

    model: ModelConfig = field(default_factory=lambda: get_preset("tiny"))
    """Model shape (preset plus overrides); `vocab_size` must match the tokenizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer and window length; `data.seq_len` must equal `model.seq_len`."""
    inner: InnerConfig = field(default_factory=InnerConfig)
    """Inner optimiser and schedule."""
    outer: OuterConfig = field(default_factory=OuterConfig)
    """Outer step: method, H, group size, alpha, beta, gamma."""
    num_stages: int = 2
    """P: pipeline stages the model is split into."""
    num_replicas: int = 2
    """D: replicas of every stage (the simulator's N)."""
    seed: int = 0
    """Run seed: initial weights of every replica and the data order."""
    eval_every: int = 50
    """Inner steps between validation passes (0: only at the end)."""
    eval_windows: int = 64
    """Validation windows per evaluation (the same ones every time)."""

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.num_replicas < 1:
            raise ValueError(
                f"need at least one stage and one replica, got P={self.num_stages}, D={self.num_replicas}"
            )
        if self.num_stages > self.model.num_layers:
            raise ValueError(
                f"{self.num_stages} stages but the model has {self.model.num_layers} layers; lower --stages"
            )
        if self.data.seq_len != self.model.seq_len:
            raise ValueError(
                f"data.seq_len {self.data.seq_len} != model.seq_len {self.model.seq_len}; set them equal"
            )
        if self.eval_every < 0 or self.eval_windows < 1:
            raise ValueError("eval_every must be >= 0 and eval_windows >= 1")

    @classmethod
    def create(
        cls,
        preset: str = "tiny",
        method: str = "noloco",
        *,
        model: dict[str, Any] | None = None,
        data: dict[str, Any] | None = None,
        inner: dict[str, Any] | None = None,
        outer: dict[str, Any] | None = None,
        **top: Any,
    ) -> RunConfig:
        """A config from a preset and a method's paper defaults, with per-section overrides.

        The inner schedule defaults to the preset's (lr, min_lr, warm-up, total steps) and the
        data window to the model's sequence length, so one override changes both ends.
        """
        model_cfg = get_preset(preset, **(model or {}))
        inner_defaults = {
            "lr": model_cfg.lr,
            "min_lr": model_cfg.min_lr,
            "warmup_steps": model_cfg.warmup_steps,
            "total_steps": model_cfg.total_steps,
        }
        data_cfg = DataConfig(
            **{"seq_len": model_cfg.seq_len, "vocab_size": model_cfg.vocab_size, **(data or {})}
        )
        return cls(
            model=model_cfg,
            data=data_cfg,
            inner=InnerConfig(**{**inner_defaults, **(inner or {})}),
            outer=OuterConfig.for_method(method, **(outer or {})),
            **top,
        )

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def flat(self) -> dict[str, Any]:
        """Dotted key -> value for every leaf, in a stable order (the manifest and result files)."""
        out: dict[str, Any] = {}

        def walk(prefix: str, obj: Any) -> None:
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                if dataclasses.is_dataclass(value):
                    walk(f"{prefix}{f.name}.", value)
                else:
                    out[f"{prefix}{f.name}"] = list(value) if isinstance(value, tuple) else value

        walk("", self)
        return out
