"""Membership records passed between members, beside the DHT: views that heal (issue 36, item 2).

A view is a function of the records a peer holds at a boundary (membership.next_view). Through
the DHT alone, a store that reaches one member a round late, or a boundary read that fails, gives
that member other records than the rest, and a view that differs until the record arrives
(docs/membership.md, "The membership simulator"). So every record that changes a view (a joiner's
announcement, a member's announcement of a new membership, a gone report) also travels from peer
to peer, sealed with its writer's signature (records.Sealed), which the DHT strips:

- a writer seals its own record and passes it to its neighbours (the members of the stages next to
  its own: those it exchanges rows with; with one stage, the other members) at once;
- a member that gets records it lacked passes them on to its neighbours, and at every boundary it
  passes what a new neighbour lacks, so a record reaches every member connected to its writer
  within seconds, whatever the DHT does;
- a joiner hands its announcement to the peers it asks where they are, as it makes it.
At a boundary the view is built from these records alone (views.py: since 2026-12-07 no boundary
reads the DHT; a member first asks one neighbour for what it lacks). The joining margin (two
rounds) and the report lag (one round) leave a round for a record to arrive.

Only records that change a view are held and passed: announcements of memberships that began in
the last JOIN_MARGIN_ROUNDS rounds or begin later (a founder's never), and the reports a boundary
can still weigh. So the bytes follow the swarm's churn, not its size. What each neighbour has is
remembered per neighbour (what it passed us, what it took from us), so a record crosses a link
once or twice; a neighbour that restarts names a new session and is passed everything again.

Every record is checked on its own: its signature, that it speaks for its signer, that it names
this run. A bad one is skipped and counted; nothing a caller sends can crash the peer or corrupt
what it holds. A caller that is not a member may hand over only its own announcement.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from noloco_swarm.peer import failpoints
from noloco_swarm.peer.directory import author
from noloco_swarm.peer.net.identity import Identity, signer_of
from noloco_swarm.peer.net.transport import PeerUnavailable, RemoteRefused, Transport
from noloco_swarm.protocol import codec, records, rpc
from noloco_swarm.protocol.codec import MessageError
from noloco_swarm.protocol.membership import JOIN_MARGIN_ROUNDS, LATE_REPORT_ROUNDS, REPORT_LAG_ROUNDS

logger = logging.getLogger(__name__)

Record = records.PeerAnnouncement | records.GoneReport
# What one peer holds at most: a flood of records (each a stranger's own, validly signed) is refused
# past these, never stored without bound.
MAX_ANNOUNCEMENTS = 4096
MAX_REPORTS = 16384
MAX_REPORTS_PER_REPORTER = 256
PASS_TIMEOUT = 5.0
PASS_BYTES = 768 << 10  # of sealed records per message (codec.MAX_MESSAGE_BYTES is 1 MiB)
ERRORS = (PeerUnavailable, RemoteRefused, MessageError)


@dataclass(frozen=True)
class Entry:
    """A checked record and its sealed bytes, as passed."""

    sealed: bytes
    record: Record

    @property
    def id(self) -> bytes:
        return hashlib.sha256(self.sealed).digest()[:16]


def open_sealed(data: bytes, run_id: str) -> Entry:
    """The record sealed in `data`, checked: MessageError if it is malformed, names another run,
    is not signed by the key it carries, or speaks for another peer than that key's."""
    sealed = codec.decode(data, records.Sealed)
    try:
        record: Record = codec.decode(sealed.record, records.PeerAnnouncement)
    except MessageError:
        record = codec.decode(sealed.record, records.GoneReport)
    if record.run_id != run_id:
        raise MessageError(f"a record of run {record.run_id!r}, not {run_id!r}")
    signer = signer_of(sealed.record, sealed.key, sealed.signature)
    if signer is None or signer != author(record):
        raise MessageError("a record not signed by the peer it speaks for")
    return Entry(data, record)


def seal(identity: Identity, record: Record) -> Entry:
    body = codec.encode(record)
    key, signature = identity.seal(body)
    return Entry(codec.encode(records.Sealed(body, key, signature)), record)


