"""Typed, frozen settings of the algorithm: the outer step, the inner optimiser, the wire format.

These are the parts of the config tree that the protocol core owns. Defaults follow the official
code's NoLoCo configs (`*_mean_*`: H = 50, group size 2, outer lr 0.7, outer momentum 0.5) and its
DiLoCo configs (H = 100, outer lr 0.7, momentum 0.3).

DiLoCo has two named variants (`outer.diloco_variant`), and neither is a mix of the two:

* `heavyball` (the default): the NoLoCo paper's baseline as the official code runs it,
  `delta = 0.3*delta - 0.7*g; phi = phi + delta` (written there as Nesterov, heavy-ball in fact);
* `nesterov`: the DiLoCo paper's outer optimiser, `torch.optim.SGD(lr=0.7, momentum=0.9,
  nesterov=True)` on the outer gradient g.

Each variant brings its own momentum default; `outer.outer_momentum` still overrides it. (Before
the variants existed, `diloco` meant torch's Nesterov step with momentum 0.3; that is
`diloco_variant=nesterov, outer_momentum=0.3`, a mix of the two papers kept only for comparison.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from noloco_swarm.protocol import plausible
from noloco_swarm.protocol.plan import check_microbatch_sizes
from noloco_swarm.protocol.wire import ACTIVATION_FORMATS, WireFormat

Method = Literal["noloco", "diloco", "allreduce", "local"]
METHODS: tuple[str, ...] = ("noloco", "diloco", "allreduce", "local")
DilocoVariant = Literal["heavyball", "nesterov"]
# Each DiLoCo variant's outer momentum: the official code's DiLoCo configs, the DiLoCo paper's.
DILOCO_MOMENTUM: dict[str, float] = {"heavyball": 0.3, "nesterov": 0.9}


@dataclass(frozen=True)
class OuterConfig:
    """How replicas of a stage combine their progress."""

    method: Method = "noloco"
    """noloco: pairwise groups; diloco: all replicas; allreduce: gradients every step; local: none."""
    inner_steps: int = 50
    """H: inner steps between outer steps (50 for NoLoCo, 100 for DiLoCo)."""
    group_size: int = 2
    """n: replicas per NoLoCo group; when n does not divide the replica count D, the D % n left over
    join groups one each (D < n: one group of all; protocol/gossip.py)."""
    outer_momentum: float = 0.5
    """alpha: outer momentum (0.5 NoLoCo, 0.3 DiLoCo)."""
    outer_lr: float = 0.7
    """beta: outer learning rate."""
    gamma: float | None = None
    """Local-averaging coefficient; None ties it to outer_lr (the official code), so only theta travels."""
    diloco_variant: DilocoVariant = "heavyball"
    """DiLoCo only: heavyball (the NoLoCo paper's baseline as the official code runs it, momentum 0.3)
    or nesterov (the DiLoCo paper's Nesterov SGD, momentum 0.9); each sets outer_momentum's default."""
    seeded_groups: bool = False
    """NoLoCo only: draw groups from (run seed, step) instead of the step alone. Off, every seed sees
    the same partner sequence (bit-compatible with the official code); on, for variance studies."""
    random_routing: bool = True
    """Per-sample random routes between stages; False keeps each replica's own chain (ablation)."""
    overlap_steps: int = 0
    """k: inner steps the outer exchange overlaps (0: it blocks at the boundary, as in the paper). The
    step is applied k steps later to the boundary's snapshot, keeping the progress since
    (protocol/outer.py `carry_over`); needs k < H."""
    plausible_factor: float = plausible.DEFAULT_FACTOR
    """A received theta is averaged in only if its distance to our phi is at most factor x (our own
    progress + drift) + plausible_floor x ||phi||, else its sender is left out of the step
    (protocol/plausible.py). Raise it, never lower it, if a healthy run reports `rejected` events."""
    plausible_floor: float = plausible.DEFAULT_FLOOR
    """The floor of that bound, as a fraction of ||phi|| (docs/config.md)."""
    avoid_rounds: int = 3
    """Outer steps after a rejected one at which that member is avoided: not called, its calls
    refused at once; both sides step without each other. 0: judge every exchange afresh."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.diloco_variant not in DILOCO_MOMENTUM:
            raise ValueError(
                f"diloco_variant must be one of {tuple(DILOCO_MOMENTUM)}, got {self.diloco_variant!r}"
            )
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps (H) must be >= 1, got {self.inner_steps}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum (alpha) must be in [0, 1), got {self.outer_momentum}")
        if self.outer_lr <= 0.0:
            raise ValueError(f"outer_lr (beta) must be > 0, got {self.outer_lr}")
        if self.gamma is not None and self.gamma < 0.0:
            raise ValueError(f"gamma must be >= 0 or unset, got {self.gamma}")
        if self.overlap_steps < 0:
            raise ValueError(f"overlap_steps (k) must be >= 0, got {self.overlap_steps}")
        if self.overlap_steps and self.method not in ("noloco", "diloco"):
            raise ValueError(
                f"overlap_steps (k) overlaps an outer exchange, which {self.method} does not have: "
                "set it to 0 or use noloco or diloco"
            )
        if not self.plausible_factor > 0 or not self.plausible_floor >= 0:
            raise ValueError(
                f"plausible_factor must be > 0 and plausible_floor >= 0, got {self.plausible_factor} "
                f"and {self.plausible_floor}: raise them to accept more, never disable the check"
            )
        if self.avoid_rounds < 0:
            raise ValueError(f"avoid_rounds must be >= 0, got {self.avoid_rounds}")
        if self.overlap_steps >= self.inner_steps:
            raise ValueError(
                f"overlap_steps (k = {self.overlap_steps}) must be below inner_steps (H = "
                f"{self.inner_steps}): an exchange must finish before the next boundary; lower k or raise H"
            )

    @property
    def effective_gamma(self) -> float:
        return self.outer_lr if self.gamma is None else self.gamma

    @property
    def sends_phi(self) -> bool:
        """True when partners must exchange slow weights too (gamma differs from beta)."""
        return self.effective_gamma != self.outer_lr

    @classmethod
    def for_method(cls, method: str, **overrides: object) -> OuterConfig:
        """The paper's defaults for a method, with overrides (DiLoCo's momentum follows its variant)."""
        variant = str(overrides.get("diloco_variant", "heavyball"))
        defaults: dict[str, object] = {
            "noloco": {"inner_steps": 50, "outer_momentum": 0.5, "outer_lr": 0.7},
            "diloco": {
                "inner_steps": 100,
                "outer_momentum": DILOCO_MOMENTUM.get(variant, 0.3),
                "outer_lr": 0.7,
            },
            "allreduce": {"inner_steps": 1},
            "local": {"inner_steps": 50},
        }.get(method, {})  # an unknown method falls through to __post_init__'s error
        return dataclasses.replace(cls(), method=method, **{**defaults, **overrides})  # type: ignore[arg-type]


@dataclass(frozen=True)
class InnerConfig:
    """The inner optimiser (AdamW) and its schedule; moments stay local to each replica."""

    batch_size: int = 8
    """B: samples per replica per inner step."""
    lr: float = 6e-4
    """Peak learning rate after warm-up."""
    min_lr: float = 6e-5
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 1000
    """Linear warm-up steps."""
    total_steps: int = 25_000
    """Inner steps of the whole run (the cosine reaches min_lr here)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (the official code uses none)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Per-stage gradient-norm clip (official: 1.0); 0 disables clipping."""
    microbatches: int = 1
    """M: the batch crosses the pipeline as M microbatches, each sent on as soon as it is computed;
    gradients accumulate and the optimizer steps once per inner step."""
    microbatch_sizes: tuple[int, ...] = ()
    """The M microbatches' sizes in batch order, summing to B (e.g. 2,6,6,2; empty: B/M each).
    Small first and last ones shorten a step's two waits on the link, with the same update."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.lr > 0.0 or not 0.0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(
                f"warmup_steps >= 0 and total_steps >= 1 please, got {self.warmup_steps}, {self.total_steps}"
            )
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("weight_decay and grad_clip must be >= 0")
        if self.microbatch_sizes:
            try:
                check_microbatch_sizes(self.microbatch_sizes, self.microbatches, self.batch_size)
            except ValueError as e:
                raise ValueError(f"inner.microbatch_sizes: {e}") from None
        elif self.microbatches < 1 or self.batch_size % self.microbatches:
            raise ValueError(
                f"inner.microbatches must divide inner.batch_size, got {self.microbatches} and {self.batch_size}"
            )
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be in [0, 1), got {self.betas}")


@dataclass(frozen=True)
class WireConfig:
    """How activations and their gradients cross between pipeline stages (protocol/wire.py).

    Part of the run, like the optimiser: every peer of a run sends and expects the same format, and
    the simulator applies the same round trip, so a swarm still ends with the simulator's weights.
    Outer-step tensors always cross in full precision, whatever this says.
    """

    activations: WireFormat = "fp32"
    """fp32 (exact), bf16 (half the bytes), int8 (a quarter, plus a scale per row) or subspace (k bf16
    numbers and an int32 token id per token; needs model.subspace_rank = k). Gradients come back in
    the same format, and `noloco join` defaults to bf16, the rest to fp32 (docs/config.md)."""

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATION_FORMATS:
            raise ValueError(
                f"wire.activations must be one of {', '.join(ACTIVATION_FORMATS)}, got {self.activations!r}"
            )
