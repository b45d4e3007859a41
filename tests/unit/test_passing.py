"""Membership records passed between members (peer/passing.py): sealing, which records a peer
holds, and what its handler takes from and gives to a caller. A swarm's test of the whole path is
tests/integration/test_swarm.py (a member that reads a joiner late)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from noloco_swarm.peer.net.identity import Identity, fresh
from noloco_swarm.peer.passing import (
    MAX_REPORTS_PER_REPORTER,
    Passing,
    RecordBook,
    open_sealed,
    seal,
)
from noloco_swarm.protocol import codec, records, rpc
from noloco_swarm.protocol.codec import MessageError
from noloco_swarm.protocol.membership import Listing, newest

RUN, H = "run-p", 4


A, B, C = fresh(), fresh(), fresh()


def joiner(who: Identity, joined_round: int, step: int = 0, run: str = RUN) -> records.PeerAnnouncement:
    return records.PeerAnnouncement(run, who.peer_id, 0, joined_round, step=step)


def report(who: Identity, peer: str, round_: int) -> records.GoneReport:
    return records.GoneReport(RUN, peer, who.peer_id, round_)


def test_a_sealed_record_opens_only_for_the_peer_it_speaks_for() -> None:
    entry = seal(A, joiner(A, 3))
    assert open_sealed(entry.sealed, RUN).record == joiner(A, 3)
    assert open_sealed(seal(A, report(A, B.peer_id, 2)).sealed, RUN).record == report(A, B.peer_id, 2)
    sealed = codec.decode(entry.sealed, records.Sealed)
    forged = [
        seal(A, joiner(B, 3)).sealed,  # A speaks for B
        seal(A, report(B, C.peer_id, 2)).sealed,  # A files B's report
        codec.encode(records.Sealed(codec.encode(joiner(A, 4)), sealed.key, sealed.signature)),  # edited
        codec.encode(records.Sealed(sealed.record, B.seal(b"")[0], sealed.signature)),  # another's key
        codec.encode(records.Sealed(sealed.record, b"ssh-rsa garbage", sealed.signature)),
        codec.encode(records.Sealed(codec.encode(records.RunListing(RUN, "ab" * 32)), *A.seal(b"x"))),
        entry.sealed[:-1],
        b"\x00garbage",
    ]
    for data in forged:
        with pytest.raises(MessageError):
            open_sealed(data, RUN)
    with pytest.raises(MessageError, match="run"):
        open_sealed(seal(A, joiner(A, 3, run="run-other")).sealed, RUN)


def test_the_book_holds_only_records_that_change_a_view() -> None:
    book = RecordBook(H)
    book.at_round(5)
    assert not book.add(seal(A, joiner(A, 0)))  # a founder's announcement: round 0 froze it
    assert not book.add(seal(A, joiner(A, 2)))  # a membership from before the join margin
    assert book.add(seal(A, joiner(A, 7)))  # a joiner's
    assert not book.add(seal(A, joiner(A, 7, step=1)))  # a heartbeat that changes nothing
    assert book.add(seal(A, joiner(A, 7, step=7 * H)))  # it entered
    assert book.add(seal(A, joiner(A, 9)))  # it joins again
    assert not book.add(seal(A, joiner(A, 8, step=8 * H)))  # older than what we hold
    assert [a.joined_round for a in book.listed()] == [9]
    assert book.add(seal(B, report(B, A.peer_id, 5)))
    assert not book.add(seal(B, report(B, A.peer_id, 5)))  # held already
    assert not book.add(seal(B, report(B, A.peer_id, 7)))  # a round no member is in yet
    book.at_round(12)  # later boundaries drop what no view can use any more
    assert book.listed() == [] and book.gone() == [(A.peer_id, B.peer_id, 5)]
    book.at_round(18)
    assert book.gone() == []


def test_a_reporter_fills_the_book_only_up_to_its_share() -> None:
    book = RecordBook(H)
    book.at_round(3)
    filed = [book.add(seal(B, report(B, f"peer-{i}", 3))) for i in range(MAX_REPORTS_PER_REPORTER + 3)]
    assert filed.count(True) == MAX_REPORTS_PER_REPORTER
    assert book.add(seal(C, report(C, "peer-0", 3)))  # another reporter still has room


def test_newest_listing_per_peer_wins() -> None:
    found = newest(
        [Listing("a", 0, 3, False), Listing("a", 0, 3, True), Listing("b", 1, 5), Listing("b", 1, 4)]
    )
    assert sorted(found, key=lambda x: x.peer) == [Listing("a", 0, 3, True), Listing("b", 1, 5)]


def passing(me: Identity, members: set[str]) -> tuple[Passing, list[tuple[str, object]]]:
    served: list[tuple[str, object]] = []
    transport = SimpleNamespace(
        peer_id=me.peer_id, register=lambda verb, handler: served.append((verb, handler))
    )
    # No neighbours: what it takes, it would pass on to nobody (the swarm test passes it on).
    p = Passing(me, transport, RUN, lambda: [], lambda: members)  # type: ignore[arg-type]
    p.book.inner_steps = H
    return p, served


def test_a_member_takes_what_a_caller_passes_and_answers_with_what_it_lacks() -> None:
    me, _ = passing(A, {A.peer_id, B.peer_id})
    me.book.at_round(1)
    mine = seal(C, joiner(C, 3))
    me.book.add(mine)
    theirs = seal(B, report(B, C.peer_id, 1))

    def call(records_: tuple[bytes, ...], session: bytes = b"session1") -> rpc.PassedRecords:
        reply, tensors = asyncio.run(me.rpc_records(B.peer_id, rpc.PassedRecords(RUN, session, records_), []))
        assert tensors == [] and isinstance(reply, rpc.PassedRecords) and reply.session == me.session
        return reply

    reply = call((theirs.sealed, b"\x00junk", seal(A, joiner(B, 4)).sealed))
    assert reply.records == (mine.sealed,)  # it lacked our record, not its own
    assert me.book.gone() == [(C.peer_id, B.peer_id, 1)] and me.bad == 2  # junk, and A speaking for B
    assert call((mine.sealed,)).records == ()  # it holds everything we hold now
    assert set(call((), b"session2").records) == {mine.sealed, theirs.sealed}  # it restarted
    with pytest.raises(MessageError):
        asyncio.run(me.rpc_records(B.peer_id, rpc.StatusRequest(RUN), []))
    with pytest.raises(MessageError):
        asyncio.run(me.rpc_records(B.peer_id, rpc.PassedRecords("run-other", b"session1", ()), []))


def test_a_stranger_hands_over_only_its_own_announcement_and_hears_nothing() -> None:
    me, served = passing(A, {A.peer_id, B.peer_id})
    assert [verb for verb, _ in served] == ["rpc_records"]
    me.book.add(seal(B, joiner(B, 2)))
    own = seal(C, joiner(C, 2)).sealed
    reply, _ = asyncio.run(me.rpc_records(C.peer_id, rpc.PassedRecords(RUN, b"session1", (own,)), []))
    assert isinstance(reply, rpc.PassedRecords) and reply.records == ()
    # Anything else it hands over is refused, and it is told so: a sender that took the call for
    # a delivery would count the records as ours (a joiner with no view yet refused the reports
    # a member passed it, and lacked them at its first boundary).
    others = (seal(C, report(C, B.peer_id, 0)).sealed, seal(B, joiner(B, 3)).sealed)
    with pytest.raises(MessageError, match=r"2 record\(s\) refused: .* is no member of this peer's views"):
        asyncio.run(me.rpc_records(C.peer_id, rpc.PassedRecords(RUN, b"session1", others), []))
    assert sorted(a.peer_id for a in me.book.listed()) == sorted([B.peer_id, C.peer_id])
    assert me.book.gone() == [] and me.bad == 2