class RecordBook:
    """The sealed records one peer holds, by the rule of which ones change a view. Pure: what it
    keeps depends only on the records and `round` (the round of the peer's latest view)."""

    def __init__(self, inner_steps: int) -> None:
        self.inner_steps = inner_steps
        self.announcements: dict[str, Entry] = {}  # peer -> its newest membership's announcement
        self.reports: dict[tuple[str, str, int], Entry] = {}
        self.by_reporter: Counter[str] = Counter()
        self.round = 0

    def entered(self, a: records.PeerAnnouncement) -> bool:
        return a.step >= a.joined_round * self.inner_steps

    def keeps(self, record: Record) -> bool:
        """Does `record` change a view that can still be built? (Or, past the caps, room for it.)"""
        if isinstance(record, records.GoneReport):
            lo = self.round - LATE_REPORT_ROUNDS - REPORT_LAG_ROUNDS
            key = (record.peer_id, record.reporter, record.round)
            return lo <= record.round <= self.round + 1 and (
                key in self.reports
                or (
                    len(self.reports) < MAX_REPORTS
                    and self.by_reporter[record.reporter] < MAX_REPORTS_PER_REPORTER
                )
            )
        if record.joined_round < max(1, self.round - JOIN_MARGIN_ROUNDS):
            return False
        held = self.announcements.get(record.peer_id)
        if held is None:
            return len(self.announcements) < MAX_ANNOUNCEMENTS
        return self._order(record) > self._order(held.record)

    def _order(self, a: records.PeerAnnouncement) -> tuple[int, bool]:
        return a.joined_round, self.entered(a)

    def add(self, entry: Entry) -> bool:
        """Hold `entry` if it changes a view; True if we lacked it."""
        record = entry.record
        if not self.keeps(record):
            return False
        if isinstance(record, records.GoneReport):
            key = (record.peer_id, record.reporter, record.round)
            if key in self.reports:
                return False
            self.reports[key] = entry
            self.by_reporter[record.reporter] += 1
        else:
            self.announcements[record.peer_id] = entry
        return True

    def at_round(self, round_: int) -> None:
        """Our latest view is of `round_` now: drop what no view from here on can use."""
        self.round = max(self.round, round_)
        for key, entry in list(self.reports.items()):
            if not self.keeps(entry.record):
                del self.reports[key]
                self.by_reporter[key[1]] -= 1
        floor = max(1, self.round - JOIN_MARGIN_ROUNDS)
        for peer, entry in list(self.announcements.items()):
            if entry.record.joined_round < floor:
                del self.announcements[peer]

    def entries(self) -> list[Entry]:
        return [*self.announcements.values(), *self.reports.values()]

    def listed(self) -> list[records.PeerAnnouncement]:
        return [e.record for e in self.announcements.values()]

    def gone(self) -> list[tuple[str, str, int]]:
        return list(self.reports)


