"""Which peers have failed this one: probes, suspicion, and gone reports in the DHT.

  - a peer that fails a call, or stays silent while we wait on it, is probed with rpc_status;
    a slow peer answers and stays, a crashed one does not and is reported gone in the DHT, so that
    every member drops it at the same boundary (a crash costs seconds, slowness is never death);
  - a peer that does not answer is dialled once at its announced addresses before it is judged:
    a fresh p2pd may not know the addresses of a peer it has never talked to. (Members do not
    dial each other ahead of time: two peers opening connections to each other at once can end
    up with two, and libp2p cuts the streams on the one it closes.)

The views per round (views.py) build on this record: a peer marked gone here is left out of the
next view once the swarm agrees (protocol.membership.next_view).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from noloco_swarm.peer import events
from noloco_swarm.peer.detours import Detours
from noloco_swarm.peer.directory import RunDirectory
from noloco_swarm.peer.evidence import Evidence
from noloco_swarm.peer.net.streams import PeerUnavailable, RemoteRefused
from noloco_swarm.peer.net.transport import Transport
from noloco_swarm.protocol import records, rpc
from noloco_swarm.protocol.codec import MessageError

if TYPE_CHECKING:
    from noloco_swarm.peer.passing import Passing

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


async def ask_status(transport: Transport, peer: str, run_id: str, timeout: float) -> rpc.PeerStatus:
    """`peer`'s answer to rpc_status: joiners, probes and `noloco status` all ask this way.

    Raises PeerUnavailable (no answer), RemoteRefused, or MessageError (an answer of another type).
    """
    reply, _ = await transport.call(peer, "rpc_status", rpc.StatusRequest(run_id), timeout=timeout)
    if not isinstance(reply, rpc.PeerStatus):
        raise MessageError(f"{peer} answered a status request with {reply.TAG!r}")
    return reply


async def ask_status_at(
    transport: Transport, peer: str, addresses: tuple[str, ...], run_id: str
) -> rpc.PeerStatus:
    """`ask_status` of a peer found in the directory: dial its announced addresses first (a fresh
    daemon knows only the peers it has talked to). Raises as `ask_status` does."""
    await transport.connect(peer, addresses, timeout=PROBE_TIMEOUT)
    return await ask_status(transport, peer, run_id, PROBE_TIMEOUT)


@dataclass(frozen=True)
class Refusal:
    """A probed peer answered, but not with its status: it runs, its progress is unknown."""

    reason: str


class Liveness:
    """One peer's record of the peers that failed it, and the probes that decide it."""

    def __init__(
        self, me: str, stage: int, transport: Transport, directory: RunDirectory, sink: events.Events
    ) -> None:
        self.me, self.stage = me, stage
        self.transport, self.directory, self.events = transport, directory, sink
        self.dead: dict[str, int] = {}  # peer id -> the round it failed us in
        # Of `dead`, those we reported gone when we marked them (`files`); mark_dead sets it
        # afresh each time, so an entry left from an earlier marking never counts.
        self.filed: set[str] = set()
        self.detours = Detours(me, stage, self.dead)  # whom rows are routed around
        self.addresses: dict[str, tuple[str, ...]] = {}  # peer id -> announced addresses
        self.answered: dict[str, float] = {}  # peer id -> when it last answered a probe (monotonic)
        self.seen: dict[str, rpc.PeerStatus] = {}  # peer id -> its answer to our last probe
        self.evidence = Evidence(me, sink)  # which gone reports we believe
        self._reports: set[asyncio.Task[None]] = set()
        self.round = 0  # the round of our latest view (views.py keeps it): gone reports name it
        self.passing: Passing | None = None  # our reports also pass from member to member (views.py)

    async def alive(self, peer: str) -> bool:
        """Does `peer` answer a status request? (Refusing one counts: it is running.)"""
        return (await self.probe(peer)) is not None

    async def probe(self, peer: str) -> rpc.PeerStatus | Refusal | None:
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
                addresses = self.addresses.get(peer) or await self.look_up(peer)
                if not await dial(peer, addresses, timeout=PROBE_TIMEOUT):
                    break
            except (RemoteRefused, MessageError) as e:
                self.answered[peer] = time.monotonic()
                return Refusal(str(e))
        # On a slow link our probe waits behind the bulk data the peer is sending us (an outer
        # exchange, a batch of rows): data still arriving from it proves it runs.
        if self.transport.received_from(peer) > before:
            return Refusal("it did not answer in time, but its data is still arriving")
        return None

    async def look_up(self, peer: str) -> tuple[str, ...]:
        """`peer`'s announced addresses when we know none (views.Rounds reads them)."""
        return ()

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

    def files(self, peer: str) -> bool:
        """Do we report `peer` gone when it fails us? (views.Rounds: only as one of its monitors.)"""
        return True

    def mark_dead(self, peer: str, why: str) -> None:
        """Stop waiting for, and sending to, a peer that failed us; tell the swarm (members pass
        the report on, and the DHT holds it) if we are one of those that report it (`files`)."""
        if peer in self.dead:
            return
        round_ = self.round
        self.dead[peer] = round_
        logger.warning("peer %s is gone (%s); continuing without it", peer, why)
        self.events.emit(events.PeerGone(peer=peer, round=round_, reason=why))
        if not self.files(peer):
            self.filed.discard(peer)
            return
        self.filed.add(peer)
        report = records.GoneReport(self.directory.run_id, peer, self.me, round_)
        if self.passing is not None:
            self.passing.own(report)
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(self._report, report))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def report_leaving(self, round_: int) -> None:
        """Report ourselves gone in `round_`: members drop us at the boundary after the next one."""
        report = records.GoneReport(self.directory.run_id, self.me, self.me, round_)
        if self.passing is not None:
            self.passing.own(report)
        await asyncio.to_thread(self._report, report)

    def _report(self, report: records.GoneReport) -> None:
        try:
            if not self.directory.report_gone(report):
                logger.warning("the DHT did not store our report that %s is gone", report.peer_id)
        except DHT_ERRORS as e:  # best effort: the peers it fails will find out by themselves
            logger.warning("could not report %s gone: %s", report.peer_id, e)

    async def close(self) -> None:
        """Stop probing reported peers; let pending gone reports finish, unless we are stopping
        now (our task is cancelled: a second signal). Then they are dropped: with our daemon
        gone (a group SIGTERM ends it first) each waited out DHT_CALL_TIMEOUT."""
        await self.detours.close()
        if self.passing is not None:
            await self.passing.close()
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            return
        await asyncio.gather(*self._reports, return_exceptions=True)
