"""The state a peer keeps for the joiners of its stage, and serves them chunk by chunk.

At a boundary, a replica whose records announce a joiner of its stage for the next round takes a
snapshot right after the outer step there (theta == phi then; with an overlapped outer step,
which is still in flight at the boundary, its fast weights there serve as the joiner's phi and
theta: see `_snapshot`), with a manifest of chunk hashes (rpc_fetch_state), and serves it one chunk
per request (rpc_fetch_chunk) while the swarm trains that round. A joiner whose download would
outlast it announces a later round (peer/postpone.py), and the snapshot is kept for it until then.
A replica that reads a joiner only at the joiner's own boundary keeps its state there instead,
and the swarm's first round with the joiner waits for its download (the late path).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TypeVar

import torch

from noloco_swarm.peer import events, failpoints
from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.donors import MIB, Snapshot
from noloco_swarm.peer.exchange.ledger import ByteLedger
from noloco_swarm.peer.net.limits import Accepts
from noloco_swarm.peer.net.streams import Pacer
from noloco_swarm.peer.postpone import MAX_LEAD_ROUNDS
from noloco_swarm.peer.views import Held
from noloco_swarm.protocol import codec, rpc
from noloco_swarm.protocol.codec import MessageError
from noloco_swarm.protocol.membership import MembershipView, donor_serves, entering, newest, pending_joiners

logger = logging.getLogger(__name__)
R = TypeVar("R", rpc.StateRequest, rpc.ChunkRequest)


def check_request(header: codec.Message, run_id: str, stage: int, kind: type[R] = rpc.StateRequest) -> R:
    if not isinstance(header, kind):
        raise MessageError(f"expected a {kind.TAG} request")
    if header.run_id != run_id or header.stage != stage:
        raise MessageError(
            f"this is stage {stage} of {run_id!r}, not stage {header.stage} of {header.run_id!r}"
        )
    return header


class StateServer:
    """The snapshots this peer keeps for joiners of its stage, and the verbs that serve them."""

    def __init__(self, ctx: PeerContext, ledger: ByteLedger) -> None:
        self.ctx, self.ledger = ctx, ledger
        self.snapshots: dict[int, Snapshot] = {}  # the round of the boundary it was taken at -> it
        self.pacer = Pacer(ctx.cfg.peer.state_serve_rate * MIB)
        ctx.transport.register("rpc_fetch_state", self.rpc_fetch_state)
        ctx.transport.register("rpc_fetch_chunk", self.rpc_fetch_chunk, Accepts(direct_only=True))

    async def keep_for_joiners(self, previous: MembershipView, view: MembershipView, held: Held) -> None:
        """At a boundary: snapshot our state (just after the outer step) for the joiners of our
        stage that the records `held` announce for the next round (they download it during this
        one, and nobody waits for them; one that moves its round further off keeps that snapshot),
        and for those `view` admits that we keep nothing for (they download it now, and the round
        waits for them)."""
        ctx = self.ctx
        listings = newest(held[0])
        new = entering(previous, view, listings)
        joiners = [p for p in view.stages[ctx.stage] if p in new and self._pending_snapshot(p) is None]
        # One that moved its round further off (peer/postpone.py) still downloads what we kept.
        pending = frozenset(
            p for p in pending_joiners(view, ctx.stage, listings) if self._pending_snapshot(p) is None
        )
        if pending and failpoints.fire("miss_joiners", "rpc_fetch_state"):  # a test's announcement read late
            logger.warning("failpoint miss_joiners:rpc_fetch_state: no state kept for %s", sorted(pending))
            pending = frozenset()
        if joiners or pending:
            snapshot = await asyncio.to_thread(self._snapshot, view, pending)
            self.snapshots[view.round] = snapshot
            if joiners:
                ctx.events.emit(events.Joiners(round=view.round, peers=joiners, snapshot=snapshot.digest))
            if pending:
                ctx.events.emit(
                    events.Joiners(round=view.round + 1, peers=sorted(pending), snapshot=snapshot.digest)
                )
        # A joiner downloads during the round before its own (or, late, during its own), or from
        # then until the later round it moved to, at most MAX_LEAD_ROUNDS.
        due = {x.peer for x in listings if x.joined_round >= view.round}
        for old in [
            r
            for r, kept in self.snapshots.items()
            if r < view.round - 1 and not (kept.pending & due and r >= view.round - MAX_LEAD_ROUNDS)
        ]:
            del self.snapshots[old]

    def _pending_snapshot(self, peer: str) -> Snapshot | None:
        """The latest snapshot we keep for `peer` as a joiner (of the boundary before its round)."""
        kept = [r for r, snapshot in self.snapshots.items() if peer in snapshot.pending]
        return self.snapshots[max(kept)] if kept else None

    def _snapshot(self, view: MembershipView, pending: frozenset[str]) -> Snapshot:
        replica = self.ctx.replica
        parts, adam_step = replica.state_parts()
        if self.ctx.cfg.outer.overlap_steps > 0:
            # This boundary's outer step is still in flight here (overlap), and the joiner was no
            # member of the round it closes, so it takes no part in it: it starts from our fast
            # weights at the boundary as its slow and fast weights, with our outer momentum. Every
            # part is of this one boundary, and they hash to what we announce.
            parts["phi"] = replica.theta()
        return Snapshot.take(parts, adam_step, replica.state_hash(), view, self.ctx.step, pending=pending)

    async def rpc_fetch_state(
        self, peer_id: str, header: codec.Message, tensors: list[torch.Tensor]
    ) -> tuple[codec.Message, list[torch.Tensor]]:
        """A peer joining our stage at a round asks for the manifest of the state we keep for it:
        of the boundary before its round if we read its announcement there (it downloads while
        the swarm trains), else of its round's (see StateRequest)."""
        ctx = self.ctx
        request = check_request(header, ctx.run_id, ctx.stage)
        round_ = request.round
        if not donor_serves(ctx.clock.round_of(ctx.step), round_):  # see pick_join_round
            raise MessageError(f"round {round_} is too far ahead (this peer is at step {ctx.step})")
        if round_ < 1:
            raise MessageError("nobody joins at round 0: it is the founders'")
        until = time.monotonic() + min(ctx.cfg.peer.join_timeout, ctx.transport.config.serve_timeout - 5.0)
        if not request.admitted:
            await ctx.rounds.wait(round_ - 1, timeout=until - time.monotonic())
            early = self._pending_snapshot(peer_id)
            if early is not None:
                return early.manifest(ctx.run_id, ctx.stage), []
        view = await ctx.rounds.wait(round_, timeout=until - time.monotonic())
        if peer_id not in view.stages[ctx.stage]:
            raise MessageError(f"peer {peer_id} is not admitted at round {round_} by this peer's view")
        if request.admitted:  # it holds the state we kept for it at a boundary before
            early = self._pending_snapshot(peer_id)
            if early is None:
                raise MessageError(
                    f"this peer kept no state for {peer_id} at a boundary before round {round_}"
                )
            return early.manifest(ctx.run_id, ctx.stage, view), []
        snapshot = self.snapshots.get(round_)
        if snapshot is None or snapshot.view != view:
            raise MessageError(f"this peer kept no state for {peer_id} at round {round_}")
        return snapshot.manifest(ctx.run_id, ctx.stage), []

    async def rpc_fetch_chunk(
        self, peer_id: str, header: codec.Message, tensors: list[torch.Tensor]
    ) -> tuple[codec.Message, list[torch.Tensor]]:
        """A joiner that holds our manifest downloads one chunk of that snapshot."""
        ctx = self.ctx
        request = check_request(header, ctx.run_id, ctx.stage, rpc.ChunkRequest)
        reply, tensor = self._kept_for(peer_id, request).chunk(ctx.run_id, ctx.stage, request)
        nbytes = tensor.numel() * tensor.element_size()
        await self.pacer.wait(nbytes)
        ctx.events.emit(events.ServedState(round=request.round, peer=peer_id, chunk=request.index))
        # Keep the state we serve out of the next outer step's byte count with this peer.
        self.ledger.exclude(peer_id, nbytes)
        return reply, [tensor]

    def _kept_for(self, peer_id: str, request: rpc.ChunkRequest) -> Snapshot:
        """The snapshot `request` names, if we keep it for `peer_id` (see Snapshot.serves)."""
        for snapshot in self.snapshots.values():
            if snapshot.digest == request.snapshot and snapshot.serves(peer_id, self.ctx.stage):
                return snapshot
        raise MessageError(
            f"this peer keeps no snapshot {request.snapshot[:12]} for {peer_id} (round {request.round}): "
            "ask for its manifest again"
        )
