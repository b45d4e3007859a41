"""Inner steps on a swarm: stage-0 data, collecting rows, and rpc_forward (sending rows on and
getting their gradients back is peer/sending.py).

Which rows go where comes from the step plan (protocol.plan) of the step's round:

  stage 0      reads its data shard (and the shards of gone stage-0 replicas it stands in for),
               runs its stage, sends each row's activations (with its token ids) to the replica
               the plan names, and gets the gradients back in the reply.
               Both cross in the run's wire format (protocol.wire: encoded at the send, decoded
               and checked at the receipt).
  stage s > 0  collects the rows the plan routes to it (`StepCollector`, any arrival order), runs
               them as one batch in the plan's order, forwards them on (or computes the loss on
               the last stage), and answers each sender with the gradients of its rows.

With M microbatches (`inner.microbatches`) all of this happens per microbatch: a stage sends
microbatch m on as soon as it is computed and computes m+1 meanwhile; the last stage answers m
as soon as it ran it; every replica backpropagates its microbatches in ascending m, whatever
order their gradients come back in, so the accumulated gradient is the simulator's bit for bit.
The optimizer steps once per inner step, after the last microbatch.

A row whose gradient never comes back is dropped from the step (its gradient stays zero), and stage
0 feeds it again at the next step (peer/carry.py); a sender that stays silent is probed, and
dropped from the step (and reported) if it does not answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import torch

from noloco_swarm.data.stream import train_batches
from noloco_swarm.peer import events
from noloco_swarm.peer.carry import Carry
from noloco_swarm.peer.collector import Arrival, Placement, StepCollector, answer
from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.liveness import PROBE_PERIOD
from noloco_swarm.peer.net.limits import ROW_MARGIN, Accepts
from noloco_swarm.peer.rows import (
    backward_reply,
    check_sender,
    checked_rows,
    decode_rows,
    gone_senders,
    rows_of,
    sender_routing,
    senders_plan,
)
from noloco_swarm.peer.sending import RowSender
from noloco_swarm.peer.views import PeerExcluded, raise_if_left_behind
from noloco_swarm.protocol import codec, plausible, routing
from noloco_swarm.protocol.codec import MessageError
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.protocol.plan import Incoming, Row
from noloco_swarm.protocol.plausible import Implausible
from noloco_swarm.protocol.rpc import ForwardHeader, PeerStatus

Slot = tuple[int, int]  # (inner step, microbatch)
# A receiver holds rows for at most this many steps, its current one included: a sender may run
# ahead of one receiver by several steps when its other rows went elsewhere (or were dropped),
# and a receiver that fell behind catches up from the rows it holds. This bounds their memory.
STEPS_AHEAD = 8
# A receiver keeps the rows (and answers) of this many steps before its last collected one, for
# senders whose stream broke before our answer reached them and that send the same rows again.
RESENDS_KEPT = 2


class InnerSteps:
    """One replica's part of every inner step's pipeline."""

    def __init__(self, ctx: PeerContext) -> None:
        self.ctx = ctx
        # Collectors by (step, microbatch): those still collecting, and those collected lately,
        # kept with their arrivals (and so their answers) for a sender whose stream broke and
        # that sends the same rows again, however late.
        self.collectors: dict[Slot, StepCollector] = {}
        self.collected: dict[Slot, StepCollector] = {}
        self.consumed: Slot = (-1, -1)  # the last (step, microbatch) taken out of its collector
        self.sender = RowSender(ctx)
        self.carry = Carry()  # stage 0: rows of the last step to feed again (peer/carry.py)
        # Stage 0's batches: shard -> its stream, and (stage-0 replica count, next step) of it.
        self._data: dict[int, tuple[Iterator[torch.Tensor], tuple[int, int]]] = {}
        self.rows_fed = 0  # rows stage 0 fed into the pipeline at the last step (B, or more as a stand-in)
        # A request's rows: at most ROW_MARGIN batches of the run's shape (uneven stages).
        model = ctx.cfg.model
        width = ctx.boundary.width(model.hidden_size)
        rows = Accepts.rows(ctx.B * ROW_MARGIN, model.seq_len, width, ctx.cfg.wire.activations)
        ctx.transport.register("rpc_forward", self.rpc_forward, rows)

    @property
    def dropped_samples(self) -> int:
        """Rows this replica sent on whose gradient never came back, over the run."""
        return self.sender.dropped_samples

    async def run(self, t: int) -> float | None:
        """Forward and backward of inner step t; the mean loss of the rows whose loss came back."""
        self.sender.began = time.monotonic()
        if self.ctx.is_first:
            losses = await self._first_stage(t)
        else:
            losses = await self._receiving(t)
        return sum(losses) / len(losses) if losses else None

    def abandon(self, reason: str, *, keep_answers: bool = False) -> None:
        """Fail the senders of every step still collecting (a join or the end of training), and
        forget the steps collected lately unless `keep_answers`: at the end of training they
        still answer a sender of the last steps whose reply stream broke, until this peer stops
        (cleared, such a resend was refused as late and its rows dropped)."""
        for collector in self.collectors.values():
            collector.abandon(reason)
        self.collectors.clear()
        if not keep_answers:
            self.collected.clear()

    # ------------------------------------------------------------------ stage 0

    def _batches(self, t: int, shards: list[int]) -> dict[int, torch.Tensor]:
        """Stage 0's data: batch t of each of `shards` (ours, and those of the gone replicas we
        stand in for) of this round's stage-0 replica count.

        A shard's stream is reopened at step t whenever the shard layout changes or steps were
        skipped (joining, or a shard we start standing in for); a streaming dataset then reads
        its new shard forward to t (see data.hub).
        """
        cfg, count = self.ctx.cfg, self.ctx.view_at(t).replica_counts()[0]
        batches = {}
        for shard in shards:
            stream, at = self._data.get(shard, (None, None))
            if stream is None or at != (count, t):
                stream = train_batches(cfg.data, shard, count, self.ctx.B, cfg.seed, start_step=t)
            batches[shard] = next(stream)
            self._data[shard] = (stream, (count, t + 1))
        for shard in set(self._data) - set(shards):  # a shard we no longer read
            del self._data[shard]
        return batches

    async def _first_stage(self, t: int) -> list[float]:
        ctx, view = self.ctx, self.ctx.view_at(t)
        rank = view.rank_of(ctx.me)[1]
        plan = ctx.plan_at(t).routing_around(ctx.rounds.detours.around(view))
        rows = [x.row for x in plan.rows(t, 0, rank)]  # (position, origin) order
        shards = sorted({row.origin for row in rows})
        batches = await asyncio.to_thread(self._batches, t, shards)  # a new layout loads the corpus
        window = torch.stack([batches[row.origin][row.position] for row in rows])
        self.rows_fed = len(rows)
        if len(shards) > 1:
            others = [s for s in shards if s != rank]
            extra = sum(row.origin != rank for row in rows)
            ctx.events.emit(events.StoodIn(step=t, samples=extra, replicas=others))
        x, y = window[:, :-1].to(ctx.device), window[:, 1:]
        # Microbatch m: rows of batch positions in m (contiguous in (position, origin) order).
        where = [plan.microbatch_of(row.position) for row in rows]
        spans = [[j for j, m in enumerate(where) if m == k] for k in range(plan.microbatches)]
        parts = [
            (
                x[js[0] : js[-1] + 1],
                y[js[0] : js[-1] + 1],
                rows[js[0] : js[-1] + 1],
                window[js[0] : js[-1] + 1],
            )
            for js in spans
        ]
        losses: list[float] = []
        if ctx.is_last:  # one stage: the whole model here

            def whole(xm: torch.Tensor, ym: torch.Tensor) -> list[float]:
                sample_losses = ctx.replica.module(xm, ym.to(ctx.device))
                ctx.replica.backward_losses(sample_losses)
                return [float(v) for v in sample_losses.detach()]

            for xm, ym, _, _ in parts:
                losses += await asyncio.to_thread(whole, xm, ym)
            return losses
        return await _through_the_pipeline(ctx, self.sender, self.carry, t, parts)

    # ------------------------------------------------------------------ stages after the first

    def _collector(self, t: int, m: int) -> StepCollector:
        if (t, m) not in self.collectors:
            ctx, view = self.ctx, self.ctx.view_at(t)
            expected = self._expected(t, m)
            gone = {x.sender for x in expected if view.peer_at(ctx.stage - 1, x.sender) in ctx.rounds.dead}
            self.collectors[(t, m)] = StepCollector(t, expected, m, gone)
        return self.collectors[(t, m)]

    def _expected(self, t: int, m: int) -> tuple[Incoming, ...]:
        """The rows we expect at step t (microbatch m): the plan's, with the replicas we believe
        the swarm routes around (`Detours.expected`) replaced by their stand-ins."""
        ctx = self.ctx
        view = ctx.view_at(t)
        plan = ctx.plan_at(t).routing_around(ctx.rounds.detours.expected(view))
        return plan.expects(t, ctx.stage, view.rank_of(ctx.me)[1], m)

    def _expect_again(self) -> None:
        """We learned of a replica routed around: every step still collecting expects anew."""
        for (t, m), collector in self.collectors.items():
            if self.ctx.clock.round_of(t) in self.ctx.rounds.views:
                collector.expect(self._expected(t, m))

    async def _receiving(self, t: int) -> list[float]:
        """Inner step t on a stage after the first: microbatch by microbatch, each run as soon as
        its rows are in (and, on the last stage, answered at once); backward in ascending m."""
        ctx = self.ctx
        losses: list[float] = []
        running: list[tuple[Placement, torch.Tensor, torch.Tensor, asyncio.Task]] = []
        touched: list[StepCollector] = []
        try:
            try:
                async with asyncio.TaskGroup() as group:
                    for m in range(ctx.cfg.inner.microbatches):
                        collector = await self._collect_microbatch(t, m)
                        touched.append(collector)
                        if not collector.arrivals:  # no rows of m came to us: nothing to compute
                            continue
                        acts, toks, placement, rows, carried = collector.batch()
                        x = acts.to(ctx.device).requires_grad_(True)
                        if ctx.is_last:

                            def last(x: torch.Tensor = x, toks: torch.Tensor = toks) -> torch.Tensor:
                                targets = ctx.boundary.targets(toks).to(ctx.device)
                                sample_losses = ctx.replica.module(x, targets)
                                ctx.replica.backward_losses(sample_losses)
                                return sample_losses.detach()

                            got = [float(v) for v in await asyncio.to_thread(last)]
                            answer(x, placement, got, frozenset())
                            losses += got
                        else:
                            out = await asyncio.to_thread(ctx.replica.module, x)
                            send = self.sender.send_on(t, m, out.detach(), toks, rows, carried)
                            sending = group.create_task(send)
                            running.append((placement, x, out, sending))
                    for placement, x, out, sending in running:
                        returned = await sending
                        await asyncio.to_thread(out.backward, returned.grad)
                        answer(x, placement, returned.losses, returned.lost)
                        losses += returned.kept_losses()
            except* PeerExcluded as excluded:  # we fell behind (seen while collecting): rejoin
                raise excluded.exceptions[0] from None
        except BaseException:
            for collector in [*touched, *(c for (step, _), c in self.collectors.items() if step == t)]:
                collector.abandon(f"step {t} failed on the receiving replica")
            raise
        return losses

    async def _collect_microbatch(self, t: int, m: int) -> StepCollector:
        """Microbatch m of step t's rows, collected (or given up on); closed to new rows."""
        collector = self._collector(t, m)
        try:
            await self._collect(t, collector)
            _say_unsent(self.ctx, collector)
        except BaseException:
            collector.abandon(f"step {t} was abandoned by the receiving replica")
            raise
        finally:
            _say_never_came(self.ctx, collector)
            del self.collectors[(t, m)]
            collector.closed = True  # new rows for it that arrive from now on are too late
            self.consumed = (t, m)
            kept = {k: c for k, c in self.collected.items() if k[0] >= t - RESENDS_KEPT}
            self.collected = kept | {(t, m): collector}
        return collector

    async def _collect(self, t: int, collector: StepCollector) -> None:
        """Wait for step t's rows; probe silent senders while waiting and stop expecting dead ones."""
        ctx = self.ctx
        view, timeout = ctx.view_at(t), ctx.deadlines.step
        deadline = time.monotonic() + timeout
        for sender in collector.missing_senders():  # those that said they route around us
            if avoids_us(ctx, view, ctx.rounds.seen.get(view.peer_at(ctx.stage - 1, sender))):
                collector.routed_away(sender)
        while not collector.complete.is_set():
            left = deadline - time.monotonic()
            try:
                await asyncio.wait_for(collector.complete.wait(), min(PROBE_PERIOD, max(left, 0.0)))
                return
            except TimeoutError:
                pass
            missing = collector.missing_senders()
            peers = [view.peer_at(ctx.stage - 1, s) for s in missing]
            if left <= PROBE_PERIOD:  # the deadline: whoever is still silent failed us
                why = f"sent nothing for step {t} within {timeout:.0f} s"
                async with asyncio.TaskGroup() as group:
                    for p in peers:
                        group.create_task(ctx.rounds.suspect(p, why))
                self._give_up_on(collector, missing)
                return
            async with asyncio.TaskGroup() as group:
                probes = [group.create_task(ctx.rounds.probe(p)) for p in peers]
            statuses = [probe.result() for probe in probes]
            # A sender two rounds ahead of this step means the swarm left us behind: rejoin now.
            raise_if_left_behind(
                t, view.round, ctx.clock, [s.step for s in statuses if isinstance(s, PeerStatus)]
            )
            lost = []  # senders whose rows will not come: dead, or past step t (they gave up on us)
            for sender, peer, status in zip(missing, peers, statuses, strict=True):
                if status is None:
                    ctx.rounds.mark_dead(peer, f"stopped answering while we waited for step {t}")
                    lost.append(sender)
                elif sends_us_nothing(ctx, view, status, t, collector.microbatch, sender):
                    collector.routed_away(sender)  # by its routing, rows we expected go elsewhere
                elif isinstance(status, PeerStatus) and status.step > t:
                    lost.append(sender)
            if lost:
                self._give_up_on(collector, lost)

    def _give_up_on(self, collector: StepCollector, senders: list[int]) -> None:
        """Run the step without `senders`' rows; those no stand-in brings are recorded as dropped
        once the step is collected (`_say_never_came`)."""
        for sender in senders:
            collector.drop_sender(sender)

    async def rpc_forward(
        self, peer_id: str, header: codec.Message, tensors: list[torch.Tensor]
    ) -> tuple[codec.Message, list[torch.Tensor]]:
        """Rows routed to us by a replica of the previous stage; answered with their gradients."""
        ctx = self.ctx
        if not isinstance(header, ForwardHeader):
            raise MessageError("expected a forward header")
        if header.round != ctx.clock.round_of(header.step):
            raise MessageError(f"step {header.step} is not in round {header.round}")
        # A sender may start a round a moment before we do: wait for our view of it, then compare
        # views before steps, so a sender with another view always learns that, whatever its step.
        view = await ctx.rounds.wait(header.round, timeout=ctx.deadlines.step)
        if header.view != view.digest():
            ctx.events.emit(events.ViewMismatch(step=header.step, peer=peer_id))
            raise MessageError(
                f"views of round {header.round} differ (theirs {header.view}, ours {view.digest()})"
            )
        check_sender(ctx, peer_id, view, header.run_id, header.hop, header.sender_rank)
        plan = senders_plan(ctx, view, header)
        if ctx.rounds.detours.hear(view, plan.around):
            self._expect_again()
        # Decoded before the step checks, so that no await falls between them and the collector.
        decoded = await asyncio.to_thread(decode_rows, ctx, tensors, header.activations)
        carried, positions = rows_of(ctx, view, header)
        acts, toks = checked_rows(ctx, decoded)
        rows = Arrival(header.sender_rank, positions, acts, toks, carried=carried)
        # A microbatch already collected takes only a resend of rows it holds (a broken stream).
        slot = (header.step, plan.microbatch_of(positions[0]))
        allowed = plan.expects_from(
            header.step, ctx.stage, view.rank_of(ctx.me)[1], header.sender_rank, slot[1]
        )
        if (collector := self.collected.get(slot)) is None:
            if header.step < ctx.step or slot <= self.consumed:
                raise MessageError(
                    f"rows for step {header.step} came late: this replica is at step {ctx.step}"
                )
            if header.step >= ctx.step + STEPS_AHEAD:
                raise MessageError(
                    f"rows for step {header.step} came too early: this replica is at step {ctx.step} "
                    f"and holds rows at most {STEPS_AHEAD - 1} steps ahead"
                )
            collector = self._collector(*slot)
        try:  # absurd rows (plausible.MAX_ROW_RMS) are refused and dropped from the step at once
            plausible.check_rows(acts, f"activations from {peer_id} for step {header.step}")
        except Implausible:
            if not collector.closed and header.sender_rank not in collector.arrivals:
                self._give_up_on(collector, [header.sender_rank])
            raise
        arrival = collector.add(rows, allowed)
        # Shielded: a sender's resend waits on the same arrival, and one waiter's deadline must
        # not cancel the other's answer. A resend after the answer gets it at once.
        grad, losses, lost = await asyncio.wait_for(asyncio.shield(arrival.result), ctx.deadlines.step * 2)
        rank = view.rank_of(ctx.me)[1]
        return backward_reply(ctx, header, rank, grad, losses, gone_senders(ctx, view), lost)


