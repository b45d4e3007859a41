"""How fast this peer's tensors reach its exchange partners, measured by them, and the exchange
cap that follows from it (`peer.exchange_max_mbit = auto`, the default).

An outer exchange sent at full speed fills the sender's link queue: the pipeline's rows wait
behind it, and so do the partner's acknowledgements. Capped at 93% of the link the queue stays
empty (docs/config.md), but a volunteer does not know their link's rate, and the rate that matters
is what the link carries to this partner now, rows included. So every exchange measures it:

- the receiver of an exchange's tensors times their arrival (`Arrivals`): the rate over all
  bytes after the first quarter, which skips a token bucket's burst, TCP's slow start and the
  time the sender waited for its own tensors;
- it says the rate in the frame it sends anyway (the callee's confirmation, the caller's receipt:
  peer/net/streams.py), so the sender hears it on the pacer it sent with (`Pacer.arrived`);
- `Uplink` keeps the last rate the link set, and caps the next exchanges at CAP_SHARE of it.

Several streams may share one pacer (a group of three, DiLoCo's shards): each gets about an equal
share of the pace and of the link, so a report is judged against the pace per stream, and the
link's rate is the streams' mean report times the streams. A report counts as the link's rate
only when it is well below the pace per stream (LINK_LIMITED): a paced send arrives at its pace,
which says only that the link carries at least that much. The first exchange goes uncapped, and so does one after
an estimate has capped KEEP_FOR of them: a cap never lets an exchange arrive faster than itself,
so a link that became faster (or a low report, from a partner with a slow downlink or a busy
receiver) is seen only by measuring again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

# Of the measured rate. The hand-set cap that keeps the link's queue empty is 93% of the link's
# nominal rate (docs/config.md); what a receiver measures is payload goodput, 0.91-0.96 of the
# nominal rate on the testbed, so the same cap is nearly all of it (docs/benchmarks.md).
CAP_SHARE = 0.97
LINK_LIMITED = 0.8  # a report below this share of our pace per stream was set by the link
KEEP_FOR = 8  # exchanges an estimate caps before the next goes uncapped and measures again
SKIP = 0.25  # share of a transfer's bytes left out of its rate (burst, slow start, waiting)
MIN_BYTES = 256 << 10  # smaller transfers are too short to time
MIN_SPAN = 0.02  # seconds: a rate needs the counted bytes to take at least this long
MIN_RATE = 1e4  # bytes/s (80 kbit/s): a report below this is not a link to cap an exchange for
MAX_RATE = 1e11  # bytes/s: a report above this is not a measurement (800 Gbit/s)


class Arrivals:
    """Times one transfer's bytes as they land; `rate()` is its arrival rate after the first
    SKIP of its bytes (0.0: too short to say)."""

    def __init__(self, total: int) -> None:
        self.total, self.bytes = total, 0
        self._mark: tuple[float, int] | None = None  # (time, bytes) once SKIP of them arrived
        self._last = 0.0

    def got(self, nbytes: int, now: float | None = None) -> None:
        """`nbytes` more arrived, `now` (time.monotonic(), unless given)."""
        now = time.monotonic() if now is None else now
        self.bytes += nbytes
        self._last = now
        if self._mark is None and self.bytes >= SKIP * self.total:
            self._mark = (now, self.bytes)

    def rate(self) -> float:
        if self._mark is None or self.total < MIN_BYTES or self.bytes < self.total:
            return 0.0
        start, counted = self._mark
        span = self._last - start
        return (self.bytes - counted) / span if span >= MIN_SPAN else 0.0


class Paced(Protocol):
    rate: float  # bytes/s we sent at (0: as fast as the link took it)
    arrived: list[float]  # bytes/s partners measured our tensors arriving at, one per stream
    most_writers: int  # streams that sent at this pace at once


class Uplink:
    """This peer's upload rate as its partners measured it (bytes/s; None: not known)."""

    def __init__(self) -> None:
        self.rate: float | None = None
        self.uses = 0  # exchanges the estimate has capped
        self._last: Paced | None = None  # the latest exchange's pacer, whose reports may still come

    def cap(self) -> float | None:
        """Bytes/s the next exchange goes out at at most (None: no cap, it measures); asked once
        per exchange."""
        self._digest()
        if self.rate is None or self.uses >= KEEP_FOR:
            self.rate, self.uses = None, 0
            return None
        self.uses += 1
        return CAP_SHARE * self.rate

    def track(self, pacer: Paced) -> None:
        """`pacer` sends the exchange that starts now; its partners' reports are read at the next."""
        self._digest()
        self._last = pacer

    def _digest(self) -> None:
        if self._last is not None:
            self.heard(self._last.rate, self._last.arrived, self._last.most_writers)
            self._last = None

    def heard(self, pace: float, arrived: Sequence[float], streams: int = 1) -> None:
        """Partners measured `arrived` (bytes/s) for tensors we sent at `pace` (0: unpaced) over
        `streams` streams at once."""
        reports = [r for r in arrived if MIN_RATE <= r < MAX_RATE]
        if not reports:
            return
        streams = max(1, streams)
        each = sum(reports) / len(reports)  # streams at once share the link about equally
        if not pace or each < LINK_LIMITED * pace / streams:  # the link set the rate, not our pace
            self.rate, self.uses = each * streams, 0