class Passing:
    """This peer's side of passing records: its book, the verb `rpc_records`, and the pushes to
    its neighbours (which `neighbours()` names; `members()`: every member of a view it keeps)."""

    def __init__(
        self,
        identity: Identity | None,
        transport: Transport,
        run_id: str,
        neighbours: Callable[[], Iterable[str]],
        members: Callable[[], set[str]],
    ) -> None:
        self.identity, self.transport, self.run_id = identity, transport, run_id
        self.neighbours, self.members = neighbours, members
        self.book = RecordBook(0)
        self.session = os.urandom(rpc.SESSION_BYTES)
        self.bad = 0  # records refused: malformed, forged, of another run
        self._known: dict[str, set[bytes]] = {}  # neighbour -> ids of records it holds
        self._sessions: dict[str, bytes] = {}
        self._again: set[str] = set()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._closed = False
        transport.register("rpc_records", self.rpc_records)

    # ------------------------------------------------------------------ what we hold

    def own(self, record: Record) -> None:
        """A record we write (and store in the DHT): seal it and pass it on, if it changes a view."""
        if self.identity is None or not self.book.keeps(record):
            return
        if self.book.add(seal(self.identity, record)):
            self.push()

    def at_round(self, round_: int) -> None:
        """A new view: drop what no later view uses, and pass new neighbours what they lack."""
        self.book.at_round(round_)
        held = {e.id for e in self.book.entries()}
        for peer, known in self._known.items():
            self._known[peer] = known & held
        self.push()

    def _take(self, sender: str, items: Iterable[bytes], member: bool) -> tuple[int, int]:
        """Hold the good records among `items` from `sender`: (how many were new to us, how many
        we refused because `sender` is no member of our views)."""
        known, new, strange = self._known.setdefault(sender, set()), 0, 0
        for data in items:
            try:
                entry = open_sealed(data, self.run_id)
            except MessageError as e:
                self.bad += 1
                logger.info("a record from %s refused: %s", sender, e)
                continue
            known.add(entry.id)
            if not member and (
                author(entry.record) != sender or not isinstance(entry.record, records.PeerAnnouncement)
            ):
                self.bad += 1  # a stranger hands over its own announcement, nothing else
                strange += 1
                continue
            if not member and failpoints.fire("miss_joiners", "rpc_records"):  # a test's lost handover
                logger.warning("failpoint miss_joiners:rpc_records: %s's handover dropped", sender)
                continue
            new += self.book.add(entry)
        return new, strange

    # ------------------------------------------------------------------ passing

    async def rpc_records(
        self, peer_id: str, header: codec.Message, tensors: list[object]
    ) -> tuple[codec.Message, list[object]]:
        """Records a peer passes us; the reply holds what we have that it lacks (members only)."""
        if not isinstance(header, rpc.PassedRecords) or header.run_id != self.run_id:
            raise MessageError(f"expected records of run {self.run_id!r}")
        self._meet(peer_id, header.session)
        member = peer_id in self.members()
        new, strange = self._take(peer_id, header.records, member)
        if new:
            self.push()
        if strange:
            # Said, so that the sender does not count them as ours: a joiner that has no view yet
            # refused the reports a member passed it, and lacked them at its first boundary.
            raise MessageError(
                f"{strange} record(s) refused: {peer_id} is no member of this peer's views, and may "
                "hand over only its own announcement"
            )
        reply = self._unknown_to(peer_id) if member else []
        return rpc.PassedRecords(self.run_id, self.session, tuple(e.sealed for e in reply)), []

    async def hand_over(self, peers: Iterable[str]) -> None:
        """A joiner's announcement, handed to `peers` at once (best effort): those it asked where
        they are, so that the members hold it long before its round even if the DHT is late."""
        mine = self.book.announcements.get(self.transport.peer_id)
        if mine is None:
            return
        header = rpc.PassedRecords(self.run_id, self.session, (mine.sealed,))
        await asyncio.gather(*(self._call(p, header, ()) for p in peers))

    async def pull(self, peers: Iterable[str], timeout: float) -> bool:
        """Ask the first of `peers` that answers, within `timeout` in all, for the records it holds
        that we lack (passing it what it lacks, as a push would); False if none answered."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for peer in peers:
            left = deadline - loop.time()
            if left <= 0 or self._closed:
                break
            sent = self._unknown_to(peer)
            header = rpc.PassedRecords(self.run_id, self.session, tuple(e.sealed for e in sent))
            try:
                if await asyncio.wait_for(self._call(peer, header, sent), left):
                    return True
            except TimeoutError:
                logger.info("%s did not answer our pull of records within %.1f s", peer, left)
                break
        return False

    def push(self) -> None:
        """Pass every neighbour the records it lacks (in the background; one call at a time each)."""
        if self._closed:
            return
        for peer in self.neighbours():
            if peer == self.transport.peer_id or not self._unknown_to(peer, limit=False):
                continue
            self._again.add(peer)
            if peer not in self._tasks:
                self._tasks[peer] = asyncio.get_running_loop().create_task(self._pass_to(peer))

    async def _pass_to(self, peer: str) -> None:
        try:
            while peer in self._again:
                self._again.discard(peer)
                sent = self._unknown_to(peer)
                if sent:
                    header = rpc.PassedRecords(self.run_id, self.session, tuple(e.sealed for e in sent))
                    if await self._call(peer, header, sent) and self._unknown_to(peer, limit=False):
                        self._again.add(peer)  # more than one message's worth
        finally:
            self._tasks.pop(peer, None)

    async def _call(self, peer: str, header: rpc.PassedRecords, sent: Iterable[Entry]) -> bool:
        """One pass to `peer`; False (logged) if it failed: what it lacks is passed next time."""
        try:
            reply, _ = await self.transport.call(peer, "rpc_records", header, timeout=PASS_TIMEOUT)
            if not isinstance(reply, rpc.PassedRecords) or reply.run_id != self.run_id:
                raise MessageError(f"{peer} answered passed records with {reply.TAG!r}")
        except ERRORS as e:
            logger.info("could not pass records to %s: %s", peer, e)
            return False
        self._meet(peer, reply.session)
        self._known.setdefault(peer, set()).update(e.id for e in sent)
        if self._take(peer, reply.records, peer in self.members())[0]:
            self.push()
        return True

    def _meet(self, peer: str, session: bytes) -> None:
        """`peer` speaks as process `session`: if it restarted, it holds nothing we passed before."""
        if self._sessions.get(peer) != session:
            self._sessions[peer] = session
            self._known[peer] = set()

    def _unknown_to(self, peer: str, *, limit: bool = True) -> list[Entry]:
        """The records we hold that `peer` may lack (at most one message's worth with `limit`)."""
        known, out, size = self._known.get(peer, set()), [], 0
        for entry in self.book.entries():
            if entry.id in known:
                continue
            if not limit:
                return [entry]
            size += len(entry.sealed) + 8
            if size > PASS_BYTES and out:
                break
            out.append(entry)
        return out

    async def close(self) -> None:
        """Stop passing: this peer stops (what it would pass, its neighbours have from others)."""
        self._closed = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
