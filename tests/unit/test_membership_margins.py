"""The membership margins (protocol/membership.py's table) hold together: a joiner's round is one
every member reads in time and every live donor still serves, the left-behind rule spares members
that keep up and peers that joined by the rule, a gone report and a rejoin land where the margins
say, and a newcomer and the founders agree on when round 0 is complete."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from noloco_swarm.peer.events import Events
from noloco_swarm.peer.joining import pick_join_round
from noloco_swarm.peer.views import PeerExcluded, Rounds, raise_if_left_behind
from noloco_swarm.protocol.clock import StepClock
from noloco_swarm.protocol.codec import MessageError
from noloco_swarm.protocol.membership import (
    DONOR_WINDOW_ROUNDS,
    JOIN_MARGIN_ROUNDS,
    JOIN_RETRY_ROUNDS,
    KEEP_ROUNDS,
    LEFT_BEHIND_ROUNDS,
    REPORT_LAG_ROUNDS,
    Listing,
    MembershipView,
    donor_serves,
    next_view,
)
from noloco_swarm.protocol.records import PeerAnnouncement

NEVER = 10**12  # the end step of a run that outlasts every test here
inner_steps = st.integers(1, 12)
steps = st.integers(0, 5_000)
retries = st.integers(0, 4)  # how often the swarm outpaced a joiner's announcement


def left_behind(t: int, round_: int, clock: StepClock, furthest: int) -> bool:
    try:
        raise_if_left_behind(t, round_, clock, [furthest])
    except PeerExcluded:
        return True
    return False


@given(inner_steps, steps, st.integers(0, 40), retries)
def test_a_joiners_round_is_read_in_time_and_every_live_donor_serves_it(
    h: int, furthest: int, lag: int, later: int
) -> None:
    clock = StepClock(inner_steps=h, batch_size=1)
    target = pick_join_round(furthest, clock, end_step=NEVER, later=later)
    # Every member is a whole round short of the joiner's boundary: all read its announcement.
    assert clock.round_start(target - 1) > furthest
    # A donor is any member the furthest one has not left behind; it serves the joiner's round.
    donor = max(0, furthest - lag)
    if not left_behind(donor, clock.round_of(donor), clock, furthest):
        assert donor_serves(clock.round_of(donor), target), (donor, furthest, target)


def test_the_donor_window_is_as_wide_as_the_worst_joiner_needs() -> None:
    """A donor one round behind the furthest member, and a joiner on its last retry: exactly the
    window. (Wider would only let a joiner fetch a round the swarm may never reach in time.)"""
    clock = StepClock(inner_steps=5, batch_size=1)
    donor_round = 7
    furthest = clock.round_start(donor_round + LEFT_BEHIND_ROUNDS) - 1  # the most it may be ahead
    assert not left_behind(clock.round_start(donor_round), donor_round, clock, furthest)
    target = pick_join_round(furthest, clock, end_step=NEVER, later=JOIN_RETRY_ROUNDS)
    assert target == donor_round + DONOR_WINDOW_ROUNDS
    assert donor_serves(donor_round, target) and not donor_serves(donor_round, target + 1)


@given(inner_steps, st.integers(0, 400), st.data())
def test_the_left_behind_rule_spares_members_that_keep_up(h: int, round_: int, data: st.DataObject) -> None:
    """While we are anywhere in round r, another member may train past the boundary that ends it
    until it needs our outer exchange: at most k < H steps later (outer.overlap_steps). It must
    not push us out."""
    clock = StepClock(inner_steps=h, batch_size=1)
    t = data.draw(st.integers(clock.round_start(round_), clock.round_start(round_ + 1) - 1))
    overlap = data.draw(st.integers(0, h - 1))
    ahead = data.draw(st.integers(t, clock.round_start(round_ + 1) + overlap))
    assert not left_behind(t, round_, clock, ahead)
    # And a member LEFT_BEHIND_ROUNDS rounds ahead does push us out.
    assert left_behind(t, round_, clock, clock.round_start(round_ + LEFT_BEHIND_ROUNDS))


@given(inner_steps, steps, retries, st.data())
def test_a_peer_that_joined_by_the_rule_is_not_left_behind(
    h: int, furthest: int, later: int, data: st.DataObject
) -> None:
    """A joiner starts at its round's first step, its donors in that round (they keep a snapshot
    for the current round only), the swarm before that round's start when it last looked
    (join_late checks), and then no further than a member that keeps up with it."""
    clock = StepClock(inner_steps=h, batch_size=1)
    target = pick_join_round(furthest, clock, end_step=NEVER, later=later)
    start = clock.round_start(target)
    assert not left_behind(start, target, clock, furthest)
    overlap = data.draw(st.integers(0, h - 1))
    member = data.draw(st.integers(start, clock.round_start(target + 1) + overlap))
    assert not left_behind(start, target, clock, member)
    # The donors' view of the joiner's round is still kept while a member may be ahead of it.
    assert clock.round_of(member) - target < KEEP_ROUNDS


def views_from(view: MembershipView, listings: list[Listing], gone: dict[str, set[int]], until: int) -> dict:
    views = {view.round: view}
    while view.round < until:
        view = next_view(view, listings, gone)
        views[view.round] = view
    return views


@given(st.integers(0, 30), st.integers(0, 3))
def test_a_gone_report_drops_its_peer_after_the_lag_and_every_member_read_it(
    reported: int, joined: int
) -> None:
    joined = min(joined, reported)  # a report counts from the round the peer joined
    listings = [Listing("a", 0, joined), Listing("b", 0, 0)]
    start = MembershipView(joined, (("a", "b"),))
    views = views_from(start, listings, {"a": {reported}}, reported + REPORT_LAG_ROUNDS + 1)
    # A member that read the report only at the next boundary still agrees: the view after the
    # report's round keeps the peer, and the one REPORT_LAG_ROUNDS after drops it, for everyone.
    assert "a" in views[reported + 1].members()
    assert all("a" in views[r].members() for r in range(joined, reported + REPORT_LAG_ROUNDS))
    assert all("a" not in views[r].members() for r in range(reported + REPORT_LAG_ROUNDS, max(views) + 1))


@given(inner_steps, st.integers(0, 30), st.integers(0, 40), retries)
def test_a_reported_peer_that_rejoins_by_the_rule_is_admitted_at_its_round(
    h: int, reported: int, since: int, later: int
) -> None:
    """It was reported in round r, so the swarm it asks is at round r or later: the round it picks
    is past the report's, which then no longer bars it. Its old membership ends by the report, as
    any member's would (REPORT_LAG_ROUNDS later), whether or not a member holds its new listing."""
    clock = StepClock(inner_steps=h, batch_size=1)
    furthest = clock.round_start(reported) + since
    target = pick_join_round(furthest, clock, end_step=NEVER, later=later)
    assert target >= reported + JOIN_MARGIN_ROUNDS
    listings = [Listing("a", 0, target), Listing("b", 0, 0)]
    views = views_from(MembershipView(reported, (("a", "b"),)), listings, {"a": {reported}}, target)
    assert "a" in views[target].members()
    assert all("a" not in views[r].members() for r in range(reported + REPORT_LAG_ROUNDS, target))
    unlisted = views_from(MembershipView(reported, (("a", "b"),)), listings[1:], {"a": {reported}}, target)
    assert all(views[r] == unlisted[r] for r in range(reported + 1, target))


