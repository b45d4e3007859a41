"""Deadlines that follow the step and exchange times a peer observes, within configured bounds.

`peer.step_timeout` and `peer.exchange_timeout` are the longest a peer waits for one pipeline
step's rows (or their gradients) and for one outer exchange. Waiting that long for a peer that is
alive (it answers probes: a peer that does not is dropped within about 12 s) but stuck would hold
the swarm for two minutes per step by default. So once a few steps have shown what this swarm's
steps and exchanges take, the deadlines shrink to `peer.deadline_factor` times the longest of the
recent ones, but never below `peer.min_deadline` (nor above the configured bounds). A factor of 0
keeps the configured deadlines.
"""

from __future__ import annotations

import statistics
from collections import deque

from noloco_swarm.train.config import PeerConfig

WINDOW = 32  # recent steps the step deadline follows
EXCHANGE_WINDOW = 8  # recent outer exchanges the exchange deadline follows
WARMUP = 5  # steps (and 1 exchange) observed before a deadline adapts: the first ones dial peers


class Deadlines:
    """One peer's current step and exchange deadlines, in seconds."""

    def __init__(self, opts: PeerConfig) -> None:
        self.opts = opts
        self._steps: deque[float] = deque(maxlen=WINDOW)
        self._exchanges: deque[float] = deque(maxlen=EXCHANGE_WINDOW)

    def observe_step(self, seconds: float) -> None:
        self._steps.append(seconds)

    def observe_exchange(self, seconds: float) -> None:
        self._exchanges.append(seconds)

    @property
    def step(self) -> float:
        """Deadline of one step's rows, or of their gradients."""
        return self._adapt(self._steps, WARMUP, self.opts.step_timeout)

    @property
    def typical_step(self) -> float | None:
        """The median of the recent steps, in seconds; None until WARMUP steps were seen."""
        if len(self._steps) < WARMUP:
            return None
        return statistics.median(self._steps)

    @property
    def exchange(self) -> float:
        """Deadline of one outer exchange with one partner."""
        return self._adapt(self._exchanges, 1, self.opts.exchange_timeout)

    def _adapt(self, seen: deque[float], warmup: int, bound: float) -> float:
        if self.opts.deadline_factor == 0 or len(seen) < warmup:
            return bound
        return min(bound, max(self.opts.min_deadline, self.opts.deadline_factor * max(seen)))
