"""A replica that a sender believes gone (it was frozen or cut off when the sender called it)
stays in the round's view until the reports are weighed, and the sender routes its rows to a
stand-in until then. The avoided replica must not wait for those rows to the step deadline, step
after step: a probe of the silent sender says that it routes around the asker, and the rows are
then not expected (nor counted as lost: the stand-in took them)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from noloco_swarm.peer import inner
from noloco_swarm.peer.collector import Arrival, StepCollector
from noloco_swarm.peer.detours import Detours, said_routing
from noloco_swarm.peer.inner import InnerSteps, avoids_us
from noloco_swarm.protocol.clock import StepClock
from noloco_swarm.protocol.codec import decode, encode
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.protocol.plan import Incoming, Row, StepPlan
from noloco_swarm.protocol.rpc import PeerStatus

ROUND, STEP = 4, 21
SENDERS = ("QmSender0", "QmSender1", "QmSender2")
ME, MY_RANK = "QmMe", 2  # replica 2 of stage 1
PLAN = StepPlan.of((3, 3, 3, 3), 2, True, 1)  # 4 stages x 3 replicas, 2 rows per replica and step


def status(peer: str, *, around: tuple[int, ...], round_: int = ROUND, step: int = STEP) -> PeerStatus:
    """A stage-0 sender's answer: in `round_` it routes around the stage-1 ranks `around`."""
    return PeerStatus("run-1", peer, 0, step, round_, 0, 4, 0, around_round=round_, routes_around=around)


def collector() -> StepCollector:
    """Step STEP's rows: position 0 from sender 0, position 1 from sender 1."""
    return StepCollector(STEP, (Incoming(Row(0, 0), 0), Incoming(Row(1, 1), 1)))


def arrival(sender: int, rows: list[Row]) -> Arrival:
    n = len(rows)
    return Arrival(
        sender, [r.position for r in rows], torch.zeros(n, 2, 4), torch.zeros(n, 2, dtype=torch.long)
    )


def steps_with(answers: dict[str, PeerStatus], deadline: float) -> tuple[InnerSteps, list[str]]:
    """Collection on replica MY_RANK of stage 1, whose probes of SENDERS get `answers` (also kept
    as their last answers, as Liveness.probe does)."""
    probed: list[str] = []
    seen: dict[str, PeerStatus] = {}

    async def probe(peer: str) -> PeerStatus:
        probed.append(peer)
        seen[peer] = answers[peer]
        return answers[peer]

    async def suspect(peer: str, why: str) -> bool:
        return False

    view = SimpleNamespace(
        round=ROUND, peer_at=lambda stage, rank: SENDERS[rank], rank_of=lambda peer: (1, MY_RANK)
    )
    steps = object.__new__(InnerSteps)
    steps.ctx = SimpleNamespace(  # type: ignore[assignment]
        stage=1,
        me=ME,
        view_at=lambda t: view,
        plan_at=lambda t: PLAN,
        deadlines=SimpleNamespace(step=deadline),
        clock=StepClock(inner_steps=5, batch_size=2),
        rounds=SimpleNamespace(probe=probe, suspect=suspect, seen=seen, mark_dead=lambda p, why: None),
    )
    return steps, probed


def test_a_sender_that_routes_around_us_is_not_waited_for_and_its_rows_are_not_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(inner, "PROBE_PERIOD", 0.05)
    steps, probed = steps_with({SENDERS[1]: status(SENDERS[1], around=(MY_RANK,))}, deadline=30.0)

    async def main() -> StepCollector:
        c = collector()
        c.add(arrival(0, [Row(0, 0)]), [Row(0, 0)])
        began = time.monotonic()
        await asyncio.wait_for(steps._collect(STEP, c), 5)
        assert time.monotonic() - began < 1.0  # one probe period, not the 30 s deadline
        return c

    c = asyncio.run(main())
    assert c.complete.is_set() and sorted(c.arrivals) == [0]
    assert c.never_came() == {}  # its rows went to our stand-in: not lost here
    assert probed == [SENDERS[1]]

    # The next step of the same round: its last answer already says so, so no wait and no probe.
    async def next_step() -> None:
        c = collector()
        c.add(arrival(0, [Row(0, 0)]), [Row(0, 0)])
        await asyncio.wait_for(steps._collect(STEP + 1, c), 0.5)

    asyncio.run(next_step())
    assert probed == [SENDERS[1]]


def test_a_silent_sender_that_does_not_route_around_us_is_still_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(inner, "PROBE_PERIOD", 0.05)
    steps, probed = steps_with({SENDERS[1]: status(SENDERS[1], around=(0,))}, deadline=30.0)

    async def main() -> None:
        c = collector()
        c.add(arrival(0, [Row(0, 0)]), [Row(0, 0)])
        waiting = asyncio.ensure_future(steps._collect(STEP, c))
        await asyncio.sleep(0.3)
        assert not waiting.done() and len(probed) >= 2  # probed every period, still expected
        c.add(arrival(1, [Row(1, 1)]), [Row(1, 1)])
        await asyncio.wait_for(waiting, 1)
        assert sorted(c.arrivals) == [0, 1]

    asyncio.run(main())