Part = tuple[torch.Tensor, torch.Tensor, list[Row], torch.Tensor]  # inputs, targets, rows, windows


async def _through_the_pipeline(
    ctx: PeerContext, sender: RowSender, carry: Carry, t: int, parts: list[Part]
) -> list[float]:
    """Stage 0's microbatches of step t sent on (the rows of step t - 1 to feed again first), and
    backpropagated in ascending m as their gradients return; the losses of the rows that came
    back. Rows of step t whose gradient did not are kept to be fed again at t + 1."""
    losses: list[float] = []
    # The rows of step t - 1 whose gradient did not come back go first in microbatch 0.
    carried, again = carry.take(t)
    if again is not None:
        xm, ym, rm, wm = parts[0]
        parts[0] = (torch.cat([again[:, :-1].to(ctx.device), xm]), torch.cat([again[:, 1:], ym]), rm, wm)
        ctx.events.emit(events.Carried(step=t, samples=len(carried), sample_ids=list(carried)))
    # Microbatch m is sent on while m+1 is computed; backward in ascending m.
    lost_samples: list[int] = []
    lost_windows: list[torch.Tensor] = []
    async with asyncio.TaskGroup() as group:
        sending = []
        for m, (xm, ym, rm, wm) in enumerate(parts):
            older = carried if m == 0 else []
            out = await asyncio.to_thread(ctx.replica.module, xm)
            send = sender.send_on(t, m, out.detach(), ctx.boundary.ids(xm, ym), rm, older)
            sending.append((out, len(older), rm, wm, group.create_task(send)))
        for out, n, rm, wm, task in sending:
            returned = await task
            await asyncio.to_thread(out.backward, returned.grad)
            losses += returned.kept_losses()
            for j in sorted(returned.again):
                if j >= n:  # a row of this step (a carried row lost again is dropped)
                    lost_samples.append(routing.sample_index(t, rm[j - n].position, ctx.B))
                    lost_windows.append(wm[j - n])
    carry.keep(t, lost_samples, lost_windows)
    return losses


