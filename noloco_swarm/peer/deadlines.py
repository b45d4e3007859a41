"""Deadlines that follow the step and exchange times a peer observes, within configured bounds.

`peer.step_timeout` and `peer.exchange_timeout` are the longest a peer waits for one pipeline
step's rows (or their gradients) and for one outer exchange. Waiting that long for a peer that is
alive (it answers probes: a peer that does not is dropped within about 12 s) but stuck would hold
the swarm for two minutes per step by default. So once a few steps have shown what this swarm's
steps and exchanges take, the deadlines shrink to `peer.deadline_factor` times the longest of the
recent ones, but never below `peer.min_deadline` (nor above the configured bounds). A factor of 0
keeps the configured deadlines.

A step in which a peer failed us (rows dropped or not sent, a peer slow or gone, a request
refused) is not a step time: it lasted as long as we waited on the failure. Learning from it
raised the deadline to its bound, and every later failure then cost that bound, which made the
next steps as long: after a 15 s freeze of one peer in a 4 x 3 swarm every step took the 20 s
bound until the views dropped the peer (2026-12-07). Those steps are not observed.
"""

from __future__ import annotations

import statistics
from collections import deque

from noloco_swarm.peer import events
from noloco_swarm.train.config import PeerConfig

WINDOW = 32  # recent steps the step deadline follows
EXCHANGE_WINDOW = 8  # recent outer exchanges the exchange deadline follows
WARMUP = 5  # steps (and 1 exchange) observed before a deadline adapts: the first ones dial peers
# What says a peer failed us during a step (see above).
FAILURES = (events.Dropped, events.Unsent, events.SlowPeer, events.PeerGone, events.Refused)


class Deadlines:
    """One peer's current step and exchange deadlines, in seconds; a sink of its events (it
    notes the failures)."""

    def __init__(self, opts: PeerConfig) -> None:
        self.opts = opts
        self._steps: deque[float] = deque(maxlen=WINDOW)
        self._exchanges: deque[float] = deque(maxlen=EXCHANGE_WINDOW)
        self._failed = False  # a failure was seen since the last step observed

    def emit(self, event: events.Event) -> None:
        if isinstance(event, FAILURES):
            self._failed = True

    def close(self) -> None:
        pass

    def observe_step(self, seconds: float) -> None:
        """A step took `seconds`: a step time, unless a peer failed us since the last one."""
        if not self._failed:
            self._steps.append(seconds)
        self._failed = False

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
