"""The step clock: sample counter, inner step, outer round and phase as pure functions of counters.

Peers agree on routes and groups without talking because every decision is a function of these
counters. Round r covers inner steps [r*H, (r+1)*H); after the H-th inner step of round r the
replica takes its outer step with the group drawn for step t = (r+1)*H (gossip.make_groups), and
round r+1 begins. Membership is frozen per round, so a peer that joins waits for a round start.

All phase transitions live here; nothing reads a wall clock.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Phase(enum.Enum):
    """Where a replica stands within an outer round."""

    INNER = "inner"  # taking inner steps of the current round
    OUTER = "outer"  # all H inner steps done; the outer step of the round is due
    DONE = "done"  # the run's total number of inner steps has been taken


@dataclass(frozen=True)
class Position:
    """A replica's position on the clock, derived from its two counters."""

    step: int  # inner steps taken so far (the official code's counter after the increment)
    round: int  # the outer round the next inner step belongs to, or the round whose outer step is due
    inner: int  # inner steps taken within `round`
    phase: Phase


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

    def first_sample(self, step: int) -> int:
        """Global counter of the first sample of inner step `step` (k = t*B)."""
        _non_negative("step", step)
        return step * self.batch_size

    def samples_per_round(self, num_replicas: int) -> int:
        """Samples all stage-0 replicas consume together in one round."""
        return self.inner_steps * self.batch_size * num_replicas

    def next_join_round(self, steps_taken: int) -> int:
        """The round a peer joins at when the swarm has taken `steps_taken` inner steps."""
        _non_negative("steps_taken", steps_taken)
        return math.ceil(steps_taken / self.inner_steps)

    def position(self, steps_taken: int, outer_steps_taken: int) -> Position:
        """Phase of a replica that has taken `steps_taken` inner and `outer_steps_taken` outer steps."""
        _non_negative("steps_taken", steps_taken)
        _non_negative("outer_steps_taken", outer_steps_taken)
        closed_rounds = steps_taken // self.inner_steps
        if outer_steps_taken > closed_rounds:
            raise ValueError(
                f"{outer_steps_taken} outer steps after only {steps_taken} inner steps "
                f"(H={self.inner_steps}) is not a reachable state"
            )
        if outer_steps_taken < closed_rounds - 1 or (
            outer_steps_taken == closed_rounds - 1 and steps_taken % self.inner_steps
        ):
            raise ValueError(f"outer step of round {outer_steps_taken} was skipped at step {steps_taken}")
        if outer_steps_taken < closed_rounds:
            return Position(steps_taken, closed_rounds - 1, self.inner_steps, Phase.OUTER)
        if self.total_steps is not None and steps_taken >= self.total_steps:
            return Position(steps_taken, closed_rounds, steps_taken % self.inner_steps, Phase.DONE)
        return Position(steps_taken, closed_rounds, steps_taken % self.inner_steps, Phase.INNER)


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