def avoids_us(ctx: PeerContext, view: MembershipView, status: PeerStatus | object) -> bool:
    """Does a sender's answer to our probe say that it routes rows around us in `view`'s round?
    It failed to reach us (we were frozen, or cut off), and sends our rows to our stand-in until
    the boundary that weighs its report of us: within the round it sends us nothing, and waiting
    for it would hold the pipeline to the step deadline, step after step. (Its record of who
    failed it only grows within a round, so an earlier answer of the same round still holds.)"""
    return (
        isinstance(status, PeerStatus)
        and status.around_round == view.round
        and view.rank_of(ctx.me)[1] in status.routes_around
    )


def sends_us_nothing(
    ctx: PeerContext, view: MembershipView, status: PeerStatus | object, t: int, m: int, sender: int
) -> bool:
    """By its answer to our probe, does the stage-before `sender` send us no rows of microbatch m
    of step t? It sent them on, to other replicas only; it routes around us; or, when it is on
    stage 0 (its rows are its own and those of the stage-0 replicas it stands in for), the plan
    under its routing gives us none. We may expect some from hearsay: a header said a replica is
    routed around, and we stand in for it, but this sender does not route around it and sends it
    its rows itself. (Before a later stage's sender sends, it cannot say: it holds the rows its
    own senders routed to it.)"""
    if not isinstance(status, PeerStatus):
        return False
    if status.sent == (t, m) and view.rank_of(ctx.me)[1] not in status.sent_to:
        return True  # it sent this microbatch on, to others only
    if status.around_round != view.round:
        return False
    if avoids_us(ctx, view, status):
        return True
    if ctx.stage != 1:
        return False
    try:
        plan = sender_routing(ctx, t, 0, status.stands_in, status.routes_around)
        return not plan.expects_from(t, 1, view.rank_of(ctx.me)[1], sender, m)
    except ValueError:  # ranks this round does not have: not an answer we can use
        return False


def _say_never_came(ctx: PeerContext, collector: StepCollector) -> None:
    """Once a step was collected (or abandoned): record the rows of the senders we gave up on
    that did not come after all. (Said at the give-up, rows a stand-in of a dead sender brought a
    moment later counted as dropped: seen under load, against no sender's loss.)"""
    if never := collector.never_came():
        ctx.events.emit(
            events.Dropped(
                step=collector.step,
                hop=ctx.stage - 1,
                samples=sum(never.values()),
                side="receiver",
                senders=sorted(never),
            )
        )


def _say_unsent(ctx: PeerContext, collector: StepCollector) -> None:
    """Once a step ran: record the rows of senders gone before it began that no stand-in brought."""
    if collector.unsent:
        senders = sorted({x.sender for x in collector.unsent})
        ctx.events.emit(
            events.Dropped(
                step=collector.step,
                hop=ctx.stage - 1,
                samples=len(collector.unsent),
                side="receiver",
                senders=senders,
            )
        )
