"""Who serves which stage in each round, as one peer sees it, and which peers have failed it.

A peer keeps the frozen views of the last few rounds (routes and groups of step t come from the
view of t's round), builds the next one at every boundary from the run's directory with the pure
rule `protocol.membership.next_view`, and decides when another peer is gone:

  - a peer that fails a call, or stays silent while we wait on it, is probed with rpc_status;
    a slow peer answers and stays, a crashed one does not and is reported gone in the DHT, so that
    every member drops it at the same boundary (a crash costs seconds, slowness is never death);
  - a peer that does not answer is dialled once at its announced addresses before it is judged:
    a fresh p2pd may not know the addresses of a peer it has never talked to. (Members do not
    dial each other ahead of time: two peers opening connections to each other at once can end
    up with two, and libp2p cuts the streams on the one it closes.)
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from noloco_swarm.peer import events
from noloco_swarm.peer.detours import Detours
from noloco_swarm.peer.directory import RunDirectory
from noloco_swarm.peer.evidence import Evidence
from noloco_swarm.peer.streams import PeerUnavailable, RemoteRefused
from noloco_swarm.peer.tickets import Gate
from noloco_swarm.peer.transport import Transport
from noloco_swarm.protocol import messages
from noloco_swarm.protocol.clock import StepClock
from noloco_swarm.protocol.membership import Listing, MembershipView, credible_gone, next_view
from noloco_swarm.protocol.messages import MessageError

logger = logging.getLogger(__name__)
T = TypeVar("T")

# What a hivemind DHT call raises when peers are unreachable or slow (it is best effort for us).
DHT_ERRORS = (OSError, RuntimeError, TimeoutError, EOFError)
# A peer we wait on longer than this is probed (rpc_status).
PROBE_PERIOD = 2.0
PROBE_TIMEOUT = 5.0
# A peer that failed a probe but answered one this recently keeps its connection, and gets a second
# probe before it is reported gone.
RECENTLY = 15.0
# How often a founding peer reads the directory until round 0 is complete: the peers start
# training within about this much of each other, and the first step waits for the last.
FREEZE_POLL = 0.1
KEEP_ROUNDS = 3  # views kept: a request may name the round before ours or the next one
# What a read of the run's directory returns: the peers listed, and (peer, reporter, round) reports.
Directory = tuple[list[Listing], list[tuple[str, str, int]]]


async def ask_status(transport: Transport, peer: str, run_id: str, timeout: float) -> messages.PeerStatus:
    """`peer`'s answer to rpc_status: joiners, probes and `noloco status` all ask this way.

    Raises PeerUnavailable (no answer), RemoteRefused, or MessageError (an answer of another type).
    """
    reply, _ = await transport.call(peer, "rpc_status", messages.StatusRequest(run_id), timeout=timeout)
    if not isinstance(reply, messages.PeerStatus):
        raise MessageError(f"{peer} answered a status request with {reply.TAG!r}")
    return reply


async def ask_status_at(
    transport: Transport, peer: str, addresses: tuple[str, ...], run_id: str
) -> messages.PeerStatus:
    """`ask_status` of a peer found in the directory: dial its announced addresses first (a fresh
    daemon knows only the peers it has talked to). Raises as `ask_status` does."""
    await transport.connect(peer, addresses, timeout=PROBE_TIMEOUT)
    return await ask_status(transport, peer, run_id, PROBE_TIMEOUT)


@dataclass(frozen=True)
class Refusal:
    """A probed peer answered, but not with its status: it runs, its progress is unknown."""

    reason: str


class PeerExcluded(RuntimeError):
    """The swarm's next view leaves this (live) peer out, e.g. after a gone report: join again."""


def raise_if_left_behind(t: int, round_: int, clock: StepClock, steps: Iterable[int]) -> None:
    """We are at step t of `round_` and other members report `steps`: if one is two rounds past
    ours, the swarm trained on without us and we are out of its views, or soon will be. Raise
    PeerExcluded, to rejoin now instead of waiting on (or sending to) steps they left long ago."""
    furthest = max(steps, default=t)
    if furthest >= clock.round_start(round_ + 2):
        raise PeerExcluded(f"this peer fell behind: it is at step {t}, the swarm at step {furthest}")


