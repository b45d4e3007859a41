"""Joining a running swarm and serving state to joiners: the round to enter at, and the state.

A newcomer asks the live peers where they are (rpc_status), announces the round two after the
furthest step it hears of (so every member reads the announcement before that boundary), and
downloads its stage's state at that boundary from the live replicas of the stage. Each replica
keeps a snapshot taken right after the outer step that closed the previous round (theta == phi
then; with an overlapped outer step, which is still in flight at the boundary, its fast weights
there serve as the joiner's phi and theta: see `_snapshot`), with a manifest of chunk hashes (rpc_fetch_state), and serves it one chunk per request
(rpc_fetch_chunk). The newcomer adopts one replica's snapshot, takes its chunks from every replica
holding the same bytes in parallel (peer/donors.py, protocol/chunks.py), checks the whole against
the announced weights hash, and adopts that replica's view of the round, which admits it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import torch
from hivemind.utils.multiaddr import Multiaddr

from noloco_swarm.peer import events
from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.donors import DONOR_ERRORS, Pacer, Snapshot, download_state
from noloco_swarm.peer.exchange import ByteLedger
from noloco_swarm.peer.rounds import DHT_ERRORS, PROBE_TIMEOUT, ask_status
from noloco_swarm.peer.transport import Transport
from noloco_swarm.protocol import messages
from noloco_swarm.protocol.clock import StepClock
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.protocol.messages import MessageError, StateManifest
from noloco_swarm.protocol.plan import JOIN_MARGIN_ROUNDS, join_round

logger = logging.getLogger(__name__)
STATUS_TIMEOUT = 10.0
R = TypeVar("R", messages.StateRequest, messages.ChunkRequest)


class RunEnding(RuntimeError):
    """The run ends before the first round this peer could join at: there is nothing left to train."""


async def pick_join_round(
    transport: Transport,
    run_id: str,
    others: list[messages.PeerAnnouncement],
    clock: StepClock,
    end_step: int,
) -> int:
    """The round to join at: two after the furthest step any live peer reports (asked directly,
    since the announcements' step is only as fresh as the last heartbeat)."""

    answers = await asyncio.gather(
        *(ask_status(transport, a.peer_id, run_id, STATUS_TIMEOUT) for a in others), return_exceptions=True
    )
    steps = [a.step for a in others] + [x.step for x in answers if isinstance(x, messages.PeerStatus)]
    target = join_round(max(steps, default=0), clock.inner_steps)
    if clock.round_start(target) >= end_step:
        raise RunEnding(
            f"the run ends at step {end_step}, before round {target} (step {clock.round_start(target)}) "
            "where this peer could join"
        )
    return target


def servers_for(others: list[messages.PeerAnnouncement], stage: int, round_: int) -> list[str]:
    """Peers of `stage` that were members before `round_` (they hold its state)."""
    return [a.peer_id for a in others if a.stage == stage and a.joined_round < round_]


def check_request(
    header: messages.Message, run_id: str, stage: int, kind: type[R] = messages.StateRequest
) -> R:
    if not isinstance(header, kind):
        raise MessageError(f"expected a {kind.TAG} request")
    if header.run_id != run_id or header.stage != stage:
        raise MessageError(
            f"this is stage {stage} of {run_id!r}, not stage {header.stage} of {header.run_id!r}"
        )
    return header


class Joining:
    """This peer's joins (at start-up or after an exclusion) and the state it serves to joiners."""

    def __init__(self, ctx: PeerContext, ledger: ByteLedger, announce: Callable[[], Awaitable[None]]) -> None:
        self.ctx, self.ledger, self._announce = ctx, ledger, announce
        self.joined_round = 0
        self.snapshots: dict[int, Snapshot] = {}  # round -> state served to that round's joiners
        self.pacer = Pacer(ctx.cfg.peer.state_serve_rate)
        ctx.transport.register("rpc_fetch_state", self.rpc_fetch_state)
        ctx.transport.register("rpc_fetch_chunk", self.rpc_fetch_chunk)

    async def keep_for_joiners(self, previous: MembershipView, view: MembershipView) -> None:
        """At a boundary: snapshot our state (just after the outer step) if `view` admits joiners."""
        ctx = self.ctx
        joiners = [p for p in view.stages[ctx.stage] if p not in previous.members()]
        if joiners:
            snapshot = await asyncio.to_thread(self._snapshot, view)
            self.snapshots[view.round] = snapshot
            digest = snapshot.manifest(ctx.run_id, ctx.stage).snapshot
            ctx.events.emit(events.Joiners(round=view.round, peers=joiners, snapshot=digest))
        for old in [r for r in self.snapshots if r < view.round]:
            del self.snapshots[old]

    def _snapshot(self, view: MembershipView) -> Snapshot:
        replica = self.ctx.replica
        parts, adam_step = replica.state_parts()
        if self.ctx.cfg.outer.overlap_steps > 0:
            # This boundary's outer step is still in flight here (overlap), and the joiner was no
            # member of the round it closes, so it takes no part in it: it starts from our fast
            # weights at the boundary as its slow and fast weights, with our outer momentum. Every
            # part is of this one boundary, and they hash to what we announce.
            parts["phi"] = replica.theta()
        return Snapshot.take(parts, adam_step, replica.state_hash(), view, self.ctx.step)

    async def join_late(self, end_step: int) -> None:
        """Enter a running swarm two rounds ahead with a live replica's state."""
        ctx = self.ctx
        timeout = ctx.cfg.peer.join_timeout
        deadline = time.monotonic() + timeout
        while True:
            others = [a for a in await asyncio.to_thread(ctx.rounds.read_peers) if a.peer_id != ctx.me]
            async with asyncio.TaskGroup() as group:
                for a in others:
                    group.create_task(ctx.transport.connect(a.peer_id, a.addresses, timeout=PROBE_TIMEOUT))
            target = await pick_join_round(ctx.transport, ctx.run_id, others, ctx.clock, end_step)
            self.joined_round = target
            await self._announce()
            start = ctx.clock.round_start(target)
            ctx.events.emit(events.Joining(round=target, step=start))
            logger.warning("joining the running swarm at round %d (step %d)", target, start)
            servers = servers_for(others, ctx.stage, target)
            if not servers and time.monotonic() > deadline:
                raise RuntimeError(
                    f"no live replica of stage {ctx.stage} holds its state; this peer cannot join"
                )
            if not servers:  # e.g. our DHT node lost every neighbour during a cut: reconnect
                logger.warning("no replica of stage %d in the directory yet; reconnecting", ctx.stage)
                await self._reconnect()
            # Spread joiners over the servers: each adopts the snapshot of the first in its own order.
            servers.sort(key=lambda p: hashlib.sha256(f"{ctx.me}/{p}".encode()).digest())
            try:
                view, step = await self._fetch_state(servers, target, max(1.0, deadline - time.monotonic()))
            except (*DONOR_ERRORS, TimeoutError) as e:
                logger.warning("state fetch for round %d failed: %s", target, e)
            else:
                ctx.step = step
                ctx.rounds.set(view)
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not join the run within {timeout:.0f} s")
            await asyncio.sleep(1.0)

    async def _fetch_state(
        self, servers: list[str], round_: int, timeout: float
    ) -> tuple[MembershipView, int]:
        """Download and load our stage's state at the start of `round_` from `servers` (in order of
        preference); the first's view of the round (it admits us) and the step the round starts at.
        Raises what `download_state` raises, or MessageError; the replica is untouched then."""
        ctx, replica = self.ctx, self.ctx.replica

        def admits(manifest: StateManifest) -> bool:
            stages = manifest.view
            return len(stages) == ctx.cfg.num_stages and ctx.me in stages[ctx.stage]

        got = await download_state(
            ctx.transport,
            servers,
            run_id=ctx.run_id,
            stage=ctx.stage,
            round_=round_,
            numel=replica.phi.numel(),
            timeout=timeout,
            admits=admits,
            emit=ctx.events.emit,
        )
        manifest = got.manifest
        try:
            view = MembershipView(round=round_, stages=manifest.view)  # validates the ids' order
        except ValueError as e:
            raise MessageError(f"{got.target}'s view of round {round_} is malformed: {e}") from e
        backup = replica.state_parts(with_theta=True)
        await asyncio.to_thread(replica.load_state_parts, got.parts, manifest.adam_step)
        if replica.state_hash() != manifest.state_hash:
            replica.load_state_parts(*backup)
            raise MessageError(f"the state of {got.target} does not hash to what it announced")
        self.ledger.reset()  # the fetch is no outer exchange
        ctx.events.emit(
            events.Joined(
                round=round_,
                step=manifest.step,
                server=got.target,
                state_hash=manifest.state_hash,
                peer_id=ctx.me,
                snapshot=manifest.snapshot,
                sent=got.sent,
            )
        )
        logger.warning(
            "loaded the state of %s for round %d; chunks per donor: %s%s",
            got.target,
            round_,
            got.sent,
            f"; lost {sorted(got.lost)}" if got.lost else "",
        )
        return view, manifest.step

    async def _reconnect(self) -> None:
        """Dial the run's entry points again and refill our DHT node's routing table from them."""
        ctx, entry = self.ctx, self.ctx.cfg.network.initial_peers
        ids = [str(Multiaddr(m)["p2p"]) for m in entry]
        async with asyncio.TaskGroup() as group:
            for peer, maddr in zip(ids, entry, strict=True):
                group.create_task(ctx.transport.connect(peer, [maddr], timeout=PROBE_TIMEOUT))
        try:
            answered = await asyncio.to_thread(ctx.rounds.directory.rebootstrap, ids)
        except DHT_ERRORS as e:
            logger.warning("could not reach the run's entry points again: %s", e)
            return
        logger.warning("%d of %d entry points answered", answered, len(ids))

    async def rpc_fetch_state(
        self, peer_id: str, header: messages.Message, tensors: list[torch.Tensor]
    ) -> tuple[messages.Message, list[torch.Tensor]]:
        """A peer joining our stage at a round boundary asks for the manifest of our state there."""
        ctx = self.ctx
        request = check_request(header, ctx.run_id, ctx.stage)
        if request.round > ctx.clock.round_of(ctx.step) + JOIN_MARGIN_ROUNDS + 1:
            raise MessageError(f"round {request.round} is too far ahead (this peer is at step {ctx.step})")
        wait = min(ctx.cfg.peer.join_timeout, ctx.transport.config.serve_timeout - 5.0)
        view = await ctx.rounds.wait(request.round, timeout=wait)
        snapshot = self._admitted(peer_id, request.round)
        if snapshot.view != view:
            raise MessageError(f"peer {peer_id} is not admitted at round {request.round} by this peer's view")
        return snapshot.manifest(ctx.run_id, ctx.stage), []

    async def rpc_fetch_chunk(
        self, peer_id: str, header: messages.Message, tensors: list[torch.Tensor]
    ) -> tuple[messages.Message, list[torch.Tensor]]:
        """A joiner that holds our manifest downloads one chunk of that snapshot."""
        ctx = self.ctx
        request = check_request(header, ctx.run_id, ctx.stage, messages.ChunkRequest)
        reply, tensor = self._admitted(peer_id, request.round).chunk(ctx.run_id, ctx.stage, request)
        nbytes = tensor.numel() * tensor.element_size()
        await self.pacer.wait(nbytes)
        ctx.events.emit(events.ServedState(round=request.round, peer=peer_id, chunk=request.index))
        # Keep the state we serve out of the next outer step's byte count with this peer.
        self.ledger.exclude(peer_id, nbytes)
        return reply, [tensor]

    def _admitted(self, peer_id: str, round_: int) -> Snapshot:
        snapshot = self.snapshots.get(round_)
        if snapshot is None or peer_id not in snapshot.view.stages[self.ctx.stage]:
            raise MessageError(f"peer {peer_id} is not admitted at round {round_} by this peer's view")
        return snapshot