def announcement(peer: str, stage: int, joined_round: int = 0, step: int = 0) -> PeerAnnouncement:
    return PeerAnnouncement("run", peer, stage, joined_round, step=step)


class Listed:
    """A directory whose read returns fixed announcements (and that writes nothing)."""

    identity = None
    run_id = "run"

    def __init__(self, announcements: list[PeerAnnouncement]) -> None:
        self.announcements = announcements

    def read_peers(self) -> Listed:
        return self


def rounds_of(me: str, stage: int, num_stages: int, announcements: list[PeerAnnouncement]) -> Rounds:
    unserved = SimpleNamespace(peer_id=me, register=lambda verb, handler: None)  # nobody calls these
    return Rounds(me, stage, num_stages, unserved, Listed(announcements), Events())


def freezes(founder: Rounds, counts: tuple[int, ...]) -> str:
    """What a founder's freeze of round 0 does with what is listed now: 'frozen', 'overfull' or 'waits'."""
    try:
        asyncio.run(founder.freeze_round_zero(counts, timeout=-1.0))
    except TimeoutError:
        return "waits"
    except RuntimeError:
        return "overfull"
    return "frozen"


@given(
    st.lists(st.integers(1, 3), min_size=1, max_size=3).flatmap(
        lambda counts: st.tuples(st.just(tuple(counts)), st.tuples(*(st.integers(0, c + 1) for c in counts)))
    ),
    st.booleans(),
)
def test_a_newcomer_and_the_founders_agree_when_round_zero_is_complete(
    counts_there: tuple[tuple[int, ...], tuple[int, ...]], stray: bool
) -> None:
    counts, there = counts_there
    founders = [announcement(f"f{s}-{i}", s) for s, n in enumerate(there) for i in range(n)]
    if stray:  # a peer of a stage the run does not have, announced for round 0: it counts nowhere
        founders.append(announcement("zz-stray", len(counts)))
    late = rounds_of("newcomer", 0, len(counts), []).run_in_progress(founders, counts)
    if not any(there):
        assert not late
        return
    founder = rounds_of(founders[0].peer_id, founders[0].stage, len(counts), founders)
    outcome = freezes(founder, counts)
    assert late == (outcome != "waits")
    if outcome == "frozen":
        assert founder.at(0).replica_counts() == list(counts)


