"""The step clock, the learning-rate schedule and frozen membership views."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from noloco_swarm.peer.joining import RunEnding, pick_join_round
from noloco_swarm.peer.views import PeerExcluded, raise_if_left_behind
from noloco_swarm.protocol.clock import StepClock, lr_at
from noloco_swarm.protocol.membership import (
    BUCKET_PEERS,
    Judgement,
    Listing,
    MembershipView,
    credible_gone,
    directory_bucket,
    entering,
    next_view,
    pending_joiners,
)


def test_rounds_and_outer_steps() -> None:
    clock = StepClock(inner_steps=50, batch_size=8)
    assert clock.round_of(0) == 0 and clock.round_of(49) == 0 and clock.round_of(50) == 1
    assert not clock.outer_step_due(0) and not clock.outer_step_due(49)
    assert clock.outer_step_due(50) and clock.outer_step_due(100)
    assert clock.round_start(2) == 100
    with pytest.raises(ValueError, match="inner_steps"):
        StepClock(inner_steps=0, batch_size=1)


def test_lr_schedule_warmup_then_cosine() -> None:
    kw = {"base_lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10, "total_steps": 110}
    assert lr_at(0, **kw) == pytest.approx(1e-4)
    assert lr_at(9, **kw) == pytest.approx(1e-3)
    assert lr_at(10, **kw) == pytest.approx(1e-3)
    assert lr_at(60, **kw) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, **kw) == pytest.approx(1e-4)
    assert lr_at(10_000, **kw) == pytest.approx(1e-4)
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))
    with pytest.raises(ValueError):
        lr_at(0, base_lr=1e-4, min_lr=1e-3, warmup_steps=0, total_steps=10)


def test_membership_ranks_are_sorted_ids() -> None:
    view = MembershipView.from_announcements(
        3, 2, [("peer-c", 0), ("peer-a", 0), ("peer-b", 1), ("peer-a", 0)]
    )
    assert view.stages == (("peer-a", "peer-c"), ("peer-b",))
    assert view.rank_of("peer-c") == (0, 1)
    assert view.peer_at(1, 0) == "peer-b"
    assert view.replica_counts() == [2, 1]
    assert view.least_served_stage() == 1
    assert view.least_served_stage((3, 1)) == 0  # stage 0 is one short of its 3, stage 1 is full
    assert view.is_complete()
    with pytest.raises(KeyError):
        view.rank_of("peer-z")


def test_membership_is_independent_of_announcement_order() -> None:
    ann = [(f"p{i}", i % 3) for i in range(9)]
    assert MembershipView.from_announcements(0, 3, ann) == MembershipView.from_announcements(0, 3, ann[::-1])


@pytest.mark.parametrize(
    ("ann", "message"),
    [
        ([("a", 2)], "outside"),
        ([("a", 0), ("a", 1)], "two stages"),
        ([("", 0)], "non-empty"),
    ],
)
def test_membership_rejects_bad_announcements(ann: list[tuple[str, int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MembershipView.from_announcements(0, 2, ann)


def test_membership_view_validates_directly() -> None:
    with pytest.raises(ValueError, match="sorted"):
        MembershipView(round=0, stages=(("b", "a"),))
    with pytest.raises(ValueError, match="more than one stage"):
        MembershipView(round=0, stages=(("a",), ("a",)))
    assert not MembershipView(round=0, stages=(("a",), ())).is_complete()


def _round3() -> MembershipView:
    return MembershipView(round=3, stages=(("a", "c"), ("b", "d")))


def test_next_view_keeps_listed_members_and_admits_joiners_at_their_round_or_once_read() -> None:
    listings = [
        Listing("a", 0, 0),
        Listing("b", 1, 0),
        Listing("c", 0, 2),
        Listing("d", 1, 0),
        Listing("e", 1, 4),  # joins now
        Listing("f", 0, 5),  # joins a round later: not yet
        Listing("g", 0, 2),  # entered at round 2, which this peer missed: admitted now
    ]
    view = next_view(_round3(), listings, gone={})
    assert view.round == 4
    assert view.stages == (("a", "c", "g"), ("b", "d", "e"))
    later = next_view(view, [*listings, Listing("e", 1, 4)], gone={})
    assert later.stages == (("a", "c", "f", "g"), ("b", "d", "e"))


def test_next_view_drops_reported_members_only_and_readmits_a_rejoin() -> None:
    listings = [Listing("a", 0, 0), Listing("b", 1, 0), Listing("d", 1, 1)]
    # c is missing from this read (a partial DHT answer is no evidence): it stays; d was reported
    # in round 2, so every member drops it at the end of round 3
    assert next_view(_round3(), listings, gone={"d": {2}}).stages == (("a", "c"), ("b",))
    # a report from the current round takes effect one boundary later, when everyone has read it
    view = next_view(_round3(), listings, gone={"c": {2}, "d": {3}})
    assert view.stages == (("a",), ("b", "d"))
    view = next_view(view, listings, gone={"c": {2}, "d": {3}})
    assert view.round == 5 and view.stages == (("a",), ("b",))
    # d, reported gone in round 3 but alive, announces round 7 and is admitted there
    rejoin = [*listings[:2], Listing("d", 1, 7)]
    v6 = next_view(view, rejoin, gone={"d": {3}})
    assert v6.round == 6 and "d" not in v6.members()
    assert next_view(v6, rejoin, gone={"d": {3}}).stages == (("a",), ("b", "d"))


def test_reports_of_one_death_in_different_rounds_give_every_peer_the_same_views() -> None:
    """d's partner saw it die in round 2, the others only in round 3: all reports stay on record,
    and the earliest that applies decides, for everyone, whatever its own report said."""
    listings = [Listing("a", 0, 0), Listing("b", 1, 0), Listing("c", 0, 0), Listing("d", 1, 0)]
    partner, others = {"d": {2}}, {"d": {3}}  # what each saw itself
    on_record = {"d": {2, 3}}  # both reports, read from the directory
    for own in (partner, others):
        seen = {p: on_record[p] | own[p] for p in on_record}
        assert next_view(_round3(), listings, seen).stages == (("a", "c"), ("b",))
    # a report of a membership before a rejoin does not evict the rejoined peer; a later one does
    rejoined = [*listings[:3], Listing("d", 1, 5)]
    v6 = _round3()
    for _ in range(3):
        v6 = next_view(v6, rejoined, on_record)
    assert v6.round == 6 and "d" in v6.members()
    assert (
        "d" not in next_view(next_view(v6, rejoined, {"d": {2, 3, 6}}), rejoined, {"d": {2, 3, 6}}).members()
    )


def test_next_view_ignores_stage_changes_and_out_of_range_stages() -> None:
    listings = [
        Listing("a", 1, 0),
        Listing("b", 1, 0),
        Listing("c", 0, 0),
        Listing("d", 1, 0),
        Listing("x", 9, 4),
    ]
    # a member must keep its stage; a listing claiming another one drops it (it would have to rejoin)
    assert next_view(_round3(), listings, gone={}).stages == (("c",), ("b", "d"))


@given(
    st.lists(st.tuples(st.sampled_from("abcdefgh"), st.integers(0, 2), st.integers(0, 6)), max_size=12),
    st.dictionaries(st.sampled_from("abcdefgh"), st.sets(st.integers(0, 6), max_size=3), max_size=4),
)
def test_next_view_is_order_independent_and_never_admits_the_reported(
    raw: list[tuple[str, int, int]], gone: dict[str, set[int]]
) -> None:
    first = {}
    for peer, stage, joined in raw:
        first.setdefault(peer, Listing(peer, stage, joined))
    listings = list(first.values())
    a = next_view(_round3(), listings, gone)
    assert a == next_view(_round3(), listings[::-1], gone)
    for peer in a.members():
        item = first.get(peer)
        if item is None or item.joined_round > a.round:  # unlisted, or its listed membership is to come
            stage, start = _round3().rank_of(peer)[0], 0
        else:
            stage, start = item.stage, item.joined_round
        assert stage == a.rank_of(peer)[0]
        assert not any(start <= r < 3 for r in gone.get(peer, ()))
    assert a.digest() != _round3().digest()


def test_a_cut_off_peer_reporting_everyone_evicts_nobody_but_itself() -> None:
    """c's link was cut in round 2: its senders a and b and its partner d reported it; once its link
    was back, c published its reports of all three. Only c is judged gone, whatever order the
    reports come in, and with c's reports or without them (peers that read the DHT before they
    landed judge the same)."""
    against_c = [("c", "a", 2), ("c", "b", 2), ("c", "d", 3)]
    by_c = [("a", "c", 2), ("b", "c", 2), ("d", "c", 2)]
    assert credible_gone(against_c + by_c) == credible_gone(by_c[::-1] + against_c) == {"c": {2, 3}}
    assert credible_gone(against_c) == {"c": {2, 3}}
    view = next_view(next_view(_round3(), [], credible_gone(against_c + by_c)), [], {"c": {2, 3}})
    assert view.stages == (("a",), ("b", "d"))


def test_credible_reports_keep_real_deaths_leavers_and_old_reports_by_the_judged() -> None:
    # two deaths seen by different numbers of peers: both gone
    assert credible_gone([("x", "a", 4), ("x", "b", 4), ("y", "a", 5)]) == {"x": {4}, "y": {5}}
    # x reported y long before x itself died: that report stands; x's reports after its death do not
    reports = [("x", "a", 5), ("x", "b", 5), ("y", "x", 2), ("a", "x", 5)]
    assert credible_gone(reports) == {"x": {5}, "y": {2}}
    # a leaver's report of itself always stands
    assert credible_gone([("l", "l", 3), ("a", "l", 3)]) == {"l": {3}, "a": {3}}
    # two peers reporting each other: the one accused first is judged, the late counter-report is not
    assert credible_gone([("b", "a", 3), ("a", "b", 4)]) == {"b": {3}}
    # ... and of a full tie, the least id (before 2026-12-07 both: one of them must leave, and
    # the other's reports of it fall with it)
    assert credible_gone([("b", "a", 3), ("a", "b", 3)]) == {"a": {3}}
    assert credible_gone([]) == {}


def test_a_member_that_stalls_in_a_partition_leaves_at_one_boundary_whatever_reports_arrived_last() -> None:
    """s stalls while c1 and c2 are cut off: in round 4 the cut-off pair (wrongly) and three
    members report each other, and in round 5 four members report s, whose reports reach some
    peers before the boundary that builds round 6 and others after. With them s has the most
    reporters and is judged before c1 and c2; their round-4 reports of s still fall (they were
    judged after it), so s is gone from round 5 on for every peer, and every peer keeps it in
    round 6 (the simulator's partition at N = 1,000 split one round here before)."""
    early = [("s", "c1", 4), ("s", "c2", 4)] + [(c, m, 4) for c in ("c1", "c2") for m in ("m5", "m6", "m7")]
    late = [("s", m, 5) for m in ("m1", "m2", "m3", "m4")]
    assert credible_gone(early + late) == {"s": {5}, "c1": {4}, "c2": {4}}
    assert credible_gone(early) == {"c1": {4}, "c2": {4}}
    round5 = MembershipView.from_announcements(
        5, 2, [("s", 0), ("c1", 0), ("c2", 1), *((f"m{i}", i % 2) for i in range(1, 8))]
    )
    assert next_view(round5, [], credible_gone(early + late)) == next_view(round5, [], credible_gone(early))
    assert "s" in next_view(round5, [], credible_gone(early + late)).members()


def test_a_death_reported_before_a_partition_stands_on_the_side_that_reports_its_reporters() -> None:
    """d died in round 3 and m1, m2, m3 reported it; in round 4 a cut-off pair reported those
    three, and (on the cut-off side) nobody reported the pair yet. The three are judged after d,
    but their round-3 reports were filed before anyone accused them: d is gone in round 3 on
    both sides, and both drop it from round 5 (the simulator's partition at N = 1,000 split a
    round here while reports one round before a later-judged reporter's accusation fell)."""
    death = [("d", m, 3) for m in ("m1", "m2", "m3")]
    cut = [(m, c, 4) for m in ("m1", "m2", "m3") for c in ("c1", "c2")]
    back = [(c, m, 4) for c in ("c1", "c2") for m in ("m4", "m5", "m6")]
    assert credible_gone(death + cut)["d"] == {3} == credible_gone(death + cut + back)["d"]
    round4 = MembershipView.from_announcements(
        4, 2, [("d", 0), ("c1", 0), ("c2", 1), *((f"m{i}", i % 2) for i in range(1, 7))]
    )
    views = [next_view(round4, [], credible_gone(seen)) for seen in (death + cut, death + cut + back)]
    assert views[0] == views[1] and "d" not in views[0].members()


@given(
    st.lists(st.tuples(st.sampled_from("abcde"), st.sampled_from("abcde"), st.integers(0, 6)), max_size=14)
)
def test_credible_reports_are_order_independent_and_a_subset_of_all_reports(
    reports: list[tuple[str, str, int]],
) -> None:
    judged = credible_gone(reports)
    assert judged == credible_gone(reports[::-1]) == credible_gone(sorted(reports))
    everything: dict[str, set[int]] = {}
    for peer, _, round_ in reports:
        everything.setdefault(peer, set()).add(round_)
    assert all(peer in everything and rounds <= everything[peer] for peer, rounds in judged.items())
    if reports:
        assert judged, "some peer is always judged when anyone was reported"


def test_a_joiner_aims_two_rounds_ahead_or_one_more_and_never_past_the_end() -> None:
    clock = StepClock(inner_steps=3, batch_size=4)
    assert pick_join_round(44, clock, end_step=120) == 16  # step 44 is in round 14
    assert pick_join_round(44, clock, end_step=120, later=1) == 17
    assert pick_join_round(44, clock, end_step=120, later=5) == 17  # donors refuse rounds further on
    with pytest.raises(RunEnding, match="before round 20"):
        pick_join_round(54, clock, end_step=60)


def test_a_peer_is_left_behind_once_a_member_is_two_rounds_past_its_round() -> None:
    clock = StepClock(inner_steps=3, batch_size=4)
    raise_if_left_behind(6, 2, clock, [])  # nobody answered: no evidence
    raise_if_left_behind(6, 2, clock, [7, 11])  # round 3 is one past ours: the others may wait for us
    with pytest.raises(PeerExcluded, match="at step 6, the swarm at step 12"):
        raise_if_left_behind(6, 2, clock, [7, 12])


def test_late_admission_needs_a_joiner_that_entered_and_a_re_announcing_member_stays() -> None:
    current = _round3()  # (("a", "c"), ("b", "d"))
    listings = [
        Listing("a", 0, 0),
        Listing("b", 1, 0),
        Listing("c", 0, 4),  # a member that announced a new membership for the next round
        Listing("d", 1, 0),
        Listing("g", 0, 2, entered=False),  # announced round 2, never got in (it retries later)
        Listing("h", 1, 1),  # entered round 1, which this peer missed
    ]
    view = next_view(current, listings, gone={})
    assert view.stages == (("a", "c"), ("b", "d", "h"))
    # c announced a round further ahead: it stays until then, as if nobody held that listing
    later = next_view(current, [*listings[:2], Listing("c", 0, 5), *listings[3:]], gone={})
    assert later == next_view(current, [*listings[:2], *listings[3:]], gone={})
    assert later.stages == (("a", "c"), ("b", "d", "h"))


def test_a_restarted_members_old_membership_ends_by_reports_or_at_its_new_round_not_by_timing() -> None:
    """A member killed in round 3 and restarted (same peer id) announces a new membership for round
    6, on stage 1. Whether a member holds that announcement at a boundary changes nothing before
    round 6: its old membership ends by the reports of its death (round 3: at view 5), judged as
    if the new listing were not there; at round 6 it enters with the new one, which those reports
    do not touch. Without reports the old one lasts until round 6."""
    current = _round3()  # (("a", "c"), ("b", "d"))
    back = Listing("c", 1, 6, entered=False)
    gone = {"c": [3]}
    for now in (current, next_view(current, [], gone)):
        assert next_view(now, [back], gone) == next_view(now, [], gone)
    four = next_view(current, [back], gone)
    five = next_view(four, [back], gone)
    assert four.stages == (("a", "c"), ("b", "d")) and five.stages == (("a",), ("b", "d"))
    assert next_view(five, [back], gone).stages == (("a",), ("b", "c", "d"))
    # nobody reported it: the old membership lasts until round 6, then it moves to stage 1
    quiet = next_view(next_view(current, [back], {}), [back], {})
    assert quiet.stages == (("a", "c"), ("b", "d"))
    six = next_view(quiet, [back], {})
    assert six.stages == (("a",), ("b", "c", "d"))
    assert entering(quiet, six, [back]) == {"c"} and entering(five, six, [back]) == {"c"}
    assert pending_joiners(quiet, 1, [back]) == ["c"] and pending_joiners(quiet, 0, [back]) == []
    assert pending_joiners(four, 1, [back]) == []  # kept only at the boundary before its round


def test_the_old_membership_of_a_restarted_member_is_judged_without_a_probe() -> None:
    """One report of a member that lists a later membership is not probed (its new process would
    answer for the old one, voiding a true report and striking its reporter), and it counts,
    though it is of a round before the listed membership began."""
    current = _round3()
    judgement = Judgement()
    report = ("c", "a", 2)
    assert judgement.doubtful(current, {"c": 0}, [report]) == {"c"}
    assert judgement.doubtful(current, {"c": 5}, [report]) == set()
    kept, voided = judgement.settle(current, {"c": 5}, [report], answered=set(), me="b")
    assert kept == [report] and voided == []


def _credible_gone_by_the_letter(reports: list[tuple[str, str, int]]) -> dict[str, set[int]]:
    """credible_gone's docstring, step by step: recount every standing report after each judgement
    (quadratic; the rule's first version, which a partition of 1,000 simulated peers made too slow)."""
    standing = {r for r in reports if r[0] != r[1]}
    earliest: dict[str, tuple[int, int]] = {}  # judged peer -> (its turn, its earliest accusation)
    then: dict[str, set[tuple[str, int]]] = {}  # judged peer -> (reporter, round) standing when judged
    while standing:
        support: dict[str, set[str]] = {}
        first: dict[str, int] = {}
        for peer, reporter, round_ in standing:
            support.setdefault(peer, set()).add(reporter)
            first[peer] = min(first.get(peer, round_), round_)
        most = max(len(r) for r in support.values())
        least = min(first[p] for p, r in support.items() if len(r) == most)
        judged = min(p for p, r in support.items() if len(r) == most and first[p] == least)
        then[judged] = {(reporter, round_) for peer, reporter, round_ in standing if peer == judged}
        earliest[judged] = (len(earliest), first[judged])
        standing = {
            (p, r, n) for p, r, n in standing if p != judged and not (r == judged and n >= first[judged] - 1)
        }
    gone: dict[str, set[int]] = {}
    for peer, held in then.items():  # the rounds of reports by peers judged after it fall too
        later = {r: first for r, (turn, first) in earliest.items() if turn > earliest[peer][0]}
        counted = {n for r, n in held if r not in later or n < later[r]}
        if counted:
            gone[peer] = counted
    for peer, reporter, round_ in reports:
        if peer == reporter:
            gone.setdefault(peer, set()).add(round_)
    return gone


@given(
    st.lists(
        st.tuples(st.sampled_from("abcdefg"), st.sampled_from("abcdefg"), st.integers(0, 6)), max_size=60
    )
)
def test_credible_gone_judges_as_its_rule_says_in_any_order(reports: list[tuple[str, str, int]]) -> None:
    expected = _credible_gone_by_the_letter(reports)
    assert credible_gone(reports) == expected
    assert credible_gone(reports[::-1] + reports[:3]) == expected  # order and repeats change nothing


def test_credible_gone_judges_the_cut_off_quarter_of_a_thousand() -> None:
    # A quarter of 1,000 peers cut off, each seen gone by 4 to 12 of the rest (the more, the
    # likelier judged first), each reporting 3 of the rest itself: the cut-off quarter is judged
    # gone, in 9 groups, and with each its reports about the rest fall.
    peers = [f"p{i:04d}" for i in range(1000)]
    cut, rest = peers[:250], peers[250:]
    reports = [(c, r, 7) for i, c in enumerate(cut) for r in rest[(i * 7) % 730 :][: 4 + i % 9]]
    reports += [(r, c, 7) for i, c in enumerate(cut) for r in rest[(i * 3) % 740 :][:3]]
    gone = credible_gone(reports)
    assert set(gone) == set(cut), sorted(set(gone) ^ set(cut))[:5]


def test_a_members_heartbeat_bucket_is_its_place_in_the_view_over_the_bucket_size() -> None:
    """Members stage after stage, each in rank order, BUCKET_PEERS to a bucket: every bucket but
    the last holds exactly that many, whatever the stages' sizes; a non-member has none."""
    stages = [
        [f"s{s}-{i:02d}" for i in range(n)] for s, n in enumerate((BUCKET_PEERS + 3, 5, 2 * BUCKET_PEERS))
    ]
    view = MembershipView.from_announcements(4, 3, [(p, s) for s, peers in enumerate(stages) for p in peers])
    assert directory_bucket(view, "s0-00") == 0
    assert directory_bucket(view, f"s0-{BUCKET_PEERS:02d}") == 1
    assert directory_bucket(view, "s1-00") == 1  # place BUCKET_PEERS + 3
    buckets = Counter(directory_bucket(view, p) for p in view.members())
    total = len(view.members())
    assert sorted(buckets) == list(range(-(-total // BUCKET_PEERS)))
    assert all(buckets[b] == BUCKET_PEERS for b in sorted(buckets)[:-1])
    assert directory_bucket(view, "a-joiner") is None and directory_bucket(None, "s0-00") is None
