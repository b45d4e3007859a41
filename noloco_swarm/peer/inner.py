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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from noloco_swarm.data.stream import train_batches
from noloco_swarm.peer import events
from noloco_swarm.peer.carry import Carry
from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.limits import ROW_MARGIN, Accepts
from noloco_swarm.peer.rounds import PROBE_PERIOD, PeerExcluded, raise_if_left_behind
from noloco_swarm.peer.sending import RowSender
from noloco_swarm.peer.streams import Refused
from noloco_swarm.protocol import messages, plausible, routing, wire
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.protocol.messages import BackwardHeader, ForwardHeader, MessageError, PeerStatus, TensorMeta
from noloco_swarm.protocol.plan import Incoming, Row, StepPlan
from noloco_swarm.protocol.plausible import Implausible

Slot = tuple[int, int]  # (inner step, microbatch)
# A receiver holds rows for at most this many steps, its current one included: a sender may run
# ahead of one receiver by several steps when its other rows went elsewhere (or were dropped),
# and a receiver that fell behind catches up from the rows it holds. This bounds their memory.
STEPS_AHEAD = 8
# A receiver keeps the rows (and answers) of this many steps before its last collected one, for
# senders whose stream broke before our answer reached them and that send the same rows again.
RESENDS_KEPT = 2


@dataclass
class Arrival:
    """One forward request's rows, waiting for the batch to run and its gradients to return."""

    sender: int
    positions: list[int]
    activations: torch.Tensor
    tokens: torch.Tensor
    # its rows' input gradients and losses, and which of its rows were lost further on
    result: asyncio.Future[tuple[torch.Tensor, list[float], tuple[int, ...]]] = field(
        default_factory=asyncio.Future
    )
    rows: list[Row] = field(default_factory=list)  # which rows of the plan these are (set by add)
    # sample indices of the rows of the step before that come first (peer/carry.py)
    carried: list[int] = field(default_factory=list)


Placement = list[tuple[Arrival, list[int]]]  # each arrival, and the rows of the batch its rows took


