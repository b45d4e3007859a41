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
rate the pace may take is the slowest stream's report times the streams.

A cap never lets an exchange arrive faster than itself, so the estimate is also probed upward,
the way TCP probes for bandwidth:

- the first exchange goes uncapped, and both partners' tensors then cross the link at once, which
  measures it low (0.62-0.81 of a 100 Mbit/s link's rate on the testbed, docs/benchmarks.md). So
  an estimate from an unpaced send is probed at once, CLIMB above it;
- a probe whose tensors kept to its pace (KEPT_PACE of it per stream) raises the estimate to what
  it tried, and the next exchange probes again with twice the step;
- a report below KEPT_PACE of the pace was set by the link: its rate becomes the estimate, which
  caps HOLD exchanges before the next probe (PROBE above it);
- but a partner's overshoot (its own probe, its unpaced first exchange) fills the queue that our
  acknowledgements wait in, and the report then reads low (a probe at 102 Mbit/s on a 100 Mbit/s
  link read 82.7, where its unpaced exchange had read 95.7). Partners probe at the same exchanges,
  so a probe never lowers the estimate below the last measurement, and a capped exchange's low
  report is doubted once: two in a row are believed.

So a held estimate costs a link queue of a few percent of one exchange in HOLD + 2; one low
report (a busy receiver) is outgrown in a few probes, and a link that got faster is found the same
way; one that got slower costs two or three exchanges over it (reports are read an exchange late,
and the first low one is doubted).

An estimate that falls below half the best the link has shown (`best`) is recovered at once, not
after HOLD: the next exchanges probe at twice the estimate, up to `best`, until one is held back.
A slow partner sets the estimate of every stream it shares a pace with (the slowest stream's
report counts), so two exchanges with a partner behind a 300 ms delay spike cut the cap from 27
to 1.3 MB/s, and the climb back by HOLD and PROBE took 14 exchanges, 4 s each (the chaos test,
2026-12-06). Doubling back costs log2 of the fall (5 exchanges for that one); if the link really
got slower, the first probe is held back and the estimate (and `best`) stays at the new rate.

A partner whose reports stay low (a slow downlink, or a lie) holds the estimate down for as long
as it does, never below the pace that sends an exchange in half its deadline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

# Of the measured rate. The hand-set cap that keeps the link's queue empty is 93% of the link's
# nominal rate (docs/config.md); what a receiver measures is payload goodput, 0.91-0.96 of the
# nominal rate on the testbed, so the same cap is nearly all of it (docs/benchmarks.md).
CAP_SHARE = 0.97
KEPT_PACE = 0.97  # a report at or above this share of our pace per stream: the link kept up
HOLD = 8  # exchanges a trusted estimate caps before the next probes above it
PROBE = 0.03  # the first probe's step above a trusted estimate
CLIMB = 0.1  # the first probe's step above an estimate an unpaced send measured
MAX_STEP = 1.0  # probes that keep up double their step up to this
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
        self.measured = 0.0  # the last rate the link set, or a probe showed it carries (a floor for probes)
        self.doubt = False  # the last report read below the pace, and is not believed until another does
        self.step = 0.0  # how far above the estimate the next probe goes (0: none due)
        self.held = 0  # exchanges the estimate has capped since it was set or probed
        self.best = 0.0  # the highest rate the link set or carried for us
        self.recovering = False  # probing back up to `best` after a fall (doubling, from the next exchange)
        self._asked = 0.0  # the cap `cap()` last gave out, if it was a probe
        self._last: tuple[Paced, float] | None = None  # the latest exchange's pacer and probe

    def cap(self) -> float | None:
        """Bytes/s the next exchange goes out at at most (None: no cap, it measures); asked once
        per exchange."""
        self._digest()
        if self.rate is None:
            return None
        if self.held >= HOLD and not self.step:
            self.step = PROBE
        if self.step:
            target = self.rate * (1 + self.step)
            self._asked = CAP_SHARE * (min(target, self.best) if self.recovering else target)
            return self._asked
        self.held += 1
        return CAP_SHARE * self.rate

    def track(self, pacer: Paced) -> None:
        """`pacer` sends the exchange that starts now; its partners' reports are read at the next."""
        self._digest()
        self._last, self._asked = (pacer, self._asked), 0.0

    def _digest(self) -> None:
        if self._last is not None:
            (pacer, probe), self._last = self._last, None
            self.heard(pacer.rate, pacer.arrived, pacer.most_writers, probe)

    def heard(self, pace: float, arrived: Sequence[float], streams: int = 1, probe: float = 0.0) -> None:
        """Partners measured `arrived` (bytes/s) for tensors we sent at `pace` (0: unpaced) over
        `streams` streams at once; `probe` is the cap it tried above the estimate (0: none)."""
        reports = [r for r in arrived if MIN_RATE <= r < MAX_RATE]
        if not reports:
            return
        streams = max(1, streams)
        # Streams at once share the pace equally, so the slowest sets what the pace may be; and a
        # report that reads high (a liar) must not pass a probe, or lift the estimate, that the
        # other streams fell short of.
        link = streams * min(reports)
        held_back = link < KEPT_PACE * pace
        if not pace:  # the link set the rate, and both directions may have shared it: probe soon
            self.rate = self.measured = link
            self.step, self.held, self.doubt = CLIMB, 0, False
        elif held_back:  # the link held our pace back
            # A partner's overshoot (its own probe, its unpaced first exchange) fills the queue our
            # acknowledgements wait in, which reads low: a probe (partners probe at the same
            # exchanges) never lowers the estimate below the last measurement, and a capped
            # exchange's first low report is doubted; a second in a row is the link's rate.
            if self.rate is not None and not probe and not self.doubt:
                self.doubt = True
                return
            self.rate = self.measured = max(link, self.measured) if probe else link
            self.step, self.held, self.doubt = 0.0, 0, False
            if self.recovering:  # the link did get slower: what it carries now is the best
                self.best, self.recovering = self.rate, False
            elif self.rate < 0.5 * self.best:
                self.step, self.recovering = MAX_STEP, True
        elif probe and pace >= probe * (1 - 1e-9):  # the probe kept up (probes need an estimate)
            self.rate = probe / CAP_SHARE
            self.measured = max(self.measured, pace)  # the link carried that much: a floor for probes
            self.step, self.held, self.doubt = min(MAX_STEP, 2 * self.step), 0, False
            if self.recovering and self.rate >= self.best * (1 - 1e-9):
                self.step, self.recovering = 0.0, False  # back where it was: held, as a measurement
        else:  # kept to a pace at or below the cap: the link carries that much; a probe a slower
            self.doubt = False  # pace (the window's) hid is tried again
        self.best = max(self.best, self.rate or 0.0)
