"""Paced writes (streams.Pacer): the same frame, in small parts, each when the pace allows; and
the outer exchange's pace (peer.exchange_pacing) spreads its bytes over the overlap window, and
peer.exchange_max_mbit caps it: by default at 93% of the rate partners timed our last exchange
arriving at (peer/net/uplink.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from types import SimpleNamespace

import pytest
import torch

from noloco_swarm.peer.deadlines import WARMUP, Deadlines
from noloco_swarm.peer.exchange.runner import OuterExchange
from noloco_swarm.peer.net import streams
from noloco_swarm.peer.net.streams import Pacer
from noloco_swarm.peer.net.uplink import CAP_SHARE, CLIMB, HOLD, PROBE, Arrivals, Uplink
from noloco_swarm.protocol.codec import TensorMeta, encode
from noloco_swarm.protocol.plan import outer_plan
from noloco_swarm.protocol.rpc import REPLY_VERB, Ack, Envelope
from noloco_swarm.train.config import PeerConfig
from noloco_swarm.train.layering import build_config
from tests.fuzz.frames import _Writer


class RecordingPacer(streams.Pacer):
    """A pacer that lets every write through at once and records what it was asked for."""

    def __init__(self) -> None:
        super().__init__(1.0)
        self.asked: list[int] = []

    async def wait(self, nbytes: int) -> None:
        self.asked.append(nbytes)


def frame(pace: streams.Pacer | None, part_bytes: int = 1 << 20) -> bytes:
    tensors = streams.prepare([torch.arange(300_000, dtype=torch.float32), torch.ones(7)])
    envelope = Envelope(REPLY_VERB, encode(Ack()), tuple(TensorMeta.of(t) for t in tensors))
    writer = _Writer()
    asyncio.run(streams.write_frame(writer, envelope, tensors, part_bytes, streams.ByteCounts(), pace))  # type: ignore[arg-type]
    return bytes(writer.data)


def test_a_paced_frame_is_the_same_bytes_in_small_parts_each_asked_of_the_pace() -> None:
    pacer = RecordingPacer()
    assert frame(pacer) == frame(None)
    assert sum(pacer.asked) == 300_000 * 4 + 7 * 4  # every tensor byte, and only those
    assert max(pacer.asked) == streams.PACED_PART  # parts of 1 MiB are cut down to 64 KiB
    assert frame(RecordingPacer(), part_bytes=64 << 10) == frame(None)


def test_a_pacer_books_its_rate_across_writers() -> None:
    """Writers sharing a pacer queue behind each other: each write starts when the bytes booked
    before it have had their time (the pacer's own schedule, not a measured duration)."""
    pacer = streams.Pacer(1e6)  # 1 MB/s

    async def main() -> tuple[float, float]:
        start = time.monotonic()
        await asyncio.gather(pacer.wait(1000), pacer.wait(1000), pacer.wait(1000))
        return start, pacer._free_at

    start, free_at = asyncio.run(main())
    assert free_at >= start + 0.003  # three 1 ms slots, booked one after the other


@pytest.mark.parametrize("rate", [-1.0, float("inf"), float("nan")])
def test_a_pace_must_be_a_finite_rate(rate: float) -> None:
    with pytest.raises(ValueError, match="pace"):
        streams.Pacer(rate)


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_exchange_pacing_is_a_share_of_the_overlap_window(share: float) -> None:
    with pytest.raises(ValueError, match="exchange_pacing"):
        PeerConfig(exchange_pacing=share)


@pytest.mark.parametrize("mbit", [-1.0, float("inf"), float("nan")])
def test_exchange_max_mbit_is_a_finite_rate(mbit: float) -> None:
    with pytest.raises(ValueError, match="exchange_max_mbit"):
        PeerConfig(exchange_max_mbit=mbit)


def exchange(
    share: float,
    overlap: int,
    *,
    steps_seen: int,
    paced: bool = True,
    deadline: float = 120.0,
    max_mbit: float | None = 0.0,
    uplink: Uplink | None = None,
) -> OuterExchange:
    """An OuterExchange of a 2-replica NoLoCo stage, whose peer has seen `steps_seen` steps of 0.4 s
    and no exchange yet (its exchange deadline is `deadline`, its cap `max_mbit`, None: auto, from
    what `uplink` heard)."""
    cfg = build_config(
        "tiny",
        "noloco",
        assignments={"num_replicas": "2", "outer.inner_steps": "10", "outer.overlap_steps": str(overlap)},
        env={},
    )
    cfg = dataclasses.replace(
        cfg,
        peer=dataclasses.replace(
            cfg.peer, exchange_pacing=share, exchange_timeout=deadline, exchange_max_mbit=max_mbit
        ),
    )
    deadlines = Deadlines(cfg.peer)
    for _ in range(steps_seen):
        deadlines.observe_step(0.4)
    view = SimpleNamespace(peer_at=lambda stage, rank: f"peer-{rank}")
    ctx = SimpleNamespace(cfg=cfg, stage=0, deadlines=deadlines, rounds=SimpleNamespace(at=lambda r: view))
    plan = outer_plan("noloco", 2, 2, 10, 0, cfg.group_draw_seed)
    assert plan is not None
    board = SimpleNamespace(uplink=uplink or Uplink())
    return OuterExchange(ctx, board, plan, 0, paced=paced)  # type: ignore[arg-type]


def test_the_exchange_pace_spreads_our_bytes_over_the_share_of_the_window() -> None:
    theta = torch.zeros(1000)
    pacer = exchange(0.5, 5, steps_seen=WARMUP).pacer(theta)
    # 4000 bytes of theta to one partner over half of 5 steps of 0.4 s: 4000 / 1.0 s
    assert pacer.rate == pytest.approx(4000 / (0.5 * 5 * 0.4))


def test_a_paced_exchange_keeps_within_half_its_deadline() -> None:
    """Spread over 1.0 x 5 steps x 0.4 s = 2 s, but the exchange's deadline is 3 s: 1.5 s."""
    pacer = exchange(1.0, 5, steps_seen=WARMUP, deadline=3.0).pacer(torch.zeros(1000))
    assert pacer.rate == pytest.approx(4000 / 1.5)


@pytest.mark.parametrize(
    ("share", "overlap", "steps_seen", "paced"),
    [(0.0, 5, WARMUP, True), (0.5, 0, WARMUP, True), (0.5, 5, WARMUP - 1, True), (0.5, 5, WARMUP, False)],
)
def test_no_pace_when_off_blocking_unmeasured_or_due_at_the_runs_end(
    share: float, overlap: int, steps_seen: int, paced: bool
) -> None:
    assert exchange(share, overlap, steps_seen=steps_seen, paced=paced).pacer(torch.zeros(1000)).rate == 0


@pytest.mark.parametrize(
    ("overlap", "steps_seen", "paced"), [(0, 0, False), (5, 0, True), (5, WARMUP, False)]
)
def test_the_cap_paces_every_exchange(overlap: int, steps_seen: int, paced: bool) -> None:
    """Blocking, before any step is seen, or due at the run's end: the cap still holds."""
    pacer = exchange(0.5, overlap, steps_seen=steps_seen, paced=paced, max_mbit=8.0).pacer(torch.zeros(1000))
    assert pacer.rate == 1e6  # 8 Mbit/s in bytes/s


@pytest.mark.parametrize(("max_mbit", "rate"), [(0.016, 2000.0), (0.8, 4000 / (0.5 * 5 * 0.4))])
def test_the_slower_of_cap_and_window_pace_wins(max_mbit: float, rate: float) -> None:
    """The window pace is 4000 bytes over 1 s; a cap of 2 kB/s is slower, one of 100 kB/s is not."""
    pacer = exchange(0.5, 5, steps_seen=WARMUP, max_mbit=max_mbit).pacer(torch.zeros(1000))
    assert pacer.rate == pytest.approx(rate)


def test_a_cap_too_low_for_the_deadline_gives_way(caplog: pytest.LogCaptureFixture) -> None:
    """1 kbit/s would take 32 s for 4000 bytes; the exchange's deadline is 3 s, so the pace is
    the one that sends them in half of it, and the peer says why."""
    pacer = exchange(0.0, 0, steps_seen=0, deadline=3.0, max_mbit=0.001).pacer(torch.zeros(1000))
    assert pacer.rate == pytest.approx(4000 / 1.5)
    assert "peer.exchange_max_mbit=0.001 would take 32 s" in caplog.text


def heard(rate: float, pace: float = 0.0) -> Uplink:
    """An uplink whose last exchange, sent at `pace` (0: unpaced), a partner saw arrive at `rate`."""
    uplink, pacer = Uplink(), Pacer(pace)
    uplink.track(pacer)
    pacer.arrived.append(rate)
    return uplink


def sent(uplink: Uplink, arrived: float | None = None, writers: int = 1) -> float | None:
    """One exchange: the cap `uplink` gives, and (unless None) each of `writers` streams at that
    pace arriving at `arrived` bytes/s, or at its pace when `arrived` is 0."""
    cap = uplink.cap()
    uplink.track(pacer := Pacer(cap or 0.0))
    pacer.most_writers = writers
    if arrived is not None:
        pacer.arrived += [arrived or (cap or 0.0) / writers] * writers
    return cap


def test_the_default_cap_follows_what_partners_measured() -> None:
    """auto (None): the first exchange goes uncapped; once a partner timed one arriving at
    1 MB/s, the next probes CLIMB above CAP_SHARE of that; a set cap (8 Mbit/s) or 0 (none)
    overrides it."""
    first = exchange(0.0, 0, steps_seen=0, max_mbit=None).pacer(torch.zeros(1000))
    assert first.rate == 0
    auto = exchange(0.0, 0, steps_seen=0, max_mbit=None, uplink=heard(1e6)).pacer(torch.zeros(1000))
    assert auto.rate == pytest.approx(CAP_SHARE * 1e6 * (1 + CLIMB))
    assert (
        exchange(0.0, 0, steps_seen=0, max_mbit=8.0, uplink=heard(1e5)).pacer(torch.zeros(1000)).rate == 1e6
    )
    assert exchange(0.0, 0, steps_seen=0, max_mbit=0.0, uplink=heard(1e5)).pacer(torch.zeros(1000)).rate == 0
    # The window's pace is 4000 bytes over 1 s: a measured link of 1 MB/s leaves it alone.
    paced = exchange(0.5, 5, steps_seen=WARMUP, max_mbit=None, uplink=heard(1e6)).pacer(torch.zeros(1000))
    assert paced.rate == pytest.approx(4000 / (0.5 * 5 * 0.4))


def test_a_link_measured_low_unpaced_is_climbed_to_its_rate() -> None:
    """The first, unpaced exchange measured 0.6 MB/s of a link that carries 1 MB/s: probes that keep
    to their pace raise the estimate with doubling steps until one is held back at 1 MB/s, which
    then caps HOLD exchanges before the next probe. (A cap shows the estimate its exchange's
    predecessor left.)"""
    link = 1e6
    uplink = Uplink()
    assert sent(uplink, 0.6e6) is None
    caps = []
    for _ in range(3):
        caps.append(cap := uplink.cap())
        uplink.track(pacer := Pacer(cap or 0.0))
        pacer.arrived.append(min(cap or link, link))
    climbed = [1 + CLIMB, (1 + CLIMB) * (1 + 2 * CLIMB), (1 + CLIMB) * (1 + 2 * CLIMB) * (1 + 4 * CLIMB)]
    assert caps == pytest.approx([CAP_SHARE * 0.6e6 * f for f in climbed])
    assert caps[-1] > link  # the last probe was held back by the link, at its rate
    for _ in range(HOLD):
        assert sent(uplink, 0) == pytest.approx(CAP_SHARE * link)
    assert sent(uplink, 0) == pytest.approx(CAP_SHARE * link * (1 + PROBE))  # kept to its pace
    assert sent(uplink, link) == pytest.approx(CAP_SHARE * link * (1 + PROBE) * (1 + 2 * PROBE))
    assert sent(uplink, 0) == pytest.approx(CAP_SHARE * link)  # held back: trusted again
    assert uplink.rate == pytest.approx(link)


def test_a_probe_that_reads_below_the_last_measurement_keeps_it() -> None:
    """A probe's report may read low because a partner probed at the same exchange (its queue
    holds our acknowledgements): the estimate stays at the last measurement, and holds."""
    uplink = heard(1e6)  # unpaced: the next probes CLIMB above it
    assert sent(uplink, 0.8e6) == pytest.approx(CAP_SHARE * 1e6 * (1 + CLIMB))
    for _ in range(HOLD):
        assert sent(uplink, 0) == pytest.approx(CAP_SHARE * 1e6)
    assert uplink.cap() == pytest.approx(CAP_SHARE * 1e6 * (1 + PROBE))


def test_the_uplink_learns_from_reports_the_link_set() -> None:
    uplink = heard(2e6, pace=3e6)  # the link held a pace of 3 MB/s back to 2 MB/s: trusted
    assert sent(uplink, 0.99 * CAP_SHARE * 2e6) == pytest.approx(CAP_SHARE * 2e6)
    # Sent at the cap and arrived at it: only says the link carries that much; the estimate stays.
    assert uplink.cap() == pytest.approx(CAP_SHARE * 2e6)
    # Arrived well below the pace: once may be a partner's overshoot, and is doubted; twice in a
    # row, the link got slower, and the cap follows it down.
    assert sent(uplink, 1e6) == pytest.approx(CAP_SHARE * 2e6)
    assert sent(uplink, 0) == pytest.approx(CAP_SHARE * 2e6)  # kept to its pace: doubt cleared
    assert sent(uplink, 1e6) == pytest.approx(CAP_SHARE * 2e6)
    uplink.track(pacer := Pacer(uplink.cap() or 0.0))
    pacer.arrived += [1e6, 0.0]  # 0 is "not measured"
    assert uplink.cap() == pytest.approx(CAP_SHARE * 1e6)
    # Reports that are no measurement (or no link worth capping for) change nothing.
    uplink.heard(0.0, [0.0, -1.0, 1.0, math.inf, math.nan])
    assert uplink.rate == pytest.approx(1e6)


def test_a_probe_a_slower_pace_hid_is_tried_again() -> None:
    """The window's pace was below the probe's cap: its tensors keeping to it say nothing of the
    probe, which goes out again at the next exchange; with no reports at all, likewise."""
    uplink = heard(1e6)
    probe = uplink.cap()
    uplink.track(pacer := Pacer(0.5e6))
    pacer.arrived.append(0.5e6)
    assert uplink.cap() == pytest.approx(probe)
    uplink.track(Pacer(probe or 0.0))  # no partner reported
    assert uplink.cap() == pytest.approx(probe)
    assert uplink.rate == pytest.approx(1e6)


def test_streams_sharing_a_pace_are_judged_by_their_share() -> None:
    """Two streams at once at 1 MB/s in all: each arriving at 0.5 MB/s kept to the pace, which
    says nothing of the link; each at 0.2 MB/s was held back by a link of about 0.4 MB/s."""
    uplink = Uplink()
    uplink.track(pacer := Pacer(1e6))
    pacer.most_writers = 2
    pacer.arrived += [0.49e6, 0.5e6]
    assert uplink.cap() is None
    assert sent(uplink, 0.2e6, writers=2) is None
    assert uplink.cap() == pytest.approx(CAP_SHARE * 0.4e6 * (1 + CLIMB))  # unpaced: probed at once
    uplink.track(pacer := Pacer(1e6))
    pacer.most_writers = 2
    pacer.arrived += [0.2e6, 0.2e6]
    assert uplink.cap() == pytest.approx(CAP_SHARE * 0.4e6)


def test_arrivals_time_the_transfer_after_its_first_quarter() -> None:
    """1 MiB arrives in 16 parts, one every 10 ms after a 4-part burst at t = 0: the rate counts
    the 12 parts after the first quarter over their 120 ms."""
    times = [0.0] * 4 + [0.01 * i for i in range(1, 13)]
    arrivals = Arrivals(16 * 65536)
    for now in times:
        arrivals.got(65536, now)
    assert arrivals.rate() == pytest.approx(12 * 65536 / 0.12)
    short = Arrivals(65536)  # too small to time
    short.got(65536, 1.0)
    assert short.rate() == 0.0
    incomplete = Arrivals(16 * 65536)  # a transfer that broke off says nothing
    for now in times[:8]:
        incomplete.got(65536, now)
    assert incomplete.rate() == 0.0


def test_a_probe_is_judged_by_its_slowest_stream() -> None:
    """Two streams share the pace: one report far above it must not pass a probe the other fell
    short of (a high report would otherwise lift the cap a probe at a time)."""
    uplink = heard(1e6, pace=2e6)  # held back at 1 MB/s: trusted
    for _ in range(HOLD):
        assert sent(uplink, 0) == pytest.approx(CAP_SHARE * 1e6)
    probe = uplink.cap()
    assert probe == pytest.approx(CAP_SHARE * 1e6 * (1 + PROBE))
    uplink.track(pacer := Pacer(probe or 0.0))
    pacer.most_writers = 2
    pacer.arrived += [0.4 * (probe or 0.0), 5 * (probe or 0.0)]  # one slow, one reading high
    uplink.cap()
    assert uplink.rate == pytest.approx(1e6)  # not raised: the slow stream's 0.4 x 2 is below it


def test_a_probe_that_kept_up_is_a_floor_for_later_ones() -> None:
    """A probe that kept to its pace showed the link carries that much: a later probe that reads
    lower (a partner overshooting at the same time) keeps at least that rate."""
    uplink = heard(1e6)  # unpaced: the next probes CLIMB above it
    first = sent(uplink, 0)  # kept to its pace
    assert first == pytest.approx(CAP_SHARE * 1e6 * (1 + CLIMB))
    assert sent(uplink, 0.5e6) == pytest.approx(CAP_SHARE * 1e6 * (1 + CLIMB) * (1 + 2 * CLIMB))
    assert uplink.cap() == pytest.approx(CAP_SHARE * (first or 0.0))  # held at what the first carried


def test_a_fall_below_half_the_best_rate_is_climbed_back_at_once_by_doubling() -> None:
    """A partner behind a delay spike read our tensors at 1/20 of the link's rate twice in a row
    (the chaos test's case): the estimate follows it down, and the exchanges from then on probe at
    twice the estimate, up to the best rate the link showed, and hold there (not HOLD exchanges
    at the fallen rate and PROBE-sized steps: 14 exchanges of 4 s there)."""
    link = 20e6
    uplink = heard(link, pace=2 * link)  # held back at the link's rate: trusted
    assert sent(uplink, link / 20) == pytest.approx(CAP_SHARE * link)  # doubted once
    assert sent(uplink, link / 20) == pytest.approx(CAP_SHARE * link)  # believed: read next
    caps = [sent(uplink, 0) for _ in range(5)]  # each probe keeps to its pace
    assert caps == pytest.approx([CAP_SHARE * link / 20 * f for f in (2, 4, 8, 16, 20)])
    assert sent(uplink, 0) == pytest.approx(CAP_SHARE * link)  # held at the best rate again
    assert not uplink.recovering and uplink.rate == pytest.approx(link)


def test_a_link_that_really_got_slower_costs_one_probe_above_it() -> None:
    """The link itself fell to a quarter: the first doubling probe is held back, the estimate
    stays at the new rate, and the new rate is the best from then on (no more doubling)."""
    link = 20e6
    uplink = heard(link, pace=2 * link)
    sent(uplink, link / 4)  # doubted
    sent(uplink, link / 4)  # believed: read next
    assert sent(uplink, link / 4) == pytest.approx(CAP_SHARE * link / 2)  # the probe, held back
    for _ in range(HOLD):
        assert sent(uplink, 0) == pytest.approx(CAP_SHARE * link / 4)
    assert not uplink.recovering and uplink.best == pytest.approx(link / 4)
