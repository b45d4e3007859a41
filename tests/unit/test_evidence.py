"""Which gone reports a peer acts on (peer/evidence.py): a member's word alone evicts nobody."""

from __future__ import annotations

import asyncio

from noloco_swarm.peer.events import Events, FalseReport, of_kind
from noloco_swarm.peer.evidence import Evidence
from noloco_swarm.protocol.membership import (
    LATE_REPORT_ROUNDS,
    LIAR_ROUNDS,
    LIAR_STRIKES,
    Judgement,
    MembershipView,
)

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


def test_a_newcomer_takes_the_reports_its_donor_settled_as_settled() -> None:
    """The members probed B on each report of round 3 and 4 as it fell due and kept it; a
    newcomer that reads both at once would count two reporters and drop B, which the swarm keeps:
    adopting the donor's view of round 6 settles them."""
    view = MembershipView(6, ((A, B, ME), (C,)))
    old = [(B, A, 3), (B, C, 4)]
    fresh = Judgement()
    assert fresh.doubtful(view, {}, old) == set()  # two reporters: they would stand unprobed
    assert fresh.settle(view, {}, old, set(), ME)[0] == old
    newcomer = Judgement()
    newcomer.adopt(view)
    assert newcomer.doubtful(view, {}, old) == set()
    assert newcomer.settle(view, {}, old, set(), ME)[0] == []
    # a report of round 5 is not settled yet: it falls due at this boundary, as for everyone
    late = [(B, A, 5), (B, C, 5)]
    assert newcomer.settle(view, {}, late, set(), ME)[0] == late
    # nor is one of a peer the donor's view does not hold (a non-member it may not admit)
    gone = [("d", A, 3)]
    assert newcomer.settle(view, {}, gone, set(), ME)[0] == gone


def test_a_rejoiner_forgets_whom_it_struck_while_it_was_cut_off() -> None:
    """Cut off, a peer probed members that others had truly reported and struck them as liars;
    once it rejoins at the swarm's view it hears them again, as every member does."""
    view = MembershipView(6, ((A, B, ME), (C,)))
    judgement = Judgement()
    judgement.settle(view, {}, [(B, A, 4), (C, A, 5)], {B, C}, ME)  # A struck twice: unheard
    assert judgement.unheard[A] == 6 + LIAR_ROUNDS
    assert judgement.settle(view, {}, [(B, A, 5)], set(), ME)[0] == []  # A's word is ignored
    judgement.adopt(MembershipView(9, ((A, B, ME), (C,))))
    assert judgement.unheard == {} and judgement.strikes == {} and judgement.voided == set()
    later = MembershipView(9, ((A, B, ME), (C,)))
    assert judgement.settle(later, {}, [(B, A, 8)], set(), ME)[0] == [(B, A, 8)]


def test_a_report_its_peer_outlived_stays_void_and_old_ones_are_forgotten() -> None:
    view = MembershipView(6, ((A, B, ME), (C,)))
    judgement = Judgement()
    kept = [(B, C, 4), (B, A, 5), (C, C, 4)]  # B survived round 4's report; round 5's acts at 7
    judgement.outlived(view, kept)
    assert judgement.voided == {(B, C, 4)}  # a leaver's own report is never voided
    assert judgement.settle(view, {}, [(B, C, 4), (B, A, 5)], set(), ME)[0] == [(B, A, 5)]
    far = MembershipView(6 + 2 + LATE_REPORT_ROUNDS + 5, view.stages)
    judgement.outlived(far, [])
    assert judgement.voided == set()  # forgotten: its round is below the watermark...
    assert judgement.settle(far, {}, [(B, C, 4)], set(), ME)[0] == []  # ...which voids it anyway


def test_reports_a_peer_filed_before_it_rejoined_count_for_nothing() -> None:
    """Cut off, C reported everyone it failed to reach in round 4, left, and rejoined at round 6:
    those reports were the odd one's; counted again now that C is a member, they would evict."""
    view = MembershipView(8, ((A, B, ME), (C,)))
    joined = {A: 0, B: 0, C: 6, ME: 0}
    reports = [(A, C, 4), (B, C, 4), (A, C, 7)]
    judgement = Judgement()
    assert judgement.doubtful(view, joined, reports) == {A}  # only round 7's, C's since its return
    assert judgement.settle(view, joined, reports, set(), ME)[0] == [(A, C, 7)]
