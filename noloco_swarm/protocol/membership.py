"""A frozen per-round view of who serves which stage; a peer's rank is its place in sorted ids.

Peers announce (peer id, stage) in the DHT with an expiry. At each outer-round boundary every peer
builds this view from the live announcements; routes and groups then address replicas by rank, so
peers that saw the same announcements derive the same decisions without further messages.

Every margin, in rounds, that decides when a peer enters, leaves or is left behind is in the
table below, once; tests/unit/test_membership_margins.py ties them together.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# ---------------------------------------------------------------- the margins, in rounds
# A joiner enters this many rounds after the round of the furthest step it hears of, so that every
# member holds its announcement before that boundary (records reach peers at different times).
JOIN_MARGIN_ROUNDS = 2
# A joiner whose announcement the swarm outpaced aims at most this many rounds further.
JOIN_RETRY_ROUNDS = 1
# A member is left behind (out of the views, or soon) once another member is this many rounds past
# its round: one round apart is normal (a replica trains on until it needs our outer exchange).
LEFT_BEHIND_ROUNDS = 2
# A donor serves state for rounds at most this far past its own: a joiner's margin and retry,
# counted from a furthest member that may be a round ahead of the donor without leaving it behind.
DONOR_WINDOW_ROUNDS = JOIN_MARGIN_ROUNDS + JOIN_RETRY_ROUNDS + LEFT_BEHIND_ROUNDS - 1
# A gone report of round r drops its peer from the view of round r + REPORT_LAG_ROUNDS: one
# boundary late, so that every member has read the report by then (as with joiners).
REPORT_LAG_ROUNDS = 2
# Views a peer keeps: a request may name the round before ours or the next one.
KEEP_ROUNDS = 3
# A gone report of a peer that is still a member this many rounds after the boundary where it
# could first act is void: the swarm outlived it (and a peer forgets the reports it voided by then).
LATE_REPORT_ROUNDS = 10

# ---------------------------------------------------------------- judging gone reports
# Reports of one peer by this many distinct members stand without our probe: a peer cut off from
# the swarm (or frozen) answers again by the boundary, but everyone it failed has reported it, and
# it must leave (and rejoin) with all of them; two members would have to collude to evict one.
CORROBORATION = 2
# A member whose reports named this many live peers goes unheard for LIAR_ROUNDS rounds.
LIAR_STRIKES = 2
LIAR_ROUNDS = 20
# A member that fails its peers is reported by at most this many of the stages next to it, its
# monitors (see `monitors`): with every peer that noticed reporting, a swarm of N peers filed
# about N/2 reports per death and N^2/8 in a partition, and every member receives and weighs
# each one. Fewer reporters leave more reports to one reporter, decided by a probe whose answer
# depends on when each member probes: at 16 the simulator's slow DHT at N = 1,000 split a round.
MONITORS = 32

Report = tuple[str, str, int]  # (peer, reporter, round)

# ---------------------------------------------------------------- where heartbeats are stored
# A member's heartbeat goes to the DHT key of its bucket: the members of a view, stage after stage
# in rank order, cut into buckets of this many (peer/directory.py). Each key is written by at
# most this many peers, whatever the swarm's size (issue 36, item 4).
BUCKET_PEERS = 16
# A whole read of the directory takes the roster and buckets 0 and 1 first, then twice as many
# buckets as the wave before, until the last two of a wave are empty (one may be a lost store).
FIRST_WAVE = 2


@dataclass(frozen=True)
class MembershipView:
    """Replica sets of every stage for one outer round; `stages[s]` is sorted peer ids of stage s."""

    round: int
    stages: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        if self.round < 0:
            raise ValueError(f"round must be >= 0, got {self.round}")
        if not self.stages:
            raise ValueError("a membership view needs at least one stage")
        seen: set[str] = set()
        for stage, peers in enumerate(self.stages):
            if list(peers) != sorted(set(peers)):
                raise ValueError(f"stage {stage}: peer ids must be sorted and unique, got {peers}")
            if seen & set(peers):
                raise ValueError(f"peers {sorted(seen & set(peers))} appear in more than one stage")
            seen |= set(peers)

    @classmethod
    def from_announcements(
        cls, round_: int, num_stages: int, announcements: Iterable[tuple[str, int]]
    ) -> MembershipView:
        """Build the view from (peer id, stage) pairs; a peer listed twice must name one stage."""
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        stage_of: dict[str, int] = {}
        for peer, stage in announcements:
            if not isinstance(peer, str) or not peer:
                raise ValueError(f"peer id must be a non-empty string, got {peer!r}")
            if not 0 <= stage < num_stages:
                raise ValueError(f"peer {peer} announced stage {stage}, outside 0..{num_stages - 1}")
            if stage_of.setdefault(peer, stage) != stage:
                raise ValueError(f"peer {peer} announced two stages: {stage_of[peer]} and {stage}")
        stages = tuple(
            tuple(sorted(p for p, s in stage_of.items() if s == stage)) for stage in range(num_stages)
        )
        return cls(round=round_, stages=stages)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def replica_counts(self) -> list[int]:
        return [len(peers) for peers in self.stages]

    def is_complete(self) -> bool:
        """True when every stage has at least one replica (the pipeline can run)."""
        return all(self.stages)

    def rank_of(self, peer: str) -> tuple[int, int]:
        """(stage, rank) of a peer; KeyError if it is not a member this round."""
        for stage, peers in enumerate(self.stages):
            if peer in peers:
                return stage, peers.index(peer)
        raise KeyError(f"peer {peer} is not a member of round {self.round}")

    def peer_at(self, stage: int, rank: int) -> str:
        return self.stages[stage][rank]

    def digest(self) -> str:
        """Short fingerprint of round and stages: peers put it on requests to detect disagreement."""
        text = f"{self.round}|" + "|".join(",".join(peers) for peers in self.stages)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def members(self) -> set[str]:
        return {p for peers in self.stages for p in peers}

    def least_served_stage(self, targets: Sequence[int] | None = None) -> int:
        """`--stage auto`: the stage furthest below its target replica count (with no targets, the
        one with the fewest replicas); the lowest index on ties."""
        counts = self.replica_counts()
        goals = list(targets) if targets is not None else [0] * len(counts)
        deficits = [goal - count for goal, count in zip(goals, counts, strict=True)]
        return deficits.index(max(deficits))


@dataclass(frozen=True)
class Listing:
    """One live announcement as the view transition sees it."""

    peer: str
    stage: int
    joined_round: int
    # It reports a step at or past the first of `joined_round`: it entered that round (a joiner
    # that waits for its round, or never got in and announced a later one, has not).
    entered: bool = True


def next_view(
    current: MembershipView, listings: Iterable[Listing], gone: Mapping[str, Collection[int]]
) -> MembershipView:
    """The view of round `current.round + 1`, from this round's view and what the DHT lists now.

    - A member stays unless a report put it gone at a round at or after the round it joined
      and before this one (`gone[peer]`: every round it was reported in, by anyone; reports never
      replace each other, so peers that saw its death in different rounds still agree), or it now lists another stage (it would have to join
      again). A report takes effect one boundary late, for the same reason joiners announce two
      rounds ahead: every member has read it by then, so all drop the peer at the same boundary.
      Being absent
      from one read is not enough: a busy DHT returns partial reads, and evicting a live peer on
      one of them would split the swarm's views. Crashed peers are reported by the peers they fail.
    - A listed non-member enters at the round it announced (`joined_round == next`), so peers
      that read the DHT at slightly different moments still agree: joiners announce two rounds
      ahead and are visible to everyone long before their round. A peer that rejoins after a
      report announces a round after the report's.
    - A peer that missed a joiner at its round (its read failed, or the announcement reached it
      late) admits it at the first boundary where it reads that the joiner entered that round
      (`joined_round < next` and `entered`), unless it was reported since: the others admitted
      it, so this heals the split instead of keeping it for as long as the joiner lives. A
      joiner that nobody admitted never entered its round (it announces a later one); a peer
      that left reported itself, and stays out for that.
    - A member that announces a new membership (a peer restarted with `--resume` that the swarm
      outran, a rejoiner) enters with it at its round, and its old membership lasts until then
      unless reports end it first, judged as if the new one were not listed (`standing`). The
      announcement reaches members at different moments; before 2026-12-07 the old membership
      ended at the first boundary that held it, and members that held it on either side of a
      boundary built different views (test_faults' killed-while-checkpointing test, in CI).
    Pure: peers that saw the same listings and reports build the same view.
    """
    nxt = current.round + 1
    listed: dict[str, Listing] = {}
    for item in listings:
        listed.setdefault(item.peer, item)

    def reported(peer: str, joined_round: int) -> bool:
        return any(joined_round <= r <= nxt - REPORT_LAG_ROUNDS for r in gone.get(peer, ()))

    pairs = []
    for stage, peers in enumerate(current.stages):
        for peer in peers:
            item = listed.get(peer)
            start = standing(item.joined_round if item is not None else 0, current.round)
            if item is not None and item.joined_round == nxt:
                continue  # its new membership begins now: it enters through that (below)
            if item is not None and item.joined_round <= current.round and item.stage != stage:
                continue  # it lists another stage as begun: it would have to join again
            if not reported(peer, start):
                pairs.append((peer, stage))
    members = current.members()
    for item in listed.values():
        new = item.peer not in members or item.joined_round > current.round
        enters = new and (item.joined_round == nxt or (item.joined_round < nxt and item.entered))
        if enters and 0 <= item.stage < current.num_stages and not reported(item.peer, item.joined_round):
            pairs.append((item.peer, item.stage))
    return MembershipView.from_announcements(nxt, current.num_stages, pairs)


def standing(joined_round: int, now: int) -> int:
    """The round the membership a peer holds in round `now` began, from the round its newest
    listing names: a listing of a later round announces a membership still to come, and the one it
    holds now began before any listing we keep (0: every report of it counts)."""
    return 0 if joined_round > now else joined_round


def entering(current: MembershipView, view: MembershipView, listings: Iterable[Listing]) -> set[str]:
    """The members of `view` (the round after `current`) whose membership begins with it: peers new
    to the swarm, and members whose listed new membership begins now (a restarted peer)."""
    begins, before = {x.peer for x in listings if x.joined_round == view.round}, current.members()
    return {p for p in view.members() if p not in before or p in begins}


def pending_joiners(view: MembershipView, stage: int, listings: Iterable[Listing]) -> list[str]:
    """The peers listed for `stage` whose membership begins at the round after `view`'s, members of
    `view` or not: a donor of that stage keeps its state of this boundary for them."""
    return sorted({x.peer for x in listings if x.stage == stage and x.joined_round == view.round + 1})


def directory_bucket(view: MembershipView | None, peer: str) -> int | None:
    """The bucket `peer`'s heartbeat is stored under while `view` is its latest: its place among
    the view's members (stage after stage, each in rank order) over BUCKET_PEERS; None when it
    is no member (a joiner, or a founder before round 0), whose heartbeat goes to the run's roster."""
    if view is None or peer not in view.members():
        return None
    stage, rank = view.rank_of(peer)
    return (sum(len(peers) for peers in view.stages[:stage]) + rank) // BUCKET_PEERS


def monitors(view: MembershipView, peer: str) -> frozenset[str]:
    """The members of `view` that report `peer` gone when it fails them: the other members of its
    stage (one of them, its exchange partner, finds it at an outer exchange) and MONITORS of the
    members of the stages next to it (which route rows to it), the first by a hash of both ids,
    so that every member names the same ones and a peer's monitors stay put as others come and
    go. With up to MONITORS members in the stages next to it (every swarm of up to 16 replicas
    a stage), all of them. Empty for a non-member.

    Every member of a stage next to a dead peer finds it within a round or two (it routes some
    of its B x H rows there), and each filed a report: about N/2 per death at N = 1,000, N^2/8
    in a partition, every one received and weighed by every member. With monitors, a death costs
    at most MONITORS reports from those stages, and credible_gone still tells the two sides of a
    partition apart by their reporters: a peer cut off with a quarter of the swarm has three
    quarters of its monitors on the other side, a peer of the other side a quarter."""
    if peer not in view.members():
        return frozenset()
    stage = view.rank_of(peer)[0]
    near = [m for s in (stage - 1, stage + 1) if 0 <= s < view.num_stages for m in view.stages[s]]
    if len(near) > MONITORS:
        near = sorted(near, key=lambda member: hashlib.sha256(f"{peer}/{member}".encode()).digest())
    return frozenset(near[:MONITORS]) | (frozenset(view.stages[stage]) - {peer})


def newest(listings: Iterable[Listing]) -> list[Listing]:
    """One listing per peer, of its newest membership (the latest round it joined, entered before
    not yet), from listings read in several places (the DHT, records members passed on)."""
    best: dict[str, Listing] = {}
    for item in listings:
        held = best.get(item.peer)
        if held is None or (item.joined_round, item.entered) > (held.joined_round, held.entered):
            best[item.peer] = item
    return list(best.values())


def reports_to_weigh(
    current: MembershipView, reports: Iterable[Report], seen: Iterable[Report]
) -> list[Report]:
    """The gone reports a boundary weighs: those `current`'s members filed (a stranger's count
    for nothing) and a leaver's own, whoever reads it (it is no member once dropped, and late
    admission would take it back), with the ones this peer saw itself (`seen`: in case the DHT
    lost them)."""
    members = current.members()
    return [r for r in {*reports, *seen} if r[1] in members or r[0] == r[1]]


def founders(listings: Iterable[Listing], num_stages: int) -> MembershipView:
    """The view of round 0: the peers listed with `joined_round` 0 (stages outside the run ignored)."""
    pairs = [(x.peer, x.stage) for x in listings if x.joined_round == 0 and x.stage < num_stages]
    return MembershipView.from_announcements(0, num_stages, pairs)


def round_zero_complete(founders: MembershipView, counts: Sequence[int]) -> bool:
    """Every stage has its `counts[s]` founders: round 0 freezes, and a newcomer joins a later round."""
    return all(c >= n for c, n in zip(founders.replica_counts(), counts, strict=True))


def donor_serves(donor_round: int, round_: int) -> bool:
    """Does a donor in `donor_round` serve a joiner's request for the state of `round_`?"""
    return round_ <= donor_round + DONOR_WINDOW_ROUNDS


def credible_gone(reports: Iterable[tuple[str, str, int]]) -> dict[str, set[int]]:
    """peer -> the rounds it was credibly reported gone in, from (peer, reporter, round) reports.

    A peer cut off from the swarm (its link down, its process frozen) sees every peer it waits on
    fail and reports them all, once its link is back, while those peers report it. Counting every
    report would evict healthy peers on the word of the one that was cut off. So accusations are
    weighed: the peer reported by the most distinct reporters is judged gone first (on a tie, the
    one accused in the earliest round; on a full tie, the least peer id), and its own reports
    from one round before its earliest accusation on no longer count; repeat until no report is
    left. (Before 2026-12-07 a full tie judged all of them at once: two peers that reported each
    other both left, where one must, and the other's reports of it fall with it.)
    Then a judged peer is gone in the rounds of the reports of it that still count once every
    judgement is made: a report by a peer judged after it, from that peer's earliest accusation
    on, counts no more than one by a peer judged before it (and a judged peer left with no such
    round is not gone; the last one judged always keeps its own). Not from one round before:
    a member that truly reported a death in round r, and that a cut-off side reported in round
    r + 1, must not undo the death after the fact. The order of judgement follows the
    reporters' numbers, which reports filed in a boundary's last seconds can change at some
    peers and not others; the rounds a judged peer is gone in no longer do. (The simulator's
    case: a member that stalled while a partition lasted was reported by both sides, ranked among
    the cut-off peers where the latest reports had arrived, and kept their older reports of it.)
    A report by a peer about itself (it leaves) always stands. Pure and order-independent: peers
    that read the same reports judge the same peers gone.
    """
    gone: dict[str, set[int]] = {}
    leaving: dict[str, set[int]] = {}  # a peer -> the rounds it reported itself in
    accused: dict[str, dict[str, set[int]]] = {}  # accused -> reporter -> rounds, standing
    judged: dict[str, tuple[int, int]] = {}  # judged peer -> (its turn, its earliest accusation)
    support: dict[str, dict[str, set[int]]] = {}  # judged peer -> reporter -> rounds, standing then
    rounds: defaultdict[str, Counter[int]] = defaultdict(Counter)  # accused -> standing reports per round
    filed: dict[str, list[tuple[str, int]]] = {}  # reporter -> (accused, round), standing or not
    for peer, reporter, round_ in reports:
        if peer == reporter:
            leaving.setdefault(peer, set()).add(round_)
        elif round_ not in accused.setdefault(peer, {}).setdefault(reporter, set()):
            accused[peer][reporter].add(round_)
            rounds[peer][round_] += 1
            filed.setdefault(reporter, []).append((peer, round_))
    # The weighing, incrementally: a heap of (-reporters, earliest round, peer), one judged at a
    # time, whose stale entries are skipped; judging a peer withdraws its reports, which changes
    # only the peers they accuse.
    heap = [(-len(by), min(rounds[p]), p) for p, by in accused.items() if by]
    heapq.heapify(heap)

    def rank(peer: str) -> tuple[int, int]:
        return -len(accused[peer]), min(rounds[peer])

    while heap:
        count, first, peer = heapq.heappop(heap)
        if peer not in accused or rank(peer) != (count, first):
            continue  # stale
        support[peer] = accused.pop(peer)
        del rounds[peer]
        judged[peer] = (len(judged), first)
        touched = set()
        for p, round_ in filed.get(peer, ()):  # its reports from a round before `first` on fall
            by = accused.get(p)
            if by is None or round_ < first - 1 or round_ not in by.get(peer, ()):
                continue
            by[peer].discard(round_)
            if not by[peer]:
                del by[peer]
            rounds[p][round_] -= 1
            if not rounds[p][round_]:
                del rounds[p][round_]
            touched.add(p)
        for p in touched:
            if accused[p]:
                heapq.heappush(heap, (*rank(p), p))
            else:
                del accused[p], rounds[p]
    for peer, by in support.items():
        turn = judged[peer][0]
        later = {r: judged[r][1] for r in by if r in judged and judged[r][0] > turn}
        counted = {
            round_
            for reporter, when in by.items()
            for round_ in when
            if reporter not in later or round_ < later[reporter]
        }
        if counted:
            gone[peer] = counted
    for peer, when in leaving.items():
        gone.setdefault(peer, set()).update(when)
    return gone


@dataclass
class Judgement:
    """One peer's standing judgement of the gone reports it reads, kept across boundaries: the
    rule of peer/evidence.py without its probes (the caller probes `doubtful` and hands `settle`
    the accused that answered), so that the membership simulator runs the same rule.

    A report falls due once its round is over, if it is of a member and of a round at or after
    its membership began (`joined`: peer -> joined round, as listed): those are what `next_view`
    acts on. Reports of an accused whom CORROBORATION distinct members reported stand. Otherwise
    the accused is probed: if it answers, its reports are void for good and their reporters
    struck; a reporter with LIAR_STRIKES strikes goes unheard (its reports dropped unprobed) for
    LIAR_ROUNDS rounds. A peer reporting itself (it leaves) always stands.
    """

    voided: set[Report] = field(default_factory=set)  # reports of peers that answered a probe
    # Reports of members from rounds before this one are void (see adopt and outlived).
    settled_round: int = 0
    strikes: dict[str, int] = field(default_factory=dict)  # reporter -> live peers it reported
    unheard: dict[str, int] = field(default_factory=dict)  # reporter -> last round it is ignored

    def adopt(self, view: MembershipView) -> None:
        """We (re)join at `view`, a donor's: its members survived every report of a round up to
        view.round - REPORT_LAG_ROUNDS (the donor judged them; one that stood would have dropped
        them), so those reports are void here too. Without this, a newcomer reading two old
        reports at once lets them stand (two reporters), where the members had probed and voided
        them one at a time, and drops a member the others keep.

        What this peer judged before is dropped: a peer rejoins because the swarm left it out
        (cut off, typically), and the members it struck meanwhile had reported it truly; kept,
        those sentences made it ignore their reports for LIAR_ROUNDS and keep a dead member the
        others dropped (the simulator's partition, 41 rejoined peers of 128)."""
        self.voided.clear()
        self.strikes.clear()
        self.unheard.clear()
        self.settled_round = view.round - REPORT_LAG_ROUNDS + 1

    def view_after(
        self,
        current: MembershipView,
        me: Listing,
        listings: Iterable[Listing],
        kept: Sequence[Report],
        credible: Callable[[Sequence[Report]], Mapping[str, Collection[int]]] = credible_gone,
    ) -> MembershipView:
        """The view of the round after `current` from what `me` read and the reports `settle`
        kept (`credible`: credible_gone, or a memo of it); the reports it outlived are void from
        now on (`outlived`)."""
        view = next_view(current, [me, *listings], credible(kept))
        self.outlived(view, kept)
        return view

    def outlived(self, view: MembershipView, kept: Iterable[Report]) -> None:
        """After building `view` from `kept`: a report that could act on it (of a round up to
        view.round - REPORT_LAG_ROUNDS) and left its peer a member is void for good here, as it
        is for a newcomer whose donor built the same view (`adopt`). Otherwise credible_gone,
        weighing a set of reports that only grows, could revive it rounds later when newer
        reports judge its peer first: a member that a partition had accused survived the old
        reports, stalled ten rounds later, and the old ones evicted it a round before the new
        ones did at the newcomers (the simulator's partition). Reports LATE_REPORT_ROUNDS past
        that boundary are void by their round (`settled_round`), so the voided ones are forgotten."""
        members = view.members()
        for report in kept:
            if (
                report[0] != report[1]
                and report[0] in members
                and report[2] <= view.round - REPORT_LAG_ROUNDS
            ):
                self.voided.add(report)
        self.settled_round = max(self.settled_round, view.round - REPORT_LAG_ROUNDS - LATE_REPORT_ROUNDS)
        self.voided = {r for r in self.voided if r[2] >= self.settled_round}

    def _settled(self, report: Report, joined: Mapping[str, int], members: Collection[str]) -> bool:
        """Void without a probe: of a member, from a round before `settled_round`; or filed by its
        reporter before its membership began (`joined`, as listed): a peer that rejoined was the odd one out when
        it wrote them (cut off, it reported everyone it failed to reach), and the members'
        reports of it then made it leave. Counted again once it is back, they evicted 60 of 128
        peers in the simulator's partition."""
        peer, reporter, round_ = report
        if peer == reporter:
            return False  # a peer that leaves always stands
        return (round_ < self.settled_round and peer in members) or joined.get(reporter, 0) > round_

    def _due(
        self, current: MembershipView, joined: Mapping[str, int], reports: Iterable[Report]
    ) -> list[Report]:
        members, now = current.members(), current.round
        return [
            r
            for r in reports
            if r[0] != r[1]
            and r[0] in members
            and standing(joined.get(r[0], 0), now) <= r[2] < now
            and r not in self.voided
            and not self._settled(r, joined, members)
        ]

    def _unheard(self, reports: Iterable[Report], now: int) -> set[Report]:
        return {r for r in reports if self.unheard.get(r[1], -1) >= now}

    def doubtful(
        self, current: MembershipView, joined: Mapping[str, int], reports: Iterable[Report]
    ) -> set[str]:
        """The accused to probe before this boundary's view: reported by fewer than CORROBORATION
        distinct members that are heard. Not one that lists a membership still to come: by its
        own word the process of its old one is gone, and its new one would answer for it."""
        due = self._due(current, joined, reports)
        reporters: dict[str, set[str]] = {}
        for peer, reporter, _ in set(due) - self._unheard(due, current.round):
            reporters.setdefault(peer, set()).add(reporter)
        return {
            peer
            for peer, who in reporters.items()
            if len(who) < CORROBORATION and joined.get(peer, 0) <= current.round
        }

    def settle(
        self,
        current: MembershipView,
        joined: Mapping[str, int],
        reports: Sequence[Report],
        answered: Collection[str],
        me: str,
    ) -> tuple[list[Report], list[Report]]:
        """(the reports this boundary's view may act on, the reports voided now) once the accused
        in `answered` answered our probes (ourselves included: reports of us are void, we run)."""
        now = current.round
        due = self._due(current, joined, reports)
        unheard = self._unheard(due, now)
        voided = sorted(r for r in due if r[0] in answered)
        for peer, reporter, round_ in voided:
            self.voided.add((peer, reporter, round_))
            self.strikes[reporter] = self.strikes.get(reporter, 0) + (reporter != me)
            if self.strikes[reporter] >= LIAR_STRIKES:
                self.unheard[reporter] = now + LIAR_ROUNDS
                self.strikes[reporter] = 0
        members = current.members()
        kept = [
            r
            for r in reports
            if r not in self.voided and r not in unheard and not self._settled(r, joined, members)
        ]
        return kept, voided
