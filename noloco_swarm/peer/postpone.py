"""A joiner whose download would outlast the round it announced moves its round further off.

A joiner of round J downloads the state its donors kept at the boundary before J while the swarm
trains round J-1 (peer/joining.py). A stage's state is GBs; on a home link that takes minutes, and
if it takes longer than a round the swarm reaches J with a member that cannot train yet, and
waits for it. So while it downloads, the joiner projects when the download ends (from the chunks
checked so far) and when the swarm reaches J (from its donors' steps, asked every CHECK_SECONDS).
If the download would end too late, it announces a later round J' at once, while the swarm is
still far enough from J that every member holds the new announcement by then (NOTICE_SECONDS):
the members admit it at J' instead, and its donors keep the same snapshot for it until then
(`Joining.keep_for_joiners`), so the download goes on undisturbed. The joiner then enters J' with
the state of the boundary before J: it missed the inner and outer steps between, as every
joiner on the early path misses one round's (docs/membership.md, "Joining"). It looks again at
every check, so a download that slows down moves the round again; never more than
MAX_LEAD_ROUNDS after the snapshot, which is as long as donors keep one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from noloco_swarm.peer import events

CHECK_SECONDS = 0.5  # how often a joiner asks its donors where they are while it downloads
MEASURE_SECONDS = 1.0  # of download and of the swarm's pace before a projection counts
NOTICE_SECONDS = 1.5  # the swarm must be this far from a round for a new announcement to reach it
LOAD_SHARE = 0.1  # time after the last chunk (loading, hashing, the view) as a share of the download
MAX_LEAD_ROUNDS = 8  # a joiner enters at most this many rounds after the snapshot it downloads


@dataclass(frozen=True)
class Pace:
    """A rate measured between two samples: (seconds, count) then and now."""

    first: tuple[float, int]
    last: tuple[float, int]

    def per_second(self) -> float | None:
        """Counts per second, or None before MEASURE_SECONDS with some progress."""
        seconds, count = self.last[0] - self.first[0], self.last[1] - self.first[1]
        if seconds < MEASURE_SECONDS or count <= 0:
            return None
        return count / seconds


@dataclass(frozen=True)
class Postponement:
    """Announce round `to`: the download ends in `download_seconds` (its load included), the
    swarm reaches the round announced in `swarm_seconds`."""

    to: int
    download_seconds: float
    swarm_seconds: float


def later_round(
    *,
    target: int,
    snapshot_round: int,
    inner_steps: int,
    chunks: Pace,
    total_chunks: int,
    steps: Pace,
) -> Postponement | None:
    """The round a joiner should announce instead of `target`, or None to keep it.

    `chunks` is the download's progress (chunks checked), `steps` the swarm's (its furthest
    step), both sampled on the same clock; `snapshot_round` is the round of the boundary whose
    state it downloads. None as well when either pace is not measured yet, when the download ends
    in time, or when the swarm is already closer to `target` than NOTICE_SECONDS (it would not
    hear of a new round in time)."""
    chunk_rate, step_rate = chunks.per_second(), steps.per_second()
    if chunk_rate is None or step_rate is None:
        return None
    now = max(chunks.last[0], steps.last[0])
    download = (total_chunks - chunks.last[1]) / chunk_rate
    ready = chunks.last[0] + download + LOAD_SHARE * (chunks.last[0] - chunks.first[0] + download)
    reaches = steps.last[0] + (target * inner_steps - steps.last[1]) / step_rate  # the swarm at target
    if ready <= reaches or reaches - now < NOTICE_SECONDS:
        return None
    more = math.ceil((ready - reaches) * step_rate / inner_steps)
    to = min(target + more, snapshot_round + MAX_LEAD_ROUNDS)
    return Postponement(to, ready - now, reaches - now) if to > target else None


@dataclass
class DownloadWatch:
    """What a joiner sees of its own download: the chunks checked, sampled as events arrive."""

    first: tuple[float, int] | None = None
    last: tuple[float, int] | None = None
    total: int = 0
    snapshot_round: int = -1
    chunks: set[int] = field(default_factory=set)

    def seen(self, event: events.Event) -> None:
        """Feed it the download's events (download_state's `emit`)."""
        if isinstance(event, events.StateFetch):
            self.snapshot_round = event.snapshot_round
        if not isinstance(event, events.ChunkFetched):
            return
        self.chunks.add(event.index)
        self.total = event.of
        sample = (time.monotonic(), len(self.chunks))
        if self.first is None:
            self.first = sample
        self.last = sample

    def pace(self) -> Pace | None:
        if self.first is None or self.last is None or len(self.chunks) >= self.total:
            return None
        return Pace(self.first, self.last)
