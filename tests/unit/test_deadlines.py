"""Deadlines follow the steps and exchanges a peer sees, within their configured bounds."""

from __future__ import annotations

import pytest

from noloco_swarm.peer import events
from noloco_swarm.peer.deadlines import WARMUP, WINDOW, Deadlines
from noloco_swarm.train.config import PeerConfig


def test_the_configured_deadlines_hold_until_steps_and_an_exchange_were_seen() -> None:
    d = Deadlines(PeerConfig(step_timeout=120, exchange_timeout=90))
    for _ in range(WARMUP - 1):
        d.observe_step(0.2)
    assert (d.step, d.exchange) == (120, 90)
    d.observe_step(0.2)
    d.observe_exchange(3.0)
    assert d.step == 10.0  # 8 x 0.2 s is below the floor
    assert d.exchange == 24.0  # 8 x 3 s


def test_deadlines_follow_the_longest_recent_step_within_the_bounds() -> None:
    d = Deadlines(PeerConfig(step_timeout=60, deadline_factor=4, min_deadline=2))
    for seconds in [0.1] * WARMUP + [5.0]:
        d.observe_step(seconds)
    assert d.step == 20.0  # one slow step (an outer step's wait, a loaded machine) counts
    for _ in range(WINDOW):
        d.observe_step(0.1)
    assert d.step == 2.0  # it has left the window: the floor
    d.observe_step(100.0)
    assert d.step == 60  # never above the configured deadline


@pytest.mark.parametrize(
    "failure",
    [
        events.Dropped(step=7, hop=0, samples=2, side="receiver"),
        events.Unsent(step=7, peer="QmB", at=8),
        events.SlowPeer(peer="QmB", reason="sent nothing for step 7 within 10 s"),
        events.PeerGone(peer="QmB", round=1, reason="stopped answering"),
        events.Refused(step=7, peer="QmB", reason="views differ"),
    ],
)
def test_a_step_in_which_a_peer_failed_us_is_not_a_step_time(failure: events.Event) -> None:
    """A step that waited on a failure lasted as long as the wait: learning from it would make
    every later failure cost the bound (seen after a peer was frozen, 2026-12-07)."""
    d = Deadlines(PeerConfig(step_timeout=20, deadline_factor=8, min_deadline=10))
    for _ in range(WARMUP):
        d.observe_step(0.3)
    sink = events.Events([d])
    sink.emit(failure)
    d.observe_step(15.0)  # the step that waited on the frozen peer
    assert d.step == 10.0
    sink.emit(events.Step(step=9, loss=None, lr=0.1, seconds=0.3, tokens=0, tokens_per_second=1.0))
    d.observe_step(1.5)  # an event that is no failure: the next step counts again
    assert d.step == 12.0


def test_factor_zero_keeps_the_configured_deadlines() -> None:
    d = Deadlines(PeerConfig(step_timeout=30, deadline_factor=0))
    for _ in range(WINDOW):
        d.observe_step(0.1)
    d.observe_exchange(0.1)
    assert (d.step, d.exchange) == (30, 120)


@pytest.mark.parametrize(("key", "value"), [("deadline_factor", -1.0), ("min_deadline", 0.0)])
def test_bad_bounds_are_refused(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"peer.{key}"):
        PeerConfig(**{key: value})
