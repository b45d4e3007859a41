"""Who serves which stage in each round, as one peer sees it.

A peer keeps the frozen views of the last few rounds (routes and groups of step t come from the
view of t's round), and builds the next one at every boundary from the records members passed
it (peer/passing.py) with the pure rule `protocol.membership.next_view`. The margins that decide
when a peer enters, leaves or is left behind are protocol/membership.py's table; whom this peer
judged gone is liveness.py's.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Iterable

from noloco_swarm.peer import events, failpoints
from noloco_swarm.peer.directory import RunDirectory
from noloco_swarm.peer.liveness import DHT_ERRORS, Liveness
from noloco_swarm.peer.net.transport import Transport
from noloco_swarm.peer.passing import Passing
from noloco_swarm.peer.tickets import Gate
from noloco_swarm.protocol import records
from noloco_swarm.protocol.clock import StepClock
from noloco_swarm.protocol.codec import MessageError
from noloco_swarm.protocol.membership import (
    KEEP_ROUNDS,
    LEFT_BEHIND_ROUNDS,
    Listing,
    MembershipView,
    directory_bucket,
    entering,
    founders,
    monitors,
    newest,
    reports_to_weigh,
    round_zero_complete,
)

logger = logging.getLogger(__name__)

# How often a founding peer reads the directory until round 0 is complete: the peers start
# training within about this much of each other, and the first step waits for the last.
FREEZE_POLL = 0.1
# What a boundary builds the next view from: the listings and (peer, reporter, round) reports of
# the records members passed us (peer/passing.py), as we hold them at the boundary.
Held = tuple[list[Listing], list[tuple[str, str, int]]]
# At a boundary a peer asks a neighbour for the records it lacks, for at most this long, beside
# the outer exchange: a member that was stopped or cut off while a round's records were passed
# gets them so (the membership simulator: without it a thawed peer kept itself for a round).
PULL_TIMEOUT = 2.0
# A peer whose address we lack is looked up in the directory at most this often (Rounds.look_up).
LOOK_UP_EVERY = 10.0


class PeerExcluded(RuntimeError):
    """The swarm's next view leaves this (live) peer out, e.g. after a gone report: join again."""


def raise_if_left_behind(t: int, round_: int, clock: StepClock, steps: Iterable[int]) -> None:
    """We are at step t of `round_` and other members report `steps`: if one is LEFT_BEHIND_ROUNDS
    rounds past ours, the swarm trained on without us and we are out of its views, or soon will
    be. Raise PeerExcluded, to rejoin now instead of waiting on (or sending to) steps they left long ago."""
    furthest = max(steps, default=t)
    if furthest >= clock.round_start(round_ + LEFT_BEHIND_ROUNDS):
        raise PeerExcluded(f"this peer fell behind: it is at step {t}, the swarm at step {furthest}")


