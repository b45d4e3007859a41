"""Whom a joiner joins with, asked of a member instead of read from the whole directory (issue 36,
item 4).

Reading the whole directory costs a joiner N announcements, and puts every join's reads on the
DHT nodes that hold the directory's buckets: the load on the busiest node grew with N
(docs/membership.md, "A join that asks a member"). A joiner needs much less: the swarm's view (to
pick its round and, with --stage auto, its stage) and the addresses of the peers it will talk to,
the members of its stage (its donors and exchange partners) and of the stages next to it (whom it
routes rows to and from). So it asks a member:

1. it asks ASKED peers its DHT node knows (the run's entry points and its routing table, which
   hold random members) for their `Neighbourhood`; a peer with no view refuses. Of the answers
   it takes one of the round most agree on (one member lying about its round is outvoted), of
   its own stage if one is;
2. if none is of its stage, it asks a member of its stage too (which knows its neighbourhood as
   the joiner will): one whose address an answer names, or, if none does, one found in a bucket
   of its stage's places in that view (one DHT key: directory.bucket_key);
3. it dials the peers named and takes their addresses; the joiners the member holds (their
   sealed announcements, each checked) count too.
A peer that later has to reach a member outside its neighbourhood (a probe of an accused member at
a boundary) reads that member's bucket for its address (views.Rounds.look_up).

A joiner falls back to the whole directory when no member answers (founders before round 0, a
swarm of peers that predate this verb), and always in a closed run, where every announcement's
ticket must be checked (peer/tickets.py). The reply is checked like any message: a malformed one
counts as no answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hivemind.utils.multiaddr import Multiaddr

from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.directory import RunDirectory
from noloco_swarm.peer.liveness import DHT_ERRORS, PROBE_TIMEOUT
from noloco_swarm.peer.net.transport import PeerUnavailable, RemoteRefused, Transport
from noloco_swarm.peer.passing import PASS_BYTES, open_sealed
from noloco_swarm.protocol import codec, records, rpc
from noloco_swarm.protocol.codec import MessageError
from noloco_swarm.protocol.membership import MembershipView, directory_bucket
from noloco_swarm.train.config import RunConfig

logger = logging.getLogger(__name__)

ASKED = 4  # peers asked at once for their neighbourhood
# A joiner asks at most this many peers of its stage, and as many others, where the swarm is, and
# hands its announcement to them (the members pass it on at once: peer/passing.py).
SAMPLED = 8
# A reply names at most this many bytes of addresses and of joiners' announcements each (a swarm
# of a few thousand peers); past it, a joiner finds the rest as a member would (look_up).
REPLY_BYTES = PASS_BYTES // 2
ERRORS = (PeerUnavailable, RemoteRefused, MessageError, TimeoutError)


@dataclass(frozen=True)
class Contact:
    """A peer a joiner may talk to: from its announcement, or from a member's view (a member of
    the view's round joined at that round at the latest, and has reached its first step)."""

    peer_id: str
    stage: int
    addresses: tuple[str, ...]
    joined_round: int
    step: int

    @classmethod
    def of(cls, a: records.PeerAnnouncement) -> Contact:
        return cls(a.peer_id, a.stage, tuple(a.addresses), a.joined_round, a.step)


@dataclass(frozen=True)
class Found:
    """What a member told a joiner: its view, whom to talk to, and the joiners it holds."""

    view: MembershipView
    contacts: list[Contact]
    joiners: list[records.PeerAnnouncement]
    asked: str  # the member whose answer this is
    gone: frozenset[str] = frozenset()  # members it holds for gone (rpc.Neighbourhood.gone)


def near_stages(stage: int, num_stages: int) -> list[int]:
    return [s for s in (stage - 1, stage, stage + 1) if 0 <= s < num_stages]


def our_rank(me: str, peer: str) -> bytes:
    """Where `peer` stands in an order of `me`'s own (sha256 of our id / theirs): joiners that go
    through the same peers spread their questions and downloads over them."""
    return hashlib.sha256(f"{me}/{peer}".encode()).digest()


def in_our_order(me: str, peers: Iterable[str]) -> list[str]:
    return sorted(peers, key=lambda p: our_rank(me, p))


def entry_point_ids(maddrs: Iterable[str]) -> list[str]:
    """The peer ids of the run's entry points (multiaddrs ending in /p2p/ID)."""
    return [str(Multiaddr(m)["p2p"]) for m in maddrs]