class StepCollector:
    """Rows for one inner step of one receiving replica; complete when every expected sender's
    rows are in.

    Each sender sends its rows for the step in one request: the ones the plan routes to us, and
    those of the replicas it routes around that we stand in for (its header says which). The
    batch runs every row that came in (position, origin) order, so arrival order never changes
    the result; on a healthy swarm these are exactly the plan's rows."""

    def __init__(
        self, step: int, expected: tuple[Incoming, ...], microbatch: int = 0, gone: Iterable[int] = ()
    ) -> None:
        self.step, self.microbatch = step, microbatch
        self.arrivals: dict[int, Arrival] = {}
        self.complete = asyncio.Event()
        self.closed = False  # collected: only resends of rows already in are accepted
        self.gone = set(gone)  # senders we stopped expecting
        self._gone_before = frozenset(gone)  # those gone before the step began
        self.given_up: dict[int, list[Row]] = {}  # senders we stopped waiting for: the rows we expected
        self.expect(expected)

    def rows_from(self, sender: int) -> list[Row]:
        return [x.row for x in self.expected if x.sender == sender]

    def expect(self, expected: tuple[Incoming, ...]) -> None:
        """Expect these rows (in the order the batch runs them) from every sender not gone; called
        again when we learn that a replica is routed around: what came stays."""
        self.expected = [x for x in expected if x.sender not in self.gone]
        # rows from senders gone before the step began, that no stand-in of theirs brings: lost
        self.unsent = [x for x in expected if x.sender in self._gone_before]
        self._check_complete()

    def add(self, arrival: Arrival, allowed: list[Row]) -> Arrival:
        """Accept one sender's rows and return the arrival whose result answers them. `allowed`:
        the rows the plan, as the sender's header describes it, routes from it to us.

        A sender whose stream broke before our answer sends the same rows again, before or after
        the step was collected: it then waits for the first arrival's result. Rows the plan does
        not route to us from this sender, different rows for the same step, or new rows once
        collected are refused, and so are rows another sender brought already. (A sender may
        send fewer rows than `allowed`: rows lost on an earlier hop.)"""
        rows = _matched(arrival.positions, allowed)
        if rows is None:
            raise MessageError(
                f"sender {arrival.sender} sent positions {arrival.positions}, the plan gives "
                f"{[row.position for row in allowed]}"
            )
        first = self.arrivals.get(arrival.sender)
        if first is not None:
            if not (
                first.positions == arrival.positions
                and first.carried == arrival.carried
                and torch.equal(first.activations, arrival.activations)
                and torch.equal(first.tokens, arrival.tokens)
            ):
                raise MessageError(f"sender {arrival.sender} sent other rows for step {self.step}")
            return first
        if self.closed:  # without this sender: gave up on it, thought it gone, or had a stand-in
            how = (
                "having marked their sender gone"
                if arrival.sender in self._gone_before
                else "without them"
                if arrival.sender in self.gone
                else "from a stand-in of their sender"
            )
            raise MessageError(
                f"rows for step {self.step} (microbatch {self.microbatch}) came after this replica "
                f"had collected them ({how})"
            )
        # Two senders with one row: a stage-0 replica believed gone (and stood in for) that runs.
        taken = {row for other in self.arrivals.values() for row in other.rows} & set(rows)
        if taken:
            raise MessageError(
                f"rows {sorted((r.position, r.origin) for r in taken)} of step {self.step} already "
                "came from another sender"
            )
        arrival.rows = rows
        self.arrivals[arrival.sender] = arrival
        self._check_complete()
        return arrival

    def drop_sender(self, sender: int) -> None:
        """Stop expecting rows from a sender that is gone; the step runs with the rest."""
        if sender not in self.arrivals:
            self.given_up.setdefault(sender, self.rows_from(sender))
            self.gone.add(sender)
            self.expected = [x for x in self.expected if x.sender != sender]
            self._check_complete()

    def never_came(self) -> dict[int, int]:
        """Of the senders given up on, each one's count of expected rows that no arrival brought.
        A stand-in of a sender given up on may still bring its rows (it learned of the death
        first), so this is known only once the step is collected."""
        came = {row for arrival in self.arrivals.values() for row in arrival.rows}
        counts = {sender: sum(row not in came for row in rows) for sender, rows in self.given_up.items()}
        return {sender: n for sender, n in counts.items() if n}

    def missing_senders(self) -> list[int]:
        """Senders we expect rows from and have not heard from."""
        return sorted({x.sender for x in self.expected} - set(self.arrivals))

    def batch(self) -> tuple[torch.Tensor, torch.Tensor, Placement, list[Row], list[int]]:
        """Inputs and targets of every row that came: the carried rows in (sample, sender) order,
        then this step's in (position, origin) order; where each arrival's rows landed; this
        step's rows and the carried rows' sample indices, in that order."""
        carried = sorted(
            (k, arrival.sender, j)
            for arrival in self.arrivals.values()
            for j, k in enumerate(arrival.carried)
        )
        order = sorted(
            (row, arrival.sender, len(arrival.carried) + j)
            for arrival in self.arrivals.values()
            for j, row in enumerate(arrival.rows)
        )
        acts, toks, rows = [], [], {}
        for k, (_, sender, j) in enumerate([*carried, *order]):
            arrival = self.arrivals[sender]
            rows.setdefault(sender, []).append(k)  # an arrival's carried rows land before its others
            acts.append(arrival.activations[j])
            toks.append(arrival.tokens[j])
        placement = [(self.arrivals[s], r) for s, r in sorted(rows.items())]
        return (
            torch.stack(acts),
            torch.stack(toks),
            placement,
            [row for row, _, _ in order],
            [k for k, _, _ in carried],
        )

    def abandon(self, reason: str) -> None:
        """This step will not run here: refuse every sender still waiting for its gradients, now
        (they get an answer that says why, not a stream closed in their face)."""
        for arrival in self.arrivals.values():
            if not arrival.result.done():
                arrival.result.set_exception(Refused("abandoned", reason))
                arrival.result.exception()  # retrieved: the caller may have given up already

    def _check_complete(self) -> None:
        if {x.sender for x in self.expected} <= set(self.arrivals):
            self.complete.set()