class Rounds:
    """One peer's per-round views of the swarm, and its record of peers that failed it."""

    def __init__(
        self,
        me: str,
        stage: int,
        num_stages: int,
        transport: Transport,
        directory: RunDirectory,
        sink: events.Events,
    ) -> None:
        self.me, self.stage, self.num_stages = me, stage, num_stages
        self.transport, self.directory, self.events = transport, directory, sink
        self.views: dict[int, MembershipView] = {}  # round -> frozen view
        self._ready: dict[int, asyncio.Event] = {}
        self.dead: dict[str, int] = {}  # peer id -> the round it failed us in (also reported in the DHT)
        self.detours = Detours(me, stage, self.dead)  # whom rows are routed around
        self.addresses: dict[str, tuple[str, ...]] = {}  # peer id -> announced addresses
        self.answered: dict[str, float] = {}  # peer id -> when it last answered a probe (monotonic)
        self.seen: dict[str, messages.PeerStatus] = {}  # peer id -> its answer to our last probe
        self.evidence = Evidence(me, sink)  # which gone reports we believe
        self._reports: set[asyncio.Task[None]] = set()
        self.gate: Gate | None = None  # a closed run's: members are peers with a valid ticket

    # ------------------------------------------------------------------ views

    def adopt(self, view: MembershipView) -> None:
        """Take a donor's view on (re)joining: its members are alive by the swarm's consensus, so
        whom we marked gone before (while cut off, typically the whole swarm) is forgotten. Kept,
        those marks made us skip every row from them: a rejoined peer ran its steps empty."""
        self.dead.clear()
        self.detours.forget_all()
        self.set(view)

    def set(self, view: MembershipView) -> None:
        """Freeze `view` for its round (and forget rounds long past)."""
        self.views[view.round] = view
        for old in [r for r in self.views if r <= view.round - KEEP_ROUNDS]:
            del self.views[old]
            self._ready.pop(old, None)
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

    def read_peers(self) -> list[messages.PeerAnnouncement]:
        """Live announcements (blocking: call in a thread); remembers everyone's addresses. In a
        closed run, only those with a valid ticket (whose peers the gate then admits)."""
        return self._admitted(self.directory.read_peers().announcements)

    def _admitted(self, announcements: list[messages.PeerAnnouncement]) -> list[messages.PeerAnnouncement]:
        """In a closed run, only announcements with a valid ticket; remembers their addresses."""
        if self.gate is not None:
            announcements = [a for a in announcements if self.gate.admit_announced(a)]
        for a in announcements:
            self.addresses[a.peer_id] = a.addresses
        return announcements

    def run_in_progress(
        self, announcements: list[messages.PeerAnnouncement], counts: tuple[int, ...]
    ) -> bool:
        """True when round 0 is already complete (or past): a newcomer must join a later round."""
        others = [a for a in announcements if a.peer_id != self.me]
        if any(a.step > 0 or a.joined_round > 0 for a in others):
            return True
        there = [
            sum(1 for a in others if a.stage == s and a.joined_round == 0) for s in range(self.num_stages)
        ]
        return all(c >= n for c, n in zip(there, counts, strict=True))

    async def freeze_round_zero(self, counts: tuple[int, ...], timeout: float) -> MembershipView:
        """Wait until every stage has its `counts[s]` peers announced for round 0, then freeze it."""
        deadline = time.monotonic() + timeout
        while True:
            announcements = await asyncio.to_thread(self.read_peers)
            pairs = [
                (a.peer_id, a.stage)
                for a in announcements
                if a.joined_round == 0 and a.stage < self.num_stages
            ]
            view = MembershipView.from_announcements(0, self.num_stages, pairs)
            there = view.replica_counts()
            if all(c >= n for c, n in zip(there, counts, strict=True)):
                if any(c > n for c, n in zip(there, counts, strict=True)):
                    raise RuntimeError(
                        f"more peers than the run's {list(counts)} announced for round 0: {there}"
                    )
                self.set(view)
                return view
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {there} peers per stage after {timeout:.0f} s; need {list(counts)}")
            await asyncio.sleep(FREEZE_POLL)

    async def read_directory(self) -> Directory:
        """The run's listings and gone reports, for `next`; empty if the DHT cannot be read twice
        (the next view then keeps this round's members). The loop starts this read at the
        boundary, beside the outer exchange, so that the exchange hides its DHT round trip:
        only reports of rounds before the current one decide the next view (membership.py),
        and those were stored a round ago."""
        for attempt in range(2):
            try:
                return await asyncio.to_thread(self._read_directory)
            except DHT_ERRORS as e:
                logger.warning(
                    "could not read the run's directory (%s)%s", e, "" if attempt else "; retrying"
                )
        return [], []

    async def next(self, current: MembershipView, joined_round: int, directory: Directory) -> MembershipView:
        """The view of the round after `current`, by the rule every peer applies (not yet frozen),
        from `directory` (read at the boundary: see read_directory).

        Raises PeerExcluded if it leaves us out or a stage has nobody left (see below).
        """
        listings, reports = list(directory[0]), directory[1]
        # What we saw ourselves counts too, in case the DHT lost it (weighed with the rest).
        seen = [(peer, self.me, round_) for peer, round_ in self.dead.items()]
        # A member missing from the read is only suspect: check it before telling everyone it is gone.
        suspects = sorted(current.members() - {item.peer for item in listings} - set(self.dead) - {self.me})
        async with asyncio.TaskGroup() as group:
            for p in suspects:
                group.create_task(self.suspect(p, "its announcement expired"))
        members = current.members()  # a stranger's report counts for nothing
        joined = {item.peer: item.joined_round for item in listings}
        due = [r for r in {*reports, *seen} if r[1] in members]
        kept = await self.evidence.weigh(current, joined, due, self.alive)
        for peer in self.evidence.live:
            self.dead.pop(peer, None)  # one we marked gone answers again: a member like any other
            self.detours.forget(peer)
        listings.insert(0, Listing(self.me, self.stage, joined_round))
        view = next_view(current, listings, credible_gone(kept))
        for peer in view.members() - current.members():
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

    def _read_directory(self) -> Directory:
        peers, reports = self.directory.read_both()
        listings = [Listing(a.peer_id, a.stage, a.joined_round) for a in self._admitted(peers.announcements)]
        return listings, reports

    # ------------------------------------------------------------------ reaching and losing peers

    async def alive(self, peer: str) -> bool:
        """Does `peer` answer a status request? (Refusing one counts: it is running.)"""
        return (await self.probe(peer)) is not None

    async def probe(self, peer: str) -> messages.PeerStatus | Refusal | None:
        """`peer`'s status; a Refusal if it runs but would not say (another run, an older peer);
        None if it does not answer, even after one dial at its announced addresses."""
        before = self.transport.received_from(peer)
        for attempt in range(2):
            try:
                status = await ask_status(self.transport, peer, self.directory.run_id, PROBE_TIMEOUT)
                self.answered[peer], self.seen[peer] = time.monotonic(), status
                return status
            except PeerUnavailable:
                if attempt or self.transport.received_from(peer) > before:
                    break
                # Dial it: a fresh daemon may not know it yet. One that has not answered us for a
                # while we dial afresh: after a cut our old connection to it can hang although
                # the link is back. One that answered moments ago keeps its connection, which may
                # be only stalled under load, with an exchange on it that can still complete.
                # (Data still arriving from it proves the connection works; see below.)
                fresh = time.monotonic() - self.answered.get(peer, -math.inf) < RECENTLY
                dial = self.transport.connect if fresh else self.transport.redial
                if not await dial(peer, self.addresses.get(peer, ()), timeout=PROBE_TIMEOUT):
                    break
            except (RemoteRefused, MessageError) as e:
                self.answered[peer] = time.monotonic()
                return Refusal(str(e))
        # On a slow link our probe waits behind the bulk data the peer is sending us (an outer
        # exchange, a batch of rows): data still arriving from it proves it runs.
        if self.transport.received_from(peer) > before:
            return Refusal("it did not answer in time, but its data is still arriving")
        return None

    def passed(self, peer: str, t: int, microbatch: int | None = None) -> int | None:
        """The step `peer` was at when we last probed it, if it had passed step t then (with
        `microbatch`: or had collected that microbatch of step t, and takes no new rows of it):
        it refuses anything of that as stale now (a peer's steps only advance), so we send it
        nothing of it. Only its own next answer updates this (a restarted peer's lower step too)."""
        status = self.seen.get(peer)
        if status is None:
            return None
        closed = microbatch is not None and status.collected >= (t, microbatch)
        return status.step if status.step > t or closed else None

    async def watched(self, peer: str, call: Awaitable[T], what: str) -> T:
        """Await `call` (a request to `peer`), probing `peer` every PROBE_PERIOD while it lasts:
        a peer that stops answering (crashed, frozen, cut off) is marked gone and the call
        abandoned with PeerUnavailable, instead of holding us for the call's whole deadline."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=PROBE_PERIOD)
                if done:
                    return task.result()
                if peer in self.dead or not await self.alive(peer):
                    self.mark_dead(peer, f"stopped answering during {what}")
                    raise PeerUnavailable(f"peer {peer} stopped answering during {what}")
        finally:  # also retrieves the error of a call that failed while we probed its peer
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def suspect(self, peer: str, why: str, *, twice: bool = False) -> bool:
        """`peer` failed us in a way a slow peer could too: it is gone only if it does not answer
        (`twice`: two probes PROBE_PERIOD apart, for a peer only someone else says failed)."""
        if peer in self.dead:
            return True
        alive = await self.alive(peer)
        if not alive and (twice or time.monotonic() - self.answered.get(peer, -math.inf) < RECENTLY):
            # It answered a probe moments ago (e.g. while it kept us waiting on a long outer
            # exchange of its own): one lost probe, on a loaded machine, is no proof it died, and
            # marking a live peer gone can empty a stage. Ask once more before reporting it.
            await asyncio.sleep(PROBE_PERIOD)
            alive = await self.alive(peer)
        if alive:
            self.events.emit(events.SlowPeer(peer=peer, reason=why))
            return False
        self.mark_dead(peer, why)
        return True

    async def hearsay(self, peer: str, why: str) -> bool:
        """`suspect`, for a peer that another one says failed it: its word and one lost probe
        would corroborate each other's report (evidence.py), so it takes two."""
        return await self.suspect(peer, why, twice=True)

    def mark_dead(self, peer: str, why: str) -> None:
        """Stop waiting for, and sending to, a peer that failed us; tell the swarm through the DHT."""
        if peer in self.dead:
            return
        latest = self.latest()
        round_ = latest.round if latest is not None else 0
        self.dead[peer] = round_
        logger.warning("peer %s is gone (%s); continuing without it", peer, why)
        self.events.emit(events.PeerGone(peer=peer, round=round_, reason=why))
        report = messages.GoneReport(self.directory.run_id, peer, self.me, round_)
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(self._report, report))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def report_leaving(self, round_: int) -> None:
        """Report ourselves gone in `round_`: members drop us at the boundary after the next one."""
        report = messages.GoneReport(self.directory.run_id, self.me, self.me, round_)
        await asyncio.to_thread(self._report, report)

    def _report(self, report: messages.GoneReport) -> None:
        try:
            if not self.directory.report_gone(report):
                logger.warning("the DHT did not store our report that %s is gone", report.peer_id)
        except DHT_ERRORS as e:  # best effort: the peers it fails will find out by themselves
            logger.warning("could not report %s gone: %s", report.peer_id, e)

    async def close(self) -> None:
        """Stop probing reported peers; let pending gone reports finish."""
        await self.detours.close()
        await asyncio.gather(*self._reports, return_exceptions=True)