class Rounds(Liveness):
    """One peer's per-round views of the swarm, on its record of peers that failed it (Liveness)."""

    def __init__(
        self,
        me: str,
        stage: int,
        num_stages: int,
        transport: Transport,
        directory: RunDirectory,
        sink: events.Events,
    ) -> None:
        super().__init__(me, stage, transport, directory, sink)
        self.num_stages = num_stages
        self.views: dict[int, MembershipView] = {}  # round -> frozen view
        self._ready: dict[int, asyncio.Event] = {}
        self._looked_up: dict[str, float] = {}  # peer -> when we last read its address (monotonic)
        self.gate: Gate | None = None  # a closed run's: members are peers with a valid ticket
        # The round this peer joins at while it has no view (a restarted member that the views
        # may still hold under its old membership gets its rows and exchanges: refused at once).
        self.joining_at: int | None = None
        self.passing = Passing(
            directory.identity, transport, directory.run_id, self._neighbours, self._members
        )

    @property
    def inner_steps(self) -> int:
        """H, for whether a listed peer entered its round (0: trust that it did)."""
        return self.passing.book.inner_steps

    @inner_steps.setter
    def inner_steps(self, value: int) -> None:
        self.passing.book.inner_steps = value

    def _neighbours(self) -> list[str]:
        """Whom we pass records to: the members of the stages next to ours in our latest view
        (those we exchange rows with), or with one stage the other members."""
        view = self.latest()
        if view is None:
            return []
        near = [self.stage - 1, self.stage + 1] if view.num_stages > 1 else [self.stage]
        return [p for s in near if 0 <= s < view.num_stages for p in view.stages[s] if p != self.me]

    def _members(self) -> set[str]:
        return {p for view in self.views.values() for p in view.members()}

    def files(self, peer: str) -> bool:
        """We report a peer that failed us only as one of its monitors in our latest view
        (protocol.membership.monitors: its stage, and at most MONITORS of the stages next to it);
        the others route around it and leave the report to them. Without a view, always."""
        view = self.latest()
        return view is None or self.me in monitors(view, peer)

    def adopt(self, view: MembershipView) -> None:
        """Take a donor's view on (re)joining: its members are alive by the swarm's consensus, so
        whom we marked gone before (while cut off, typically the whole swarm) is forgotten. Kept,
        those marks made us skip every row from them: a rejoined peer ran its steps empty. The
        gone reports the donor settled before this view are settled for us too (Judgement.adopt)."""
        self.dead.clear()
        self.detours.forget_all()
        self.evidence.judgement.adopt(view)
        self.set(view)

    def set(self, view: MembershipView) -> None:
        """Freeze `view` for its round (and forget rounds long past)."""
        self.views[view.round] = view
        for old in [r for r in self.views if r <= view.round - KEEP_ROUNDS]:
            del self.views[old]
            self._ready.pop(old, None)
        self.round = max(self.views)
        self.passing.at_round(self.round)
        self.events.emit(
            events.Membership(
                round=view.round,
                stages=[list(s) for s in view.stages],
                rank=view.rank_of(self.me)[1],
                peer_id=self.me,
            )
        )
        self._event(view.round).set()

    def at(self, round_: int) -> MembershipView:
        return self.views[round_]

    def latest(self) -> MembershipView | None:
        return self.views[max(self.views)] if self.views else None

    async def wait(self, round_: int, timeout: float) -> MembershipView:
        """The view of `round_`, waiting (up to `timeout`) if we have not reached that round yet."""
        if round_ not in self.views and self.views and round_ < max(self.views):
            raise MessageError(f"round {round_} is over for this peer")
        if not self.views and self.joining_at is not None and round_ < self.joining_at:
            raise MessageError(f"this peer joins at round {self.joining_at}; it serves no round before")
        if round_ not in self.views:
            try:
                await asyncio.wait_for(self._event(round_).wait(), timeout)
            except TimeoutError as e:
                raise MessageError(f"this peer has no view of round {round_} yet") from e
        if round_ not in self.views:
            raise MessageError(f"round {round_} is over for this peer")
        return self.views[round_]

    def _event(self, round_: int) -> asyncio.Event:
        return self._ready.setdefault(round_, asyncio.Event())

    # ------------------------------------------------------------------ reading the directory

    def read_peers(self) -> list[records.PeerAnnouncement]:
        """Live announcements (blocking: call in a thread); remembers everyone's addresses. In a
        closed run, only those with a valid ticket (whose peers the gate then admits)."""
        return self._admitted(self.directory.read_peers().announcements)

    def _admitted(self, announcements: list[records.PeerAnnouncement]) -> list[records.PeerAnnouncement]:
        """In a closed run, only announcements with a valid ticket; remembers their addresses."""
        if self.gate is not None:
            announcements = [a for a in announcements if self.gate.admit_announced(a)]
        for a in announcements:
            self.addresses[a.peer_id] = a.addresses
        return announcements

    async def look_up(self, peer: str) -> tuple[str, ...]:
        """`peer`'s announced addresses, read from its bucket in our latest view and the roster
        (one DHT read, at most once per LOOK_UP_EVERY seconds a peer): a peer that joined through
        a member knows the addresses of its neighbourhood only (peer/neighbourhood.py), and a
        boundary may probe any accused member."""
        now = time.monotonic()
        if now - self._looked_up.get(peer, -math.inf) < LOOK_UP_EVERY:
            return self.addresses.get(peer, ())
        self._looked_up[peer] = now
        buckets = {directory_bucket(view, peer) for view in self.views.values()} | {None}
        try:
            for bucket in sorted(buckets, key=lambda b: -1 if b is None else b):
                await asyncio.to_thread(lambda b=bucket: self._admitted(self.directory.read_bucket(b)))
                if peer in self.addresses:
                    break
        except DHT_ERRORS as e:
            logger.info("could not read %s's address from the directory: %s", peer, e)
        return self.addresses.get(peer, ())

    def run_in_progress(self, announcements: list[records.PeerAnnouncement], counts: tuple[int, ...]) -> bool:
        """True when round 0 is already complete (or past): a newcomer must join a later round."""
        others = [a for a in announcements if a.peer_id != self.me]
        if any(a.step > 0 or a.joined_round > 0 for a in others):
            return True
        listings = [Listing(a.peer_id, a.stage, a.joined_round) for a in others]
        return round_zero_complete(founders(listings, self.num_stages), counts)

    async def freeze_round_zero(self, counts: tuple[int, ...], timeout: float) -> MembershipView:
        """Wait until every stage has its `counts[s]` peers announced for round 0, then freeze it."""
        deadline = time.monotonic() + timeout
        while True:
            announcements = await asyncio.to_thread(self.read_peers)
            view = founders(
                [Listing(a.peer_id, a.stage, a.joined_round) for a in announcements], self.num_stages
            )
            there = view.replica_counts()
            if round_zero_complete(view, counts):
                if any(c > n for c, n in zip(there, counts, strict=True)):
                    raise RuntimeError(
                        f"more peers than the run's {list(counts)} announced for round 0: {there}"
                    )
                self.set(view)
                return view
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {there} peers per stage after {timeout:.0f} s; need {list(counts)}")
            await asyncio.sleep(FREEZE_POLL)

    async def gather_records(self) -> Held:
        """The records that decide the next view: those members passed us during the round, and
        what one neighbour holds that we lack (asked now). No DHT read: every record that can
        change a view is passed from member to member within seconds (peer/passing.py), so the
        whole directory, N records read by each of N peers every round, is read only by
        founders before round 0, joiners that no member answers (peer/neighbourhood.py) or that
        join a closed run, and `noloco status` (issue 36, item 4). The loop
        starts this at the boundary, beside the outer exchange, which hides the neighbour's round
        trip; the records are taken as held then, not when the view is built (after the exchange,
        which may wait seconds for a partner), so that what reaches us meanwhile counts at the
        next boundary at every member alike."""
        if failpoints.fire("false_report", "rpc_records"):  # a test's lying member
            self._lie()
        near = [p for p in self._neighbours() if p not in self.dead]
        order = sorted(near, key=lambda p: hashlib.sha256(f"{self.me}/{self.round}/{p}".encode()).digest())
        await self.passing.pull(order, PULL_TIMEOUT)
        book = self.passing.book
        return self._listings(book.listed()), book.gone()

    def _lie(self) -> None:
        """Failpoint false_report: pass a report that a live member of the next stage (or the
        previous, on the last) is gone in our round, and nothing else."""
        view = self.latest()
        if view is None or view.num_stages < 2:
            return
        stage = self.stage + 1 if self.stage + 1 < view.num_stages else self.stage - 1
        victim = view.stages[stage][-1]
        logger.warning(
            "failpoint false_report:rpc_records: reporting %s gone in round %d", victim, view.round
        )
        self.passing.own(records.GoneReport(self.directory.run_id, victim, self.me, view.round))

    async def next(self, current: MembershipView, joined_round: int, held: Held) -> MembershipView:
        """The view of the round after `current`, by the rule every peer applies (not yet frozen),
        from `held` (gathered at the boundary: see gather_records).

        Raises PeerExcluded if it leaves us out or a stage has nobody left (see below).
        """
        listings, reports = newest(held[0]), held[1]
        # What we saw ourselves counts too, in case a report of ours was not passed (weighed with
        # the rest). A member that died is found by the peers it fails: those that route rows to
        # it, and its exchange partner.
        seen = [(peer, self.me, round_) for peer, round_ in self.dead.items() if peer in self.filed]
        joined = {item.peer: item.joined_round for item in listings}
        due = reports_to_weigh(current, reports, seen)
        kept = await self.evidence.weigh(current, joined, due, self.alive)
        for peer in self.evidence.live:
            self.dead.pop(peer, None)  # one we marked gone answers again: a member like any other
            self.detours.forget(peer)
        view = self.evidence.judgement.view_after(
            current, Listing(self.me, self.stage, joined_round), listings, kept
        )
        for peer in entering(current, view, listings):
            self.dead.pop(peer, None)  # a peer that rejoined is a member again
        if self.me not in view.members():
            raise PeerExcluded(f"the view of round {view.round} leaves this peer out (reported gone?)")
        self.detours.check_reported(view, kept, self.hearsay)
        if not view.is_complete():
            # Every replica of a stage gone at once is more likely our own link cut off than all
            # of them dead: join again, which finds the live swarm or says no replica is left.
            empty = [s for s, peers in enumerate(view.stages) if not peers]
            raise PeerExcluded(
                f"stage(s) {empty} have no live replica in this peer's view of round {view.round} "
                "(was this peer cut off?)"
            )
        return view

    def _listings(self, announcements: list[records.PeerAnnouncement]) -> list[Listing]:
        """The admitted ones of `announcements` as the view rule reads them: whether each peer
        entered its round is whether its step has reached the round's first."""
        return [
            Listing(a.peer_id, a.stage, a.joined_round, self.passing.book.entered(a))
            for a in self._admitted(announcements)
        ]