class NeighbourhoodServer:
    """A member's side: answers `rpc_neighbourhood` from its latest view and what it knows."""

    def __init__(self, ctx: PeerContext, addresses: Sequence[str]) -> None:
        self.ctx, self.own = ctx, tuple(addresses)
        ctx.transport.register("rpc_neighbourhood", self.rpc_neighbourhood)

    async def rpc_neighbourhood(
        self, peer_id: str, header: codec.Message, tensors: list[object]
    ) -> tuple[codec.Message, list[object]]:
        ctx = self.ctx
        if not isinstance(header, rpc.NeighbourhoodRequest) or header.run_id != ctx.run_id:
            raise MessageError(f"expected a neighbourhood request for run {ctx.run_id!r}")
        view = ctx.rounds.latest()
        if view is None or ctx.me not in view.members():
            raise MessageError("this peer holds no view of the swarm yet")
        if not 0 <= header.stage < view.num_stages:
            raise MessageError(f"stage {header.stage} is outside 0..{view.num_stages - 1}")
        known = ctx.rounds.addresses | {ctx.me: self.own}
        peers, addresses, size = [], [], 0
        for stage in near_stages(header.stage, view.num_stages):
            for peer in view.stages[stage]:
                if peer in known and size < REPLY_BYTES:
                    peers.append(peer)
                    addresses.append(tuple(known[peer]))
                    size += len(peer) + sum(len(a) for a in known[peer])
        joining, size = [], 0
        for entry in ctx.rounds.passing.book.announcements.values():
            if entry.record.joined_round > view.round and size < REPLY_BYTES:
                joining.append(entry.sealed)
                size += len(entry.sealed)
        members = view.members()
        reported = {peer for peer, _, round_ in ctx.rounds.passing.book.gone() if round_ >= view.round}
        gone = tuple(sorted((reported | set(ctx.rounds.dead)) & members))
        reply = rpc.Neighbourhood(
            ctx.run_id,
            header.stage,
            view.round,
            view.stages,
            tuple(peers),
            tuple(addresses),
            tuple(joining),
            gone,
        )
        return reply, []


async def ask(
    transport: Transport, peer: str, run_id: str, stage: int, num_stages: int, inner_steps: int
) -> Found:
    """`peer`'s neighbourhood for a joiner of `stage`, checked; raises one of ERRORS."""
    request = rpc.NeighbourhoodRequest(run_id, stage)
    reply, _ = await transport.call(peer, "rpc_neighbourhood", request, timeout=PROBE_TIMEOUT)
    if not isinstance(reply, rpc.Neighbourhood) or reply.run_id != run_id or reply.stage != stage:
        raise MessageError(f"{peer} answered a neighbourhood request with {reply.TAG!r}")
    try:
        view = MembershipView(round=reply.round, stages=reply.view)
    except ValueError as e:
        raise MessageError(f"{peer}'s view is malformed: {e}") from e
    if view.num_stages != num_stages or peer not in view.members():
        raise MessageError(f"{peer}'s view has {view.num_stages} stages, or leaves {peer} out")
    stages = near_stages(stage, num_stages)
    near = {p for s in stages for p in view.stages[s]}
    contacts = [
        Contact(p, view.rank_of(p)[0], a, reply.round, reply.round * inner_steps)
        for p, a in zip(reply.peers, reply.addresses, strict=True)
        if p in near
    ]
    joiners = []
    for data in reply.joining:
        try:
            record = open_sealed(data, run_id).record
        except MessageError as e:
            logger.info("a joiner's announcement from %s refused: %s", peer, e)
            continue
        if isinstance(record, records.PeerAnnouncement) and 0 <= record.stage < num_stages:
            joiners.append(record)
    named = {c.peer_id for c in contacts}
    contacts += [Contact.of(a) for a in joiners if a.stage in stages and a.peer_id not in named]
    return Found(view, contacts, joiners, peer, frozenset(reply.gone) & view.members())


def candidates(transport: Transport, directory: RunDirectory, cfg: RunConfig) -> list[str]:
    """Peers that may be members: the run's entry points and the peers our DHT node knows, in an
    order of our own (so joiners spread their questions)."""
    me = transport.peer_id
    entry = entry_point_ids(cfg.network.initial_peers)
    return in_our_order(me, (p for p in dict.fromkeys([*entry, *directory.known_nodes()]) if p != me))


