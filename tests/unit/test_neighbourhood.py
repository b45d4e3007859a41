"""A joiner's neighbourhood asked of a member (peer/neighbourhood.py): what a member answers, what
a joiner takes from the answers (a member of another stage, a bucket read, a forged or malformed
reply), and how a member's probe finds the address of a peer outside its neighbourhood. The real
swarm's join through a member is tests/integration/test_swarm.py
(test_a_peer_joins_a_running_swarm_at_a_round_boundary)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from noloco_swarm.peer import events
from noloco_swarm.peer.neighbourhood import (
    Contact,
    Found,
    NeighbourhoodServer,
    find,
    sampled,
    stage_counts,
)
from noloco_swarm.peer.net.identity import fresh
from noloco_swarm.peer.net.transport import PeerUnavailable
from noloco_swarm.peer.passing import RecordBook, seal
from noloco_swarm.peer.views import Rounds
from noloco_swarm.protocol import codec, records, rpc
from noloco_swarm.protocol.codec import MessageError
from noloco_swarm.protocol.membership import MembershipView, directory_bucket

RUN, H = "run-n", 4


JOINER = fresh()
# A view of round 5 with four stages of two members each; stage s's members are s0 and s1.
VIEW = MembershipView(5, tuple((f"{s}a", f"{s}b") for s in range(4)))


def addr(peer: str) -> tuple[str, ...]:
    return (f"/ip4/10.0.0.1/tcp/1/p2p/{peer}",)


def member(
    me: str, knows: set[str], book: RecordBook | None = None, dead: dict[str, int] | None = None
) -> NeighbourhoodServer:
    """A member holding VIEW that knows the addresses of `knows` (and its own), and found `dead`."""
    rounds = SimpleNamespace(
        latest=lambda: VIEW,
        addresses={p: addr(p) for p in knows},
        passing=SimpleNamespace(book=book or RecordBook(H)),
        dead=dead or {},
    )
    ctx = SimpleNamespace(
        run_id=RUN, me=me, rounds=rounds, transport=SimpleNamespace(register=lambda verb, handler: None)
    )
    return NeighbourhoodServer(ctx, addr(me))  # type: ignore[arg-type]


def serve(server: NeighbourhoodServer, stage: int, caller: str = "joiner") -> rpc.Neighbourhood:
    reply, _ = asyncio.run(server.rpc_neighbourhood(caller, rpc.NeighbourhoodRequest(RUN, stage), []))
    assert isinstance(reply, rpc.Neighbourhood)
    return codec.decode(codec.encode(reply), rpc.Neighbourhood)  # as it crosses the wire


def test_a_member_names_its_view_the_addresses_it_knows_near_the_stage_and_the_joiners() -> None:
    book = RecordBook(H)
    book.at_round(5)
    early = seal(JOINER, records.PeerAnnouncement(RUN, JOINER.peer_id, 2, 6, addr("x")))
    book.add(early)
    reporter = fresh()
    book.add(seal(reporter, records.GoneReport(RUN, "2b", reporter.peer_id, 5)))
    book.add(seal(reporter, records.GoneReport(RUN, "9x", reporter.peer_id, 5)))  # no member
    reply = serve(member("1a", {"0a", "0b", "1b", "2a", "3a"}, book, dead={"0b": 5}), stage=1)
    assert (reply.round, reply.view) == (5, VIEW.stages)
    # Stages 0, 1 and 2 only, and only peers whose addresses it knows (2b it does not).
    assert dict(zip(reply.peers, reply.addresses, strict=True)) == {
        p: addr(p) for p in ("0a", "0b", "1a", "1b", "2a")
    }
    assert reply.joining == (early.sealed,)
    # The members it holds for gone: reported in the view's round, or failed it (not yet dropped).
    assert reply.gone == ("0b", "2b")
    assert serve(member("3b", {"3a", "2b"}), stage=3).peers == ("2b", "3a", "3b")


def test_a_peer_without_a_view_or_asked_amiss_refuses() -> None:
    server = member("1a", set())
    server.ctx.rounds.latest = lambda: None
    with pytest.raises(MessageError, match="no view"):
        serve(server, 1)
    server = member("1a", set())
    with pytest.raises(MessageError, match="outside"):
        serve(server, 4)
    for header in (rpc.NeighbourhoodRequest("run-other", 0), rpc.StatusRequest(RUN)):
        with pytest.raises(MessageError, match="neighbourhood request"):
            asyncio.run(server.rpc_neighbourhood("joiner", header, []))


def test_a_neighbourhood_reply_is_checked_as_it_is_decoded() -> None:
    with pytest.raises(ValueError, match="address lists"):
        rpc.Neighbourhood(RUN, 0, 5, VIEW.stages, ("0a",), ())
    with pytest.raises(ValueError, match="outside"):
        rpc.Neighbourhood(RUN, 4, 5, VIEW.stages)
    with pytest.raises(ValueError, match=">= 0"):
        rpc.NeighbourhoodRequest(RUN, -1)


class Swarm:
    """Members' handlers behind a transport, a DHT node that knows `known`, and a directory whose
    buckets hold the members' announcements; `replies` replaces a member's answer."""

    def __init__(self, servers: dict[str, NeighbourhoodServer], known: list[str]) -> None:
        self.servers = servers
        self.calls: list[str] = []
        self.buckets_read: list[int | None] = []
        self.transport = SimpleNamespace(peer_id=JOINER.peer_id, call=self.call, connect=self.connect)
        self.directory = SimpleNamespace(run_id=RUN, known_nodes=lambda: known, read_bucket=self.read_bucket)
        network = SimpleNamespace(initial_peers=[])
        self.cfg = SimpleNamespace(
            authority=None, num_stages=4, outer=SimpleNamespace(inner_steps=H), network=network
        )
        self.replies: dict[str, Callable[[], codec.Message]] = {}

    async def call(self, peer: str, verb: str, header: codec.Message, timeout: float) -> tuple:
        assert verb == "rpc_neighbourhood"
        self.calls.append(peer)
        if peer in self.replies:
            return self.replies[peer](), []
        if peer not in self.servers:
            raise PeerUnavailable(f"{peer} does not answer")
        return await self.servers[peer].rpc_neighbourhood(JOINER.peer_id, header, [])

    async def connect(self, peer: str, addresses: tuple[str, ...], timeout: float) -> bool:
        return peer in self.servers

    def read_bucket(self, bucket: int | None) -> list[records.PeerAnnouncement]:
        self.buckets_read.append(bucket)
        return [
            records.PeerAnnouncement(RUN, p, s, 0, addr(p))
            for s, peers in enumerate(VIEW.stages)
            for p in peers
            if directory_bucket(VIEW, p) == bucket
        ]

    def find(self, stage: int) -> Found | None:
        return asyncio.run(find(self.transport, self.directory, self.cfg, stage))  # type: ignore[arg-type]


def test_a_joiner_asked_by_a_far_member_reads_one_bucket_and_asks_its_own_stage() -> None:
    # The only member the joiner's DHT node knows is on stage 3, and knows stages 2 and 3 only.
    everyone = {p for s in VIEW.stages for p in s}
    servers = {"3a": member("3a", {"2a", "2b", "3b"}), "0b": member("0b", everyone)}
    swarm = Swarm(servers, known=["3a"])
    found = swarm.find(0)
    assert found is not None and found.asked == "0b" and found.view == VIEW
    assert swarm.buckets_read == [0]  # all eight places fit in bucket 0
    assert {c.peer_id: c.stage for c in found.contacts} == {"0a": 0, "0b": 0, "1a": 1, "1b": 1}
    assert all(c.joined_round == 5 and c.step == 5 * H for c in found.contacts)
    # A member of the joiner's stage answers at once: no bucket read.
    swarm = Swarm(servers, known=["0b", "3a"])
    assert swarm.find(0).asked == "0b" and swarm.buckets_read == []
    # One of the next stage names a member of the joiner's stage: asked, no bucket read either.
    servers["1a"] = member("1a", {"0b", "1b"})
    swarm = Swarm(servers, known=["1a", "3a"])
    assert swarm.find(0).asked == "0b" and swarm.calls[-1] == "0b" and swarm.buckets_read == []


def test_forged_or_malformed_answers_count_as_none() -> None:
    forged_joiner = seal(JOINER, records.PeerAnnouncement(RUN, JOINER.peer_id, 0, 6, addr("j")))
    other = fresh()
    lying = seal(other, records.PeerAnnouncement(RUN, other.peer_id, 0, 6)).sealed[:-1]  # cut short
    replies = {
        "1a": lambda: rpc.Neighbourhood(RUN, 1, 5, VIEW.stages, ("1a",), (addr("1a"),)),  # another stage
        "1b": lambda: rpc.Neighbourhood(RUN, 0, 5, VIEW.stages[:3], ("1b",), (addr("1b"),)),  # 3 stages
        "2a": lambda: rpc.StatusRequest(RUN),
        "2b": lambda: rpc.Neighbourhood(RUN, 0, 5, (("x",), ("y",), ("z",), ("w",)), (), ()),  # not in it
    }
    swarm = Swarm({}, known=list(replies))
    swarm.replies = replies
    assert swarm.find(0) is None  # the joiner reads the directory instead (neighbourhood.contacts)
    assert sorted(swarm.calls) == sorted(replies)
    # A good answer with a bad joiner's record: the record is skipped, the rest taken.
    swarm = Swarm({"0a": member("0a", {"0b"})}, known=["0a"])
    swarm.replies["0a"] = lambda: rpc.Neighbourhood(
        RUN, 0, 5, VIEW.stages, ("0a", "0b"), (addr("0a"), addr("0b")), (lying, forged_joiner.sealed)
    )
    found = swarm.find(0)
    assert [a.peer_id for a in found.joiners] == [JOINER.peer_id]
    assert JOINER.peer_id not in {c.peer_id for c in found.contacts}  # not itself


def test_what_auto_stage_counts_and_whom_a_joiner_asks() -> None:
    j = records.PeerAnnouncement(RUN, "9z", 2, 6)
    found = Found(VIEW, [], [j, records.PeerAnnouncement(RUN, "2a", 2, 6)], "0a", frozenset({"1b"}))
    counted = sorted([*((p, s) for s, ps in enumerate(VIEW.stages) for p in ps if p != "1b"), ("9z", 2)])
    assert stage_counts(found) == counted  # a member held for gone is not counted
    many = [Contact(f"p{i}", i % 3, (), 0, 0) for i in range(60)]
    chosen = sampled(many, 1, "me", 8)
    assert len(chosen) == 16 and sum(c.stage == 1 for c in chosen) == 8
    assert chosen == sampled(reversed(many), 1, "me", 8)  # the same whatever the order


class Directory:
    run_id, identity = RUN, None

    def __init__(self) -> None:
        self.read: list[int | None] = []

    def read_bucket(self, bucket: int | None) -> list[records.PeerAnnouncement]:
        self.read.append(bucket)
        if bucket == 1:
            return [records.PeerAnnouncement(RUN, "far", 3, 0, addr("far"))]
        return []


def test_a_probe_of_a_peer_outside_the_neighbourhood_reads_its_bucket_once_a_while() -> None:
    transport = SimpleNamespace(peer_id="00", register=lambda verb, handler: None)
    directory = Directory()
    rounds = Rounds("00", 0, 4, transport, directory, events.Events())  # type: ignore[arg-type]
    asyncio.run(rounds.passing.close())  # it passes records to nobody here
    stages = [tuple(sorted(f"{s}{i}" for i in range(6))) for s in range(3)] + [("far",)]
    view = MembershipView(5, tuple(stages))
    rounds.set(view)
    assert directory_bucket(view, "far") == 1
    assert asyncio.run(rounds.look_up("far")) == addr("far")
    assert directory.read == [None, 1]  # the roster, then its bucket
    assert asyncio.run(rounds.look_up("gone")) == ()
    assert asyncio.run(rounds.look_up("gone")) == ()  # not again within LOOK_UP_EVERY
    assert directory.read == [None, 1, None]


def test_a_member_that_lies_about_its_round_is_outvoted() -> None:
    everyone = {p for s in VIEW.stages for p in s}
    servers = {p: member(p, everyone) for p in ("0a", "0b", "1a")}
    later = MembershipView(99, (("0a", "0b", "zz"), *VIEW.stages[1:]))
    swarm = Swarm(servers, known=["0a", "0b", "1a", "zz"])
    swarm.replies["zz"] = lambda: rpc.Neighbourhood(RUN, 0, 99, later.stages, ("zz",), (addr("zz"),))
    found = swarm.find(0)
    assert found.view == VIEW and found.asked in {"0a", "0b"}