def _matched(positions: list[int], allowed: list[Row]) -> list[Row] | None:
    """The rows of `allowed` (in order) whose positions are `positions`, taken in order; None if
    `positions` is not such a subsequence (or is empty)."""
    rows, k = [], 0
    for position in positions:
        while k < len(allowed) and allowed[k].position != position:
            k += 1
        if k == len(allowed):
            return None
        rows.append(allowed[k])
        k += 1
    return rows or None


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
        rows = Accepts.rows(ctx.B * ROW_MARGIN, model.seq_len, model.hidden_size, ctx.cfg.wire.activations)
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
                                sample_losses = ctx.replica.module(x, toks.to(ctx.device))
                                ctx.replica.backward_losses(sample_losses)
                                return sample_losses.detach()

                            got = [float(v) for v in await asyncio.to_thread(last)]
                            _answer(x, placement, got, frozenset())
                            losses += got
                        else:
                            out = await asyncio.to_thread(ctx.replica.module, x)
                            send = self.sender.send_on(t, m, out.detach(), toks, rows, carried)
                            sending = group.create_task(send)
                            running.append((placement, x, out, sending))
                    for placement, x, out, sending in running:
                        returned = await sending
                        await asyncio.to_thread(out.backward, returned.grad)
                        _answer(x, placement, returned.losses, returned.lost)
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
        self, peer_id: str, header: messages.Message, tensors: list[torch.Tensor]
    ) -> tuple[messages.Message, list[torch.Tensor]]:
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
        plan = _senders_plan(ctx, view, header)
        if ctx.rounds.detours.hear(view, plan.around):
            self._expect_again()
        # Decoded before the step checks, so that no await falls between them and the collector.
        decoded = await asyncio.to_thread(decode_rows, ctx, tensors[:-1], header.activations)
        carried, positions = _rows_of(ctx, view, header)
        acts, toks = checked_rows(ctx, [decoded, tensors[-1]])
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
        return backward_reply(ctx, header, rank, grad, losses, _gone_senders(ctx, view), lost)


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
        ctx.events.emit(events.Carried(step=t, samples=len(carried)))
    # Microbatch m is sent on while m+1 is computed; backward in ascending m.
    lost_samples: list[int] = []
    lost_windows: list[torch.Tensor] = []
    async with asyncio.TaskGroup() as group:
        sending = []
        for m, (xm, ym, rm, wm) in enumerate(parts):
            older = carried if m == 0 else []
            out = await asyncio.to_thread(ctx.replica.module, xm)
            send = sender.send_on(t, m, out.detach(), ym, rm, older)
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


def _rows_of(ctx: PeerContext, view: MembershipView, header: ForwardHeader) -> tuple[list[int], list[int]]:
    """The sample indices of a request's carried rows (rows of the step before: peer/carry.py),
    and the batch positions of its rows of this step."""
    carried, planned = list(header.samples[: header.carried]), header.samples[header.carried :]
    positions = [k - header.step * ctx.B for k in planned]
    if not positions or not all(0 <= i < ctx.B for i in positions):
        raise MessageError(f"samples {list(planned)} are not rows of step {header.step}")
    if not all(0 <= k - (header.step - 1) * ctx.B < ctx.B for k in carried):
        raise MessageError(f"carried samples {carried} are not rows of step {header.step - 1}")
    if len(carried) > ctx.B * view.replica_counts()[0]:  # more than the step before had
        raise MessageError(f"{len(carried)} carried rows: step {header.step - 1} had fewer")
    return carried, positions


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


def _answer(x: torch.Tensor, placement: Placement, losses: list[float], lost: frozenset[int]) -> None:
    """Answer every arrival of a batch that ran with its rows' input gradients and losses (one per
    row of the batch), naming its rows that were lost further on (`lost`: rows of the batch)."""
    assert x.grad is not None
    x_grad = x.grad.cpu()  # replies leave from the CPU
    for arrival, rows in placement:
        if not arrival.result.done():  # the sender may have given up on us meanwhile
            gone = tuple(i for i, r in enumerate(rows) if r in lost)
            arrival.result.set_result((x_grad[rows].contiguous(), [losses[r] for r in rows], gone))


