"""Whom a peer routes rows around (peer/detours.py): what it decides itself, what it believes from
headers, and which gone reports make it probe whom."""

from __future__ import annotations

import asyncio

from noloco_swarm.peer.detours import Detours
from noloco_swarm.protocol.membership import MembershipView

VIEW = MembershipView(4, (("a0", "a1", "a2"), ("b0", "b1"), ("c0", "c1")))


def test_a_stage_zero_peer_stands_in_for_its_own_stage_and_a_receiver_only_once_told() -> None:
    dead = {"a1": 4, "b1": 4, "c0": 4}
    assert Detours("a0", 0, dead).around(VIEW) == {(0, 1), (1, 1), (2, 0)}
    # stage 1 saw a1 die, but waits for a stand-in's rows only once its header says it stands in
    receiver = Detours("b0", 1, dead)
    assert receiver.around(VIEW) == {(1, 1), (2, 0)}
    assert receiver.hear(VIEW, [(0, 1)])  # news: steps still collecting expect anew
    assert not receiver.hear(VIEW, [(0, 1)])
    assert (0, 1) in receiver.expected(VIEW)
    # believed for the round said in and the next, not later
    assert (0, 1) in receiver.expected(MembershipView(5, VIEW.stages))
    assert (0, 1) not in receiver.expected(MembershipView(6, VIEW.stages))
    receiver.forget("a1")
    assert (0, 1) not in receiver.expected(VIEW)


def test_a_header_that_names_us_is_no_news() -> None:
    detours = Detours("b1", 1, {})
    assert not detours.hear(VIEW, [(1, 1)])
    assert detours.expected(VIEW) == frozenset()


def probes(stage: int, me: str, run) -> list[tuple[str, str]]:
    """The (peer, why) pairs `run(detours, suspect)` makes a peer of `stage` probe."""
    asked: list[tuple[str, str]] = []

    async def suspect(peer: str, why: str) -> bool:
        asked.append((peer, why))
        return peer == "a2"  # a2 is dead; the others answer

    async def main() -> Detours:
        detours = Detours(me, stage, {})
        run(detours, suspect)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        await detours.close()
        return detours

    asyncio.run(main())
    return asked


def test_reports_make_a_peer_probe_its_own_stage_on_stage_zero_and_the_next_stage() -> None:
    reports = [
        ("a1", "b0", 3),  # stage 0, reported by a member
        ("a2", "a2", 4),  # it leaves: not probed
        ("b1", "c0", 4),  # stage 1
        ("c1", "b0", 4),  # stage 2: not ours
        ("a1", "stranger", 4),  # a stranger's report counts for nothing (a1 is probed once anyway)
        ("b0", "zz", 4),
    ]
    asked = probes(0, "a0", lambda d, s: d.check_reported(VIEW, reports, s))
    assert sorted(peer for peer, _ in asked) == ["a1", "b1"]
    asked = probes(1, "b0", lambda d, s: d.check_reported(VIEW, reports, s))
    assert [peer for peer, _ in asked] == ["c1"]


def test_only_stage_zero_acts_on_an_answer_that_says_a_sender_failed() -> None:
    asked = probes(0, "a0", lambda d, s: d.told_gone(VIEW, [1, 2, 7], "b0", s))
    assert sorted(asked) == [("a1", "b0 says it failed it"), ("a2", "b0 says it failed it")]
    assert probes(1, "b1", lambda d, s: d.told_gone(VIEW, [1], "c0", s)) == []


def test_a_peer_that_answered_is_not_probed_again_at_once() -> None:
    asked: list[str] = []

    async def suspect(peer: str, why: str) -> bool:
        asked.append(peer)
        return False  # it answers

    async def main() -> None:
        detours = Detours("a0", 0, {})
        for _ in range(3):
            detours.told_gone(VIEW, [1], "b0", suspect)
            await asyncio.sleep(0.01)
        await detours.close()

    asyncio.run(main())
    assert asked == ["a1"]
