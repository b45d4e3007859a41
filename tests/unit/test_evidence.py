"""Which gone reports a peer acts on (peer/evidence.py): a member's word alone evicts nobody."""

from __future__ import annotations

import asyncio

from noloco_swarm.peer.events import Events, FalseReport, of_kind
from noloco_swarm.peer.evidence import LIAR_ROUNDS, LIAR_STRIKES, Evidence
from noloco_swarm.protocol.membership import MembershipView

ME, A, B, C, LIAR = "me", "a", "b", "c", "liar"


class Recorder:
    def __init__(self) -> None:
        self.events: list = []

    def emit(self, event) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass


def judge(round_: int, alive: set[str]):
    """An Evidence of peer ME, its probes answered by `alive`, and what it probed and saw."""
    sink = Recorder()
    evidence = Evidence(ME, Events([sink]))
    probed: list[str] = []

    async def probe(peer: str) -> bool:
        probed.append(peer)
        return peer in alive

    def weigh(reports, *, at: int = round_, joined=None):
        view = MembershipView(at, ((A, LIAR, ME), (B, C)))
        return asyncio.run(evidence.weigh(view, joined or {}, reports, probe))

    return evidence, weigh, probed, sink


def test_a_report_of_a_live_member_is_void_and_a_dead_ones_stands() -> None:
    evidence, weigh, probed, sink = judge(5, alive={A, B, LIAR})
    kept = weigh([(B, LIAR, 3), (C, A, 3)])
    assert kept == [(C, A, 3)]
    assert sorted(probed) == [B, C]
    assert evidence.live == {B}
    [false] = of_kind(sink.events, FalseReport)
    assert (false.reporter, false.peer, false.round) == (LIAR, B, 3)
    probed.clear()
    assert weigh([(B, LIAR, 3), (C, A, 3)]) == [(C, A, 3)]  # void for good: not probed again
    assert probed == [C]


def test_leaving_and_reports_of_us_are_settled_without_a_probe() -> None:
    _, weigh, probed, sink = judge(5, alive=set())
    assert weigh([(A, A, 4), (ME, LIAR, 4)]) == [(A, A, 4)]  # A leaves; we run
    assert probed == []
    assert [e.peer for e in of_kind(sink.events, FalseReport)] == [ME]


def test_only_reports_that_next_view_acts_on_are_probed() -> None:
    _, weigh, probed, _ = judge(5, alive={B})
    reports = [(B, LIAR, 5), (B, LIAR, 2), ("stranger", LIAR, 1)]  # not due; before B joined; no member
    assert sorted(weigh(reports, joined={B: 3})) == sorted(reports)
    assert probed == []


def test_a_member_that_keeps_reporting_live_peers_goes_unheard() -> None:
    evidence, weigh, probed, sink = judge(5, alive={A, B})
    reports = [(B, LIAR, r) for r in range(LIAR_STRIKES)]
    assert weigh(reports) == []
    assert evidence.unheard[LIAR] == 5 + LIAR_ROUNDS
    assert of_kind(sink.events, FalseReport)[-1].ignored_until == 5 + LIAR_ROUNDS
    probed.clear()
    # Unheard: its next report (even of a dead peer) is dropped unprobed; others' still count.
    assert weigh([(C, LIAR, 4), (C, A, 4)], at=6) == [(C, A, 4)]
    assert probed == [C]


def test_our_own_reports_earn_us_no_strikes() -> None:
    evidence, weigh, _, _ = judge(5, alive={B, C})
    assert weigh([(B, ME, 2), (C, ME, 3)]) == []  # both answer again: our marks are void
    assert ME not in evidence.unheard and evidence.live == {B, C}


def test_reports_by_two_members_stand_without_a_probe_even_of_us() -> None:
    """A peer cut off (or frozen) for a while answers again by the boundary, but everyone it
    failed reported it: it leaves with all of them agreeing, itself included, and rejoins."""
    evidence, weigh, probed, sink = judge(5, alive={A, B, C, LIAR})
    reports = [(B, A, 3), (B, LIAR, 4), (ME, A, 3), (ME, C, 3)]
    assert sorted(weigh(reports)) == sorted(reports)
    assert probed == [] and evidence.live == set() and not of_kind(sink.events, FalseReport)
