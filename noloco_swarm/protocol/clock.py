"""The step clock: inner step, outer round and the learning-rate schedule as pure functions.

Peers agree on routes and groups without talking because every decision is a function of these
counters. Round r covers inner steps [r*H, (r+1)*H); after the H-th inner step of round r the
replica takes its outer step with the group drawn for step t = (r+1)*H (protocol.plan), and
round r+1 begins. Membership is frozen per round, so a peer that joins waits for a round start.
Nothing here reads a wall clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StepClock:
    """The shared clock of a run: H inner steps per outer round, B samples per replica per step."""

    inner_steps: int  # H
    batch_size: int  # B, samples per replica per inner step
    total_steps: int | None = None  # the run ends after this many inner steps (None: open-ended)

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps (H) must be >= 1, got {self.inner_steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.total_steps is not None and self.total_steps < 0:
            raise ValueError(f"total_steps must be >= 0 or None, got {self.total_steps}")

    def round_of(self, step: int) -> int:
        """The round that inner step number `step` (0-based, before it is taken) belongs to."""
        _non_negative("step", step)
        return step // self.inner_steps

    def round_start(self, round_: int) -> int:
        """The first inner step of round `round_`."""
        _non_negative("round", round_)
        return round_ * self.inner_steps

    def outer_step_due(self, steps_taken: int) -> bool:
        """True when `steps_taken` closes a round, i.e. an outer step follows it."""
        _non_negative("steps_taken", steps_taken)
        return steps_taken > 0 and steps_taken % self.inner_steps == 0


def lr_at(step: int, *, base_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up from 0 to base_lr, then cosine decay to min_lr at total_steps (then flat).

    `step` is the 0-based inner step about to be taken; the official schedule warms up over 1000
    steps and decays over the run's 25,000.
    """
    _non_negative("step", step)
    if warmup_steps < 0 or total_steps < 1 or min_lr > base_lr:
        raise ValueError(
            f"bad schedule: warmup={warmup_steps}, total={total_steps}, min_lr={min_lr} > base_lr={base_lr}?"
        )
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def _non_negative(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