async def find(
    transport: Transport, directory: RunDirectory, cfg: RunConfig, stage: int, *, own_stage: bool = True
) -> Found | None:
    """The neighbourhood of a joiner of `stage`, from a member (the module's steps 1-3); None if
    no member answered (or in a closed run). Without `own_stage` (--stage auto, which needs the
    view only), no member of `stage` is asked besides the first ones (step 2)."""
    if cfg.authority:
        return None
    me, run_id, num_stages = transport.peer_id, directory.run_id, cfg.num_stages
    asked = candidates(transport, directory, cfg)[:ASKED]
    answers = await asyncio.gather(
        *(ask(transport, p, run_id, stage, num_stages, cfg.outer.inner_steps) for p in asked),
        return_exceptions=True,
    )
    found = [a for a in answers if isinstance(a, Found)]
    for peer, a in zip(asked, answers, strict=True):
        if not isinstance(a, Found):
            logger.info("%s gave no neighbourhood: %s", peer, a)
    if not found:
        return None
    # The round most answers agree on (one member that lies about its round is outvoted), the
    # newest on a tie; of those, a member of our stage's answer.
    agree = Counter(f.view.round for f in found)
    best = max(found, key=lambda f: (agree[f.view.round], f.view.round, f.asked in f.view.stages[stage]))
    if own_stage and best.asked not in best.view.stages[stage]:
        agreeing = [f for f in found if f.view == best.view]
        best = await _from_own_stage(transport, directory, cfg, agreeing, stage) or best
    gone = frozenset().union(*(f.gone for f in found if f.view == best.view), best.gone)
    return Found(best.view, [c for c in best.contacts if c.peer_id != me], best.joiners, best.asked, gone)


async def _from_own_stage(
    transport: Transport, directory: RunDirectory, cfg: RunConfig, found: list[Found], stage: int
) -> Found | None:
    """Ask a member of `stage` (its neighbourhood is ours): one whose address an answer of `found`
    (all of one view) names, or one found in a bucket of the stage's places in that view (one DHT
    read)."""
    me, view = transport.peer_id, found[0].view
    known = {c.peer_id: c.addresses for f in found for c in f.contacts if c.stage == stage}
    if not known:
        bucket = directory_bucket(view, random.Random(me).choice(view.stages[stage]))
        try:  # bounded by DHT_CALL_TIMEOUT (directory.answer)
            listed = await asyncio.to_thread(directory.read_bucket, bucket)
        except DHT_ERRORS as e:
            logger.info("could not read bucket %s of the directory: %s", bucket, e)
            return None
        known = {a.peer_id: tuple(a.addresses) for a in listed if a.peer_id in view.stages[stage]}
    for peer in in_our_order(me, known)[:2]:
        await transport.connect(peer, known[peer], timeout=PROBE_TIMEOUT)
        try:
            return await ask(transport, peer, directory.run_id, stage, cfg.num_stages, cfg.outer.inner_steps)
        except ERRORS as e:
            logger.info("%s, of stage %d, gave no neighbourhood: %s", peer, stage, e)
    return None


def stage_counts(found: Found) -> list[tuple[str, int]]:
    """(peer, stage) of every member of `found`'s view that no answer holds for gone, and every
    joiner it names (a joiner's newest announcement): what --stage auto counts."""
    pairs = {p: s for s, peers in enumerate(found.view.stages) for p in peers if p not in found.gone}
    for a in found.joiners:
        pairs.setdefault(a.peer_id, a.stage)
    return sorted(pairs.items())


def sampled(contacts: Iterable[Contact], stage: int, me: str, most: int) -> list[Contact]:
    """At most `most` of `contacts` of `stage` and `most` of the others, in an order of ours:
    whom a joiner asks where the swarm is and hands its announcement to (the members pass it on)."""
    order = sorted(contacts, key=lambda c: our_rank(me, c.peer_id))
    own = [c for c in order if c.stage == stage][:most]
    return own + [c for c in order if c.stage != stage][:most]


async def contacts(
    ctx: PeerContext, stage: int, found: Found | None = None, *, ask: bool = True
) -> tuple[list[Contact], str]:
    """Whom a joiner of `stage` talks to, and through whom it learned them: `found` (a member's
    answer already in hand), a member asked now (with `ask`), or the whole directory
    ("directory"). A join attempt that failed after a member's answer reads the directory next
    (peer/joining.py), so a member that lies costs a joiner one attempt."""
    if found is None and ask:
        found = await find(ctx.transport, ctx.rounds.directory, ctx.cfg, stage)
    if found is not None:
        for c in found.contacts:
            ctx.rounds.addresses[c.peer_id] = c.addresses
        return found.contacts, found.asked
    announcements = await asyncio.to_thread(ctx.rounds.read_peers)
    return [Contact.of(a) for a in announcements if a.peer_id != ctx.me], "directory"