def test_a_run_past_round_zero_is_in_progress_whatever_round_zero_had() -> None:
    counts = (2, 2)
    newcomer = rounds_of("newcomer", 0, 2, [])
    assert not newcomer.run_in_progress([announcement("a", 0)], counts)
    assert newcomer.run_in_progress([announcement("a", 0, step=1)], counts)
    assert newcomer.run_in_progress([announcement("a", 0, joined_round=3)], counts)
    # Its own announcement does not count: it cannot be one of the founders it waits for.
    full = [announcement(p, s) for p, s in [("a", 0), ("b", 0), ("c", 1), ("newcomer", 1)]]
    assert not newcomer.run_in_progress(full, counts)


def test_a_peer_that_left_stays_out_while_its_announcement_lives() -> None:
    """x reported itself leaving in round 2 and the views dropped it at round 4; its announcement
    lives on for a heartbeat's TTL. Late admission must not take it back: its own report is no
    stranger's, so it still counts once x is no longer a member."""
    me = rounds_of("me", 0, 2, [])
    current = MembershipView(4, (("a", "me"), ("b",)))
    listings = [Listing("a", 0, 0), Listing("b", 1, 0), Listing("x", 1, 0)]
    view = asyncio.run(me.next(current, 0, (listings, [("x", "x", 2)], [], [])))
    assert view.stages == (("a", "me"), ("b",))
    # a joiner that missed its round is admitted late, a leaver is not
    joiner = asyncio.run(me.next(view, 0, ([*listings, Listing("y", 1, 4)], [("x", "x", 2)], [], [])))
    assert joiner.stages == (("a", "me"), ("b", "y"))


def test_a_joiner_refuses_a_round_before_its_own_at_once_and_waits_for_its_own() -> None:
    """A restarted member that joins at round 5 may still be in the views of rounds 3 and 4 under
    its old membership: rows sent to it there are refused at once, not after the step deadline."""
    joiner = rounds_of("c", 1, 2, [])
    joiner.joining_at = 5

    async def asks(round_: int) -> str:
        try:
            await joiner.wait(round_, timeout=0.05)
        except MessageError as e:
            return str(e)
        return "served"

    assert asyncio.run(asks(4)) == "this peer joins at round 5; it serves no round before"
    assert asyncio.run(asks(5)) == "this peer has no view of round 5 yet"  # its own: it waits
    joiner.adopt(MembershipView(5, (("a",), ("b", "c"))))
    assert asyncio.run(asks(5)) == "served"
    assert asyncio.run(asks(4)) == "round 4 is over for this peer"
