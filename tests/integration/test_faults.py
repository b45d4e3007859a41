"""Faults a real swarm must ride out: a peer frozen (SIGSTOP) for longer than the step deadline,
alone or together with its libp2p daemon, comes back by itself and the swarm keeps its pace."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from noloco_swarm.cli.swarm import local_swarm, wait
from noloco_swarm.peer.events import Dropped, Joined, Membership, Refused, Step, ViewMismatch, of_kind
from tests.integration.test_swarm import SLOWER, small, views_by_round

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("stage", "frozen"), [(1, "peer"), (0, "peer-and-daemon")])
def test_a_peer_frozen_past_the_deadline_is_dropped_and_rejoins_by_itself(
    cache: Path, tmp_path: Path, stage: int, frozen: str
) -> None:
    """A peer stopped for 15 s (step deadline 8 s) is dropped by the others, who train on
    without it. Once it runs again it finds itself outside the swarm's view, joins again at a
    later round with a live replica's state, and trains to the end. Every peer holds one view per
    round, and once the peer is back nothing is refused and, from the round after its rejoin on,
    nothing is dropped: the swarm does not stay behind a stage that fell behind. (Between its thaw and the boundary where it finds itself out of the
    view, a thawed stage-0 peer still sends rows for the steps it missed; they are refused at once
    as late, and cost the others nothing.)"""
    # Long enough that, on a loaded machine too, the others are still training when the thawed
    # peer looks for a round to join (they run on at a few steps a second meanwhile).
    steps, H = 300, 3
    cfg = small("noloco", **{**SLOWER, "outer.inner_steps": str(H), "inner.total_steps": str(steps)})
    with local_swarm(cfg, steps, step_timeout=8, workdir=tmp_path) as swarm:  # logs kept by pytest
        victim = next(p for p in swarm.peers if p.stage == stage and p.replica == 1)
        deadline = time.monotonic() + 120
        while not any(e.step >= 8 for e in of_kind(victim.events(), Step)):
            assert time.monotonic() < deadline, victim.log_tail()
            time.sleep(0.1)
        send = os.killpg if frozen == "peer-and-daemon" else os.kill  # the group holds its p2pd
        send(victim.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(15)
        finally:
            send(victim.proc.pid, signal.SIGCONT)
        wait(swarm, timeout=500)
        events = [p.events() for p in swarm.peers]
        summaries = {s.peer_id: s for s in swarm.summaries()}
    mine = events[swarm.peers.index(victim)]
    victim_id = next(e.peer_id for e in of_kind(mine, Membership))
    rejoined = next(iter(of_kind(mine, Joined)), None)
    assert rejoined is not None, "the thawed peer did not join again"
    back = rejoined.round * H  # its first step after coming back
    assert summaries[victim_id].joined_round == rejoined.round
    assert all(s.steps == steps for s in summaries.values())
    views = views_by_round(events)
    assert all(len(v) == 1 for v in views.values()), views
    assert any(victim_id not in next(iter(v))[stage] for v in views.values()), "it was never dropped"
    assert victim_id in next(iter(views[rejoined.round]))[stage]
    # While the fault lasts, refusals are its consequence: the thawed peer's rows for steps the
    # others had passed, and, under load, a healthy peer's rows held up by an outer exchange with
    # the frozen peer and given up on by their receiver. Once the peer is back, nobody is refused.
    refused = [e for ev in events for e in ev if isinstance(e, Refused | ViewMismatch) and e.step >= back]
    assert refused == [], refused
    # Known and open (issue 9): under load, a sample of the first round after a join is sometimes
    # lost on its way to or from the joined peer ("remote closed the stream"); from the round
    # after that on, nothing may be dropped.
    late_drops = [e for ev in events for e in of_kind(ev, Dropped) if e.step >= back + H]
    assert late_drops == [], late_drops
