"""Joining a running swarm and serving state to joiners: the round to enter at, and the state.

A newcomer asks the live peers where they are (rpc_status), announces the round two after the
furthest step it hears of (so every member reads the announcement before that boundary), and
downloads its stage's state at that boundary from a live replica of the stage. The replica keeps
a snapshot taken right after the outer step that closed the previous round (theta == phi then)
and serves it one part per request (phi, delta, the AdamW moments), so no reply is bigger than
one stage's weights. The newcomer checks the parts against the announced weights hash, and
adopts the server's view of the round, which admits it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
from hivemind.utils.multiaddr import Multiaddr

from noloco_swarm.peer import events
from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.exchange import ByteLedger
from noloco_swarm.peer.rounds import DHT_ERRORS, PROBE_TIMEOUT, ask_status
from noloco_swarm.peer.streams import PeerUnavailable, RemoteRefused
from noloco_swarm.peer.transport import Transport
from noloco_swarm.protocol import messages
from noloco_swarm.protocol.clock import StepClock
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.protocol.messages import STATE_PARTS, MessageError, StateReply, TensorMeta
from noloco_swarm.protocol.plan import JOIN_MARGIN_ROUNDS, join_round
from noloco_swarm.train.replica import StageReplica

logger = logging.getLogger(__name__)
STATUS_TIMEOUT = 10.0


@dataclass
class Snapshot:
    """A replica's state at the start of a round, kept for the peers that join at that round."""

    view: MembershipView
    step: int
    adam_step: int
    state_hash: str
    parts: dict[str, torch.Tensor]

    @classmethod
    def take(cls, replica: StageReplica, view: MembershipView, step: int) -> Snapshot:
        parts, adam_step = replica.state_parts()
        return cls(view, step, adam_step, replica.state_hash(), parts)

    def reply(self, run_id: str, stage: int, part: str) -> tuple[StateReply, torch.Tensor]:
        tensor = self.parts[part]
        header = StateReply(
            run_id=run_id,
            stage=stage,
            round=self.view.round,
            step=self.step,
            view=self.view.stages,
            adam_step=self.adam_step,
            state_hash=self.state_hash,
            part=part,
            meta=TensorMeta.of(tensor),
        )
        return header, tensor


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


async def fetch_state(
    transport: Transport,
    server: str,
    run_id: str,
    round_: int,
    replica: StageReplica,
    *,
    me: str,
    timeout: float,
) -> tuple[MembershipView, int]:
    """Download `replica`'s stage state at the start of `round_` from `server` and load it.

    Returns the server's view of the round (it admits us) and the step the round starts at.
    Raises MessageError (nothing is loaded) if the server sends anything inconsistent.
    """
    stage, n = replica.stage, replica.phi.numel()
    parts: dict[str, torch.Tensor] = {}
    first: StateReply | None = None
    for part in STATE_PARTS:
        request = messages.StateRequest(run_id, stage, round_, part)
        reply, tensors = await transport.call(server, "rpc_fetch_state", request, timeout=timeout)
        if not isinstance(reply, StateReply) or reply.part != part or len(tensors) != 1:
            raise MessageError(f"{server} answered the state request for {part} with something else")
        if reply.stage != stage or reply.round != round_ or reply.meta.shape != (n,):
            raise MessageError(
                f"{server} sent state for stage {reply.stage} round {reply.round}, {reply.meta}"
            )
        if first is not None and (reply.view, reply.state_hash, reply.adam_step, reply.step) != (
            first.view,
            first.state_hash,
            first.adam_step,
            first.step,
        ):
            raise MessageError(f"{server} changed its snapshot between parts")
        first = first or reply
        parts[part] = tensors[0]
    assert first is not None
    view = MembershipView(round=round_, stages=first.view)  # validates the ids' order
    if len(view.stages) != replica.cfg.num_stages or me not in view.stages[stage]:
        raise MessageError(f"{server}'s view of round {round_} does not admit this peer")
    backup = replica.state_parts()
    await asyncio.to_thread(replica.load_state_parts, parts, first.adam_step)
    if replica.state_hash() != first.state_hash:
        replica.load_state_parts(*backup)
        raise MessageError(f"the state from {server} does not hash to what it announced")
    return view, first.step


def servers_for(others: list[messages.PeerAnnouncement], stage: int, round_: int) -> list[str]:
    """Peers of `stage` that were members before `round_` (they hold its state)."""
    return [a.peer_id for a in others if a.stage == stage and a.joined_round < round_]


def check_request(header: messages.Message, run_id: str, stage: int) -> messages.StateRequest:
    if not isinstance(header, messages.StateRequest):
        raise MessageError("expected a state request")
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
        ctx.transport.register("rpc_fetch_state", self.rpc_fetch_state)

    async def keep_for_joiners(self, previous: MembershipView, view: MembershipView) -> None:
        """At a boundary: snapshot our state (just after the outer step) if `view` admits joiners."""
        ctx = self.ctx
        joiners = [p for p in view.stages[ctx.stage] if p not in previous.members()]
        if joiners:
            self.snapshots[view.round] = await asyncio.to_thread(Snapshot.take, ctx.replica, view, ctx.step)
            ctx.events.emit(events.Joiners(round=view.round, peers=joiners))
        for old in [r for r in self.snapshots if r < view.round]:
            del self.snapshots[old]

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
            # Spread joiners over the servers; each joiner tries them all, in its own order.
            servers.sort(key=lambda p: hashlib.sha256(f"{ctx.me}/{p}".encode()).digest())
            for server in servers:
                try:
                    view, step = await fetch_state(
                        ctx.transport, server, ctx.run_id, target, ctx.replica, me=ctx.me, timeout=timeout
                    )
                except (PeerUnavailable, RemoteRefused, MessageError) as e:
                    logger.warning("state fetch from %s for round %d failed: %s", server, target, e)
                    continue
                ctx.step = step
                self.ledger.reset()  # the fetch is no outer exchange
                ctx.events.emit(
                    events.Joined(
                        round=target,
                        step=step,
                        server=server,
                        state_hash=ctx.replica.state_hash(),
                        peer_id=ctx.me,
                    )
                )
                ctx.rounds.set(view)
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not join the run within {timeout:.0f} s")
            await asyncio.sleep(1.0)

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
        """A peer joining our stage at a round boundary downloads our state at that boundary."""
        ctx = self.ctx
        request = check_request(header, ctx.run_id, ctx.stage)
        if request.round > ctx.clock.round_of(ctx.step) + JOIN_MARGIN_ROUNDS + 1:
            raise MessageError(f"round {request.round} is too far ahead (this peer is at step {ctx.step})")
        wait = min(ctx.cfg.peer.join_timeout, ctx.transport.config.serve_timeout - 5.0)
        view = await ctx.rounds.wait(request.round, timeout=wait)
        snapshot = self.snapshots.get(request.round)
        if snapshot is None or peer_id not in snapshot.view.stages[ctx.stage] or snapshot.view != view:
            raise MessageError(f"peer {peer_id} is not admitted at round {request.round} by this peer's view")
        reply, tensor = snapshot.reply(ctx.run_id, ctx.stage, request.part)
        ctx.events.emit(events.ServedState(round=request.round, peer=peer_id, part=request.part))
        # Keep the state we serve out of the next outer step's byte count with this peer.
        self.ledger.exclude(peer_id, tensor.numel() * tensor.element_size())
        return reply, [tensor]
