"""A peer's lifecycle and run loop: join the run, train its stage, take outer steps, report.

One asyncio loop per peer. Torch work runs in a worker thread (`asyncio.to_thread`) so the loop
keeps serving other peers' requests while this peer computes. Each protocol verb has a room that
owns its state, and this file only sequences them:

  inner.py       every inner step: stage-0 data, rows sent on and collected (rpc_forward)
  exchange/      every H steps: one OuterExchange with the round's group (rpc_exchange)
  outer_steps.py the outer step at each boundary, applied at once or k steps later (overlap)
  views.py       the frozen view of each round
  liveness.py    probes of peers that failed us, and gone reports
  joining.py     entering a running swarm, and serving state to joiners (rpc_fetch_state)
  resume.py      checkpoints at boundaries, and a stopped swarm coming back from them
  evaluation.py  the end-of-run validation along fixed paths (rpc_eval)
  events.py      what happened, as typed records, to every sink

Membership is frozen per round. Round 0 starts once every stage has its replicas announced; at
every later boundary each peer builds the next view from the DHT with the same pure rule
(protocol.membership.next_view). Who sends what to whom at step t is protocol.plan's answer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from noloco_swarm.data.stream import train_batches
from noloco_swarm.peer import events, failpoints
from noloco_swarm.peer.checkpoint import Checkpoint
from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.detours import said_routing
from noloco_swarm.peer.directory import RunDirectory
from noloco_swarm.peer.evaluation import Evaluation
from noloco_swarm.peer.exchange.board import ExchangeBoard
from noloco_swarm.peer.exchange.ledger import ByteLedger
from noloco_swarm.peer.inner import InnerSteps
from noloco_swarm.peer.joining import Joining
from noloco_swarm.peer.liveness import DHT_ERRORS
from noloco_swarm.peer.neighbourhood import Found, NeighbourhoodServer, find
from noloco_swarm.peer.net.lifetime import trim_heap
from noloco_swarm.peer.net.transport import Transport
from noloco_swarm.peer.outer_steps import OuterSteps
from noloco_swarm.peer.resume import Resume, SwarmMovedOn
from noloco_swarm.peer.tickets import Gate
from noloco_swarm.peer.views import Held, PeerExcluded, Rounds, raise_if_left_behind
from noloco_swarm.protocol import codec, records, rpc
from noloco_swarm.protocol.codec import MessageError
from noloco_swarm.protocol.membership import directory_bucket
from noloco_swarm.train.config import RunConfig
from noloco_swarm.train.replica import StageReplica

logger = logging.getLogger(__name__)
# Seconds a later stage waits at its end for its callers to close their streams (Transport.settle):
# it may have just answered an evaluation batch, whose reply must reach the caller before our
# daemon stops, and a caller closes its streams once it has its answers (it exits).
FINAL_SETTLE = 1.0


class Peer:
    """One replica of one stage in a running swarm."""

    def __init__(
        self,
        cfg: RunConfig,
        steps: int,
        transport: Transport,
        directory: RunDirectory,
        stage: int,
        sink: events.Events,
        addresses: tuple[str, ...] = (),
        *,
        config_hash: str = "",
        ticket: bytes = b"",
    ) -> None:
        self.steps, self.directory, self.addresses, self.ticket = steps, directory, addresses, ticket
        rounds = Rounds(transport.peer_id, stage, cfg.num_stages, transport, directory, sink)
        rounds.inner_steps = cfg.outer.inner_steps
        if cfg.authority:  # a closed run: members need a ticket, callers too (peer/tickets.py)
            rounds.gate = Gate(cfg.authority, directory.run_id, lambda: asyncio.to_thread(rounds.read_peers))
            transport.gatekeeper = rounds.gate.check
        replica = StageReplica(cfg, stage, device=cfg.peer.device)
        self.ctx = ctx = PeerContext(cfg, stage, transport, rounds, replica, sink)
        self.ledger = ByteLedger(transport)
        self.inner = InnerSteps(ctx)
        self.board = ExchangeBoard(transport, replica.phi.numel())
        self.outer = OuterSteps(ctx, self.board, self.ledger)
        self.joining = Joining(ctx, self.ledger, self._announce, lambda r: self.board.forget((r, -1)))
        self.evaluation = Evaluation(ctx, self.inner)
        self.resume = Resume(ctx, config_hash, self._announce)
        self.announced = False
        self.training = False  # a view of ours is frozen and the loop runs
        self.leaving: int | None = None  # the round in which we told the swarm we leave
        self.tokens = 0
        self.last_loss: float | None = None
        self.resumed_pending: int | None = None  # a boundary resumed from, its exchange still to run
        transport.register("rpc_status", self.rpc_status)
        self.neighbourhood = NeighbourhoodServer(ctx, addresses)

    # ------------------------------------------------------------------ the whole run

    async def run(self, checkpoint: Checkpoint | None = None) -> events.Final:
        """Train to the end: from round 0, as a late joiner, or (given `checkpoint`) from it
        together with the other members of its round when the swarm had stopped."""
        ctx = self.ctx
        late, found = await late_or_founder(ctx, checkpoint is not None)
        if ctx.is_first:  # tokenize the corpus (or open the dataset) before anyone routes work to us
            await asyncio.to_thread(lambda: next(train_batches(ctx.cfg.data, 0, 1, ctx.B, ctx.cfg.seed)))
        heartbeat = asyncio.create_task(self._heartbeat())  # owned here: cancelled and awaited below
        try:
            seconds, val_loss = await self._train_and_evaluate(late, checkpoint, found)
        finally:
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
            await ctx.rounds.close()
        view = ctx.view_at(ctx.step - 1)
        final = events.Final(
            stage=ctx.stage,
            rank=view.rank_of(ctx.me)[1],
            peer_id=ctx.me,
            joined_round=self.joining.joined_round,
            steps=ctx.step,
            outer_steps=self.outer.taken,
            dropped_partners=self.outer.dropped_partners,
            dropped_samples=self.inner.dropped_samples,
            gone=sorted(ctx.rounds.dead),
            final_view=[list(s) for s in view.stages],
            train_seconds=seconds,
            tokens=self.tokens,
            val_loss=val_loss,
            state_hash=ctx.replica.state_hash(),
            bytes=ctx.transport.byte_counts(),
            dht=self.directory.calls.as_dict(),
        )
        ctx.events.emit(final)
        if not await self.board.drain(ctx.deadlines.exchange):
            logger.warning("stopping with an outer exchange answer still on its way to a partner")
        if not ctx.is_first and not await ctx.transport.settle(FINAL_SETTLE):  # see FINAL_SETTLE
            logger.info("stopping with a caller's stream still open after %.0f s", FINAL_SETTLE)
        return final

    async def _train_and_evaluate(
        self, late: bool, checkpoint: Checkpoint | None, found: Found | None
    ) -> tuple[float, float | None]:
        ctx = self.ctx
        if checkpoint is not None:
            try:
                await self._resume(checkpoint)
            except SwarmMovedOn as e:
                logger.warning("%s: its state is stale, so this peer joins as a late joiner", e)
                late, self.resumed_pending = True, None
        if late:
            await self.joining.join_late(self.steps, found=found)
        elif checkpoint is None:
            await self._announce()
            await ctx.rounds.freeze_round_zero(ctx.cfg.replica_counts, ctx.cfg.peer.start_timeout)
        start = time.perf_counter()
        self.training = True
        while True:
            try:
                await self.train()
                break
            except PeerExcluded as e:
                logger.warning("%s; joining again", e)
                ctx.events.emit(events.Excluded(step=ctx.step, reason=str(e)))
                self.inner.abandon("this peer left the swarm's view and joins again")
                await self.joining.join_late(self.steps, stale=True)
        seconds = time.perf_counter() - start
        self.inner.abandon("this peer finished training", keep_answers=True)
        self.evaluation.trained.set()
        if self.leaving is not None:  # the others train on: no evaluation path waits for us
            return seconds, None
        return seconds, await self.evaluation.evaluate()

    async def train(self) -> None:
        try:
            await self._train()
        finally:  # excluded, failed or stopped with an overlapped exchange in flight: drop it
            await self.outer.abandon()

    async def _train(self) -> None:
        ctx = self.ctx
        if self.resumed_pending is not None and self.resumed_pending == ctx.step:
            # Resumed from a checkpoint written at a boundary before its overlapped exchange
            # started: every member resumed from this step runs that exchange again.
            await self.outer.at_boundary(self.steps)
        self.resumed_pending = None
        previous = time.monotonic()
        failpoints.phase_begins()
        while ctx.step < self.steps:
            t = ctx.step
            if ctx.clock.outer_step_due(t):  # a round begins
                failpoints.phase_begins()
            await look_if_stalled(ctx, t, previous)  # frozen, or cut off?
            previous = time.monotonic()
            start = time.perf_counter()
            lr = ctx.replica.lr_at(t)
            loss = await self.inner.run(t)
            await asyncio.to_thread(ctx.replica.optimizer_step, lr)
            if ctx.cfg.peer.release_memory == "trim":  # the step's freed activations and gradients
                await asyncio.to_thread(trim_heap)
            ctx.step = t + 1
            self.last_loss = loss
            if ctx.is_first:
                self.tokens += self.inner.rows_fed * ctx.cfg.model.seq_len
            seconds = time.perf_counter() - start
            ctx.deadlines.observe_step(seconds)
            ctx.events.emit(
                events.Step(
                    step=ctx.step,
                    loss=loss,
                    lr=lr,
                    seconds=seconds,
                    tokens=self.tokens,
                    tokens_per_second=ctx.B * ctx.cfg.model.seq_len / seconds,
                )
            )
            await self.outer.finish(due_only=True)  # k steps after its boundary: wait if in flight
            if ctx.clock.outer_step_due(ctx.step):
                previous = await look_if_stalled(ctx, t, previous)  # stalled before its exchange?
                await failpoints.straggle(ctx.cfg.seed, ctx.stage, ctx.rank_at(t), ctx.view_at(t).round)
                if await self._boundary():
                    return
        await self.outer.finish()  # the run ends before k steps are up: complete the exchange

    async def _boundary(self) -> bool:
        """After the last inner step of a round: the outer step (started, with overlap), the
        checkpoint if due, the next round's view. True if this peer leaves the swarm here.

        Checkpoints are written where no exchange is in flight: after a blocking outer step, or
        with overlap at the boundary before the exchange starts, holding theta as well (see
        checkpoint.py): a swarm resumed from them runs that exchange again, from the same
        tensors, so it still equals the run that never stopped."""
        ctx, overlap = self.ctx, self.ctx.cfg.outer.overlap_steps > 0
        last = ctx.step >= self.steps
        async with asyncio.TaskGroup() as group:  # the neighbour's pull runs behind the exchange
            held = None if last else group.create_task(ctx.rounds.gather_records())
            if overlap:
                await self._save(with_theta=True)
            if ctx.run_plan.update is not None:  # the method has an outer step
                await self.outer.at_boundary(self.steps)
            if not overlap:
                await self._save()
        if held is None:
            return False
        try:
            await self._advance_view(held.result())
        except PeerExcluded:
            if self.leaving is None:
                raise
            await self.outer.finish()  # serve this boundary's exchange to our partners first
            ctx.events.emit(events.Left(step=ctx.step, announced_round=self.leaving))
            return True  # the view we announced we would leave: done, nobody waits for us
        return False

    async def _save(self, *, with_theta: bool = False) -> None:
        await self.resume.save(
            joined_round=self.joining.joined_round,
            outer_steps=self.outer.taken,
            tokens=self.tokens,
            final=self.ctx.step >= self.steps or self.leaving is not None,
            with_theta=with_theta,
        )

    async def leave(self) -> bool:
        """Leave the swarm without failing anyone: report ourselves gone in the current round, so
        that every member drops us at the same boundary (the one after next, as for any report),
        train until then, serve that boundary's outer step, checkpoint, and stop. False if we do
        not train yet (there is nothing to hand over: the caller just stops)."""
        latest = self.ctx.rounds.latest()
        if not self.training or latest is None:
            return False
        if self.leaving is None:
            self.leaving = latest.round
            logger.warning("leaving the swarm after round %d", latest.round + 1)
            await self.ctx.rounds.report_leaving(latest.round)
        return True

    async def _resume(self, checkpoint: Checkpoint) -> None:
        """Come back from `checkpoint` with the rest of its round (see resume.py)."""
        self.joining.joined_round = checkpoint.joined_round  # announced while it waits for the others
        ckpt = await self.resume.restore(checkpoint)
        self.joining.joined_round = ckpt.joined_round
        self.outer.taken, self.tokens = ckpt.outer_steps, ckpt.tokens
        self.resumed_pending = ckpt.step if "theta" in ckpt.parts else None

    async def _advance_view(self, held: Held) -> None:
        """At a round boundary: freeze the next round's view, built from the records `held` at
        the boundary; keep our state for its joiners."""
        ctx = self.ctx
        current = ctx.view_at(ctx.step - 1)
        view = await ctx.rounds.next(current, self.joining.joined_round, held)
        await self.joining.server.keep_for_joiners(current, view, held)
        ctx.rounds.set(view)

    # ------------------------------------------------------------------ presence

    def announcement(self) -> records.PeerAnnouncement:
        """Our heartbeat record, with the round we (re)joined at and our progress; passed to our
        neighbours too when it changes a view (peer/passing.py)."""
        ctx = self.ctx
        mine = records.PeerAnnouncement(
            ctx.run_id,
            ctx.me,
            ctx.stage,
            self.joining.joined_round,
            self.addresses,
            ctx.device.type,
            ctx.step,
            self.ticket,
        )
        ctx.rounds.passing.own(mine)
        return mine

    async def _announce(self) -> bool:
        """Store our announcement now; False if the DHT did not store it (the heartbeat retries)."""
        self.announced = True
        try:
            bucket = directory_bucket(self.ctx.rounds.latest(), self.ctx.me)
            return await asyncio.to_thread(self.directory.announce, self.announcement(), bucket)
        except DHT_ERRORS as e:  # the DHT is best effort
            logger.warning("could not store our announcement: %s", e)
            return False

    async def _heartbeat(self) -> None:
        """Re-store our announcement (with our current step) every ttl/3 seconds, once we made one
        (a joiner announces itself once it has picked its round)."""
        while True:
            await asyncio.sleep(self.ctx.cfg.peer.heartbeat_ttl / 3)
            if self.announced and not await self._announce():
                logger.warning("heartbeat: the DHT did not store our announcement; retrying")

    async def rpc_status(
        self, peer_id: str, header: codec.Message, tensors: list[Any]
    ) -> tuple[codec.Message, list[Any]]:
        """Where this peer is: for joiners choosing their round, for probes, and for `noloco status`."""
        ctx = self.ctx
        if not isinstance(header, rpc.StatusRequest) or header.run_id != ctx.run_id:
            raise MessageError(f"expected a status request for run {ctx.run_id!r}")
        view = ctx.rounds.latest()
        rank = view.rank_of(ctx.me)[1] if view is not None and ctx.me in view.members() else 0
        loss = self.last_loss if self.last_loss is not None and math.isfinite(self.last_loss) else None
        status = rpc.PeerStatus(
            ctx.run_id,
            ctx.me,
            ctx.stage,
            ctx.step,
            ctx.clock.round_of(ctx.step),
            rank,
            self.outer.taken,
            self.tokens,
            loss,
            resuming=self.resume.resuming,
            resumed_from=self.resume.resumed_from,
            collected=self.inner.consumed if self.inner.consumed[0] >= 0 else (),
            joining_at=ctx.rounds.joining_at if view is None else None,
            **said_routing(ctx.rounds.detours, ctx.stage, view, self.inner.sender.sent),
        )
        return status, []


async def late_or_founder(ctx: PeerContext, resuming: bool) -> tuple[bool, Found | None]:
    """Whether we join a run in progress (round 0 is complete without us), and the answer of the
    member that said so (peer/neighbourhood.py): a member that answers with its view; or, when
    none does, the whole directory's announcements. False when `resuming` from a checkpoint."""
    found = None if resuming else await find(ctx.transport, ctx.rounds.directory, ctx.cfg, ctx.stage)
    if found is not None:
        return True, found
    announcements = await asyncio.to_thread(ctx.rounds.read_peers)
    return not resuming and ctx.rounds.run_in_progress(announcements, ctx.cfg.replica_counts), None


async def look_if_stalled(ctx: PeerContext, t: int, since: float) -> float:
    """`check_not_left_behind` if more than the step deadline passed since `since` (monotonic)
    at step t; when this look was made, or `since` if none was needed."""
    if time.monotonic() - since <= ctx.deadlines.step:
        return since
    await check_not_left_behind(ctx, t)
    return time.monotonic()


async def check_not_left_behind(ctx: PeerContext, t: int) -> None:
    """After a step that outlasted the step deadline (this process was stopped, its link cut,
    or it waited on someone who was): if the others are already two rounds past ours, they
    have trained on without us and we are out of their views, or soon will be. Rejoin now,
    instead of sending them rows for steps they left long ago. Otherwise the steps they said
    they are at (`Liveness.passed`) spare them our rows and weights of steps they passed."""
    view = ctx.view_at(t)
    others = sorted(view.members() - {ctx.me} - set(ctx.rounds.dead))
    async with asyncio.TaskGroup() as group:
        probes = [group.create_task(ctx.rounds.probe(p)) for p in others]
    steps = [s.step for probe in probes if isinstance(s := probe.result(), rpc.PeerStatus)]
    raise_if_left_behind(t, view.round, ctx.clock, steps)