def test_a_stand_in_stops_waiting_for_a_stage_0_sender_that_sends_it_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """We heard that stage-1 rank 1 is routed around, so we (its stand-in) expect its rows from
    every stage-0 sender. Sender 0 does not route around it and sends it its row itself, and
    has none of ours at this step: its answer says so, and we stop waiting for it. (Seen after a
    peer was frozen 15 s in a 4 x 3 swarm: every step then waited the 20 s deadline, 2026-12-07.)"""
    monkeypatch.setattr(inner, "PROBE_PERIOD", 0.05)
    t, heard = 0, PLAN.routing_around({(1, 1)})
    assert heard.expects_from(t, 1, MY_RANK, 0, 0) and not PLAN.expects_from(t, 1, MY_RANK, 0, 0)
    for around, waits in (((), False), ((1,), True)):  # sender 0's routing, as it answers
        steps, _ = steps_with({SENDERS[0]: status(SENDERS[0], around=around, step=t)}, deadline=30.0)

        async def main(steps: InnerSteps = steps, waits: bool = waits) -> StepCollector:
            c = StepCollector(t, tuple(heard.expects(t, 1, MY_RANK, 0)))
            for sender in (1, 2):
                rows = heard.expects_from(t, 1, MY_RANK, sender, 0)
                c.add(arrival(sender, rows), rows)
            collecting = asyncio.ensure_future(steps._collect(t, c))
            await asyncio.sleep(0.5)
            assert collecting.done() is not waits
            if waits:  # it routes around rank 1 too: its row for rank 1 comes to us
                rows = heard.expects_from(t, 1, MY_RANK, 0, 0)
                c.add(arrival(0, rows), rows)
            await asyncio.wait_for(collecting, 1)
            return c

        c = asyncio.run(main())
        assert c.complete.is_set() and c.never_came() == {}


def test_an_avoidance_said_in_another_round_is_not_believed() -> None:
    """A sender's record of who failed it is weighed at each boundary (the swarm keeps or drops
    the peer): what it said in round r says nothing about round r + 1."""
    view = SimpleNamespace(round=ROUND, rank_of=lambda peer: (1, MY_RANK))
    ctx = SimpleNamespace(me=ME)
    earlier = status(SENDERS[1], around=(MY_RANK,), round_=ROUND - 1)
    assert not avoids_us(ctx, view, earlier)  # type: ignore[arg-type]
    assert avoids_us(ctx, view, status(SENDERS[1], around=(MY_RANK,)))  # type: ignore[arg-type]
    assert not avoids_us(ctx, view, status(SENDERS[1], around=(0, 1)))  # type: ignore[arg-type]
    assert not avoids_us(ctx, view, None)  # type: ignore[arg-type]


def test_the_routing_fields_cross_the_wire_and_bad_ones_are_refused() -> None:
    said = status(SENDERS[1], around=(0, 2))
    assert decode(encode(said), PeerStatus) == said
    with pytest.raises(ValueError, match="counters"):
        status(SENDERS[1], around=(-1,))
    with pytest.raises(ValueError, match="around_round"):
        PeerStatus("run-1", "Qm", 0, 1, 0, 0, 1, 0, around_round=-2)


def test_a_sender_that_sent_the_microbatch_to_others_only_is_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On any stage: a sender that says it sent this microbatch on, and not to us, sends us
    nothing of it (what it holds came from its own senders, so only it can say)."""
    monkeypatch.setattr(inner, "PROBE_PERIOD", 0.05)
    for sent_to, waits in (((0, 1), False), ((1, MY_RANK), True)):
        answer = PeerStatus("run-1", SENDERS[1], 0, STEP, ROUND, 0, 4, 0, sent=(STEP, 0), sent_to=sent_to)
        steps, _ = steps_with({SENDERS[1]: answer}, deadline=30.0)

        async def main(steps: InnerSteps = steps, waits: bool = waits) -> StepCollector:
            c = collector()
            c.add(arrival(0, [Row(0, 0)]), [Row(0, 0)])
            collecting = asyncio.ensure_future(steps._collect(STEP, c))
            await asyncio.sleep(0.3)
            assert collecting.done() is not waits
            if waits:
                c.add(arrival(1, [Row(1, 1)]), [Row(1, 1)])
            await asyncio.wait_for(collecting, 1)
            return c

        assert asyncio.run(main()).never_came() == {}


def test_a_status_answer_says_whom_its_peer_routes_around_and_where_it_sent_last() -> None:
    view = MembershipView(ROUND, (("QmA0", "QmA1"), ("QmB0", "QmB1", "QmB2"), ("QmC0", "QmC1")))
    dead = {"QmB1": ROUND, "QmA1": ROUND, "QmC0": ROUND}  # who failed a stage-0 peer
    said = said_routing(Detours("QmA0", 0, dead), 0, view, ((STEP, 1), (0, 2)))
    answer = PeerStatus("run-1", "QmA0", 0, STEP, ROUND, 0, 4, 0, **said)
    # the next stage's rank 1 routed around, and its own stage's rank 1 stood in for (stage 0)
    assert (answer.around_round, answer.routes_around, answer.stands_in) == (ROUND, (1,), (1,))
    assert (answer.sent, answer.sent_to) == ((STEP, 1), (0, 2))
    # a later stage stands in for nobody of its own; before a view and a send, nothing is said
    later = said_routing(Detours("QmB0", 1, {"QmB1": ROUND, "QmC0": ROUND}), 1, view, ((-1, -1), ()))
    assert later == {"around_round": ROUND, "routes_around": (0,), "stands_in": ()}
    assert said_routing(Detours("QmA0", 0, dead), 0, None, ((-1, -1), ())) == {}