def _gone_senders(ctx: PeerContext, view: MembershipView) -> tuple[int, ...]:
    """On stage 1: the ranks of stage 0 that failed us, said in our answers (stage 0 stands in
    for them from its next step: peer/detours.py). Elsewhere nobody acts on it: ()."""
    if ctx.stage != 1:
        return ()
    return tuple(r for r, peer in enumerate(view.stages[0]) if peer in ctx.rounds.dead)


def _senders_plan(ctx: PeerContext, view: MembershipView, header: ForwardHeader) -> StepPlan:
    """The plan the sender of `header` follows: the round's, routing around the replicas of our
    stage it says it routes around, and with it standing in for those of its own stage it names."""
    places = {(header.hop, r) for r in header.stands_in_for} | {(ctx.stage, r) for r in header.routes_around}
    try:
        return ctx.plan_at(header.step).routing_around(places)
    except ValueError as e:
        raise MessageError(f"the sender routes around replicas this round does not have: {e}") from e


def backward_reply(
    ctx: PeerContext,
    header: ForwardHeader,
    rank: int,
    grad: torch.Tensor,
    losses: list[float],
    gone: tuple[int, ...] = (),
    lost: tuple[int, ...] = (),
) -> tuple[BackwardHeader, list[torch.Tensor]]:
    """The answer to `header`'s rows: their gradients in the run's wire format, their losses, the
    ranks of the sender's stage that failed us (`gone`: stage 0 stands in for them), and which of
    the rows a later stage lost (`lost`)."""
    grads = wire.encode(grad, ctx.cfg.wire.activations)
    reply = BackwardHeader(
        run_id=header.run_id,
        round=header.round,
        step=header.step,
        hop=header.hop,
        sender_rank=rank,
        samples=header.samples,
        grad=TensorMeta.of(grads[0]),
        losses=tuple(losses),
        scale=TensorMeta.of(grads[1]) if len(grads) > 1 else None,
        gone=gone,
        lost=lost,
    )
    return reply, grads


def decode_rows(ctx: PeerContext, parts: list[torch.Tensor], payload: TensorMeta) -> torch.Tensor:
    """Float32 activations from their wire tensors, in the run's format (`wire.activations`) only.

    (The transport already checked their floats for NaN/inf.)"""
    fmt = ctx.cfg.wire.activations
    if payload.dtype != messages.WIRE_DTYPES[fmt]:
        raise MessageError(f"rows came as {payload.dtype}; this run sends activations as {fmt}")
    return wire.decode(parts, fmt, check_finite=False)


def checked_rows(ctx: PeerContext, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations and token ids from another peer, checked against this model before use.

    (The transport already checked them against the header's metas and for NaN/inf.)"""
    model = ctx.cfg.model
    if len(tensors) != 2:
        raise MessageError(f"expected activations and token ids, got {len(tensors)} tensors")
    acts, toks = tensors
    if acts.dtype != torch.float32 or acts.shape[1:] != (model.seq_len, model.hidden_size):
        raise MessageError(f"activations {acts.dtype} {tuple(acts.shape)} do not fit this model")
    if toks.dtype != torch.int64 or int(toks.min()) < 0 or int(toks.max()) >= model.vocab_size:
        raise MessageError("token ids must be int64 within the vocabulary")
    return acts, toks


def check_sender(
    ctx: PeerContext, peer_id: str, view: MembershipView, run_id: str, hop: int, rank: int
) -> None:
    """The request must come from the peer `view` puts at (hop, rank), for our stage."""
    if run_id != ctx.run_id or hop != ctx.stage - 1:
        raise MessageError(
            f"request for run {run_id!r} hop {hop}; this is stage {ctx.stage} of {ctx.run_id!r}"
        )
    if not 0 <= rank < len(view.stages[hop]) or view.peer_at(hop, rank) != peer_id:
        raise MessageError(f"peer {peer_id} is not replica {rank} of stage {hop} in round {view.round}")
