"""The outer step in the run loop: started at each boundary, applied at once or k steps later.

`OuterSteps` is the loop's room for the outer verb: at a boundary it starts the exchange with the
round's group (exchange/runner.py's `OuterExchange`), and applies the outer step with the group's
tensors (the same StageReplica code as the simulator). With `outer.overlap_steps` = k > 0 the
exchange of boundary t runs as a task it owns (`PendingOuter`) while the replica trains inner
steps t+1 .. t+k; after step t+k the loop waits for whatever is still in flight (a partner that
misses the exchange's deadline is a failed member, as without overlap) and the step is applied to
the boundary's snapshot, carrying the progress since over. A run that ends, or a peer that
leaves, before k steps are up completes it there; the simulator does the same (`finish`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping

import torch

from noloco_swarm.peer import events
from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.exchange.board import ExchangeBoard
from noloco_swarm.peer.exchange.ledger import ByteLedger
from noloco_swarm.peer.exchange.runner import OuterExchange
from noloco_swarm.peer.net.lifetime import trim_heap
from noloco_swarm.protocol.plausible import SLICE


class OuterSteps:
    """This peer's outer steps: the one under way, and how many were taken and lost partners."""

    def __init__(self, ctx: PeerContext, board: ExchangeBoard, ledger: ByteLedger) -> None:
        self.ctx, self.board, self.ledger = ctx, board, ledger
        self.pending: PendingOuter | None = None  # an overlapped outer step under way
        self.taken = 0
        self.dropped_partners = 0
        # How far our slow weights moved in outer steps taken alone (every partner failed or was
        # rejected) since the last one that averaged a partner in: replicas kept apart drift
        # apart, and a partner's weights are judged against it too (protocol/plausible.py).
        self.drift = 0.0

    async def at_boundary(self, run_ends_at: int) -> None:
        """After the last inner step of a round: the outer step, at once or started (overlap).
        `run_ends_at`: the step the run ends at (an overlapped step due later is applied there,
        so its exchange is not paced: peer.exchange_pacing)."""
        k = self.ctx.cfg.outer.overlap_steps
        if k > 0:
            paced = self.ctx.step + k <= run_ends_at
            self.pending = await start_outer_step(self.ctx, self.board, self.ledger, self.drift, paced=paced)
        else:
            self._record(await take_outer_step(self.ctx, self.board, self.ledger, self.drift))

    async def finish(self, *, due_only: bool = False) -> None:
        """Apply the overlapped step under way, if any (waiting for its exchange); with
        `due_only`, only once its k inner steps are done."""
        pending = self.pending
        if pending is None or (due_only and self.ctx.step < pending.apply_at):
            return
        outer = await finish_outer_step(pending)
        self.pending = None
        self._record(outer)

    async def abandon(self) -> None:
        """Drop the step under way (the peer was excluded, failed or is stopped)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            await pending.abandon()

    def _record(self, outer: events.Outer) -> None:
        self.taken += 1
        self.dropped_partners += len(outer.failed)
        if outer.partners and len(outer.failed) == len(outer.partners):  # it stepped alone
            self.drift += self.ctx.replica.moved
        else:
            self.drift = 0.0
        self.ctx.events.emit(outer)


class PendingOuter:
    """An outer step under way: its exchange, the boundary's theta (also the snapshot an overlapped
    step carries progress from) and, once the exchange is done, the group's tensors.

    `start_outer_step` creates it at the boundary; the exchange runs as a task it owns, concurrently
    with the next inner steps when `outer.overlap_steps` = k > 0; `finish_outer_step` awaits it
    after inner step `apply_at` = boundary + k (or at the run's end, if sooner) and applies the step.
    A partner that has not delivered by the exchange's deadline is a failed member, as without
    overlap. `abandon` cancels it (the peer is excluded and joins again, or is stopped).
    """

    def __init__(
        self, ctx: PeerContext, exchange: OuterExchange, theta: torch.Tensor, ledger: ByteLedger
    ) -> None:
        self.ctx, self.exchange, self.theta = ctx, exchange, theta
        self.step = exchange.plan.step
        self.apply_at = self.step + ctx.cfg.outer.overlap_steps
        self.start = time.perf_counter()
        self.seconds = 0.0  # the exchange's own duration, once it is done
        self.task = asyncio.create_task(self._run(ledger))  # owned: finished or abandoned below

    async def _run(
        self, ledger: ByteLedger
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor] | None, tuple[int, int]]:
        thetas, phis = await self.exchange.mean_inputs(self.theta)
        self.seconds = time.perf_counter() - self.start
        # Settled as soon as the exchange ends, before a partner runs ahead into the next one.
        return thetas, phis, ledger.settle(list(self.exchange.members.values()))

    async def abandon(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def start_outer_step(
    ctx: PeerContext, board: ExchangeBoard, ledger: ByteLedger, drift: float = 0.0, *, paced: bool = False
) -> PendingOuter:
    """At boundary t = ctx.step: snapshot theta and start exchanging it with the group of the round
    that just closed, in the background. The replica may train on while it runs (overlap).
    `drift`: how far our slow weights moved alone since we last averaged (OuterSteps.drift);
    `paced`: our sending may be spread over the overlap window (OuterExchange.pacer)."""
    t = ctx.step
    view = ctx.view_at(t - 1)  # the round that just closed
    rank = view.rank_of(ctx.me)[1]
    plan = ctx.run_plan.outer_plan(t, rank, len(view.stages[ctx.stage]))
    assert plan is not None, "only methods with an outer step get here"
    if ctx.cfg.peer.release_memory == "thp":  # the heap's freed blocks, before the exchange's copies
        await asyncio.to_thread(trim_heap)
    theta = await asyncio.to_thread(ctx.replica.theta)  # a copy: training may change the weights
    exchange = OuterExchange(ctx, board, plan, view.round, drift, paced=paced)
    return PendingOuter(ctx, exchange, theta, ledger)


async def finish_outer_step(pending: PendingOuter) -> events.Outer:
    """Wait for the exchange if it is still in flight, then apply the outer step (the same
    StageReplica code as the simulator): blocking when the replica has not trained since the
    boundary (k = 0), else on the snapshot, carrying over the progress made since. Returns the
    event describing it."""
    ctx, exchange = pending.ctx, pending.exchange
    waiting = time.perf_counter()
    thetas, phis, (sent, received) = await pending.task
    waited = time.perf_counter() - waiting
    snapshot = pending.theta if ctx.cfg.outer.overlap_steps > 0 else None

    def apply() -> tuple[float | None, str]:  # one worker-thread hop for the boundary's float work
        spread = None  # a NoLoCo pair's spread; alone (a partner failed), nothing to compare with
        if exchange.plan.update == "noloco" and len(thetas) > 1:
            spread = group_spread(thetas, exchange.plan.rank)
        ctx.replica.apply_outer(exchange.plan, thetas, phis, snapshot=snapshot)
        return spread, ctx.replica.state_hash()  # comparable with the simulator

    spread, state_hash = await asyncio.to_thread(apply)
    if not exchange.failed:  # a failed one lasted its deadline: it says nothing of the link
        ctx.deadlines.observe_exchange(pending.seconds)
    return events.Outer(
        step=pending.step,
        group=list(exchange.plan.group),
        partners=list(exchange.members.values()),
        failed=sorted(exchange.failed),
        sent_bytes=sent,
        received_bytes=received,
        seconds=pending.seconds,
        state_hash=state_hash,
        applied_at=ctx.step,
        waited=waited,
        spread=spread,
        pace=exchange.pace.rate if exchange.pace is not None else 0.0,
        uplink=exchange.board.uplink.rate or 0.0,
    )


def group_spread(thetas: Mapping[int, torch.Tensor], rank: int) -> float:
    """RMS distance (per weight) of `rank`'s fast weights to the mean of the group's, in float64
    slice by slice. For a pair, half the RMS distance between the two replicas."""
    flats = {r: t.reshape(-1) for r, t in thetas.items()}
    own = flats[rank]
    total = 0.0
    for lo in range(0, own.numel(), SLICE):
        mean = torch.stack([f[lo : lo + SLICE].double() for f in flats.values()]).mean(dim=0)
        total += float((own[lo : lo + SLICE].double() - mean).square().sum())
    return math.sqrt(total / max(1, own.numel()))


async def take_outer_step(
    ctx: PeerContext, board: ExchangeBoard, ledger: ByteLedger, drift: float = 0.0
) -> events.Outer:
    """Exchange theta with the group of the round that just closed and apply the outer step at
    once (blocking, `outer.overlap_steps` = 0). Returns the event describing it."""
    pending = await start_outer_step(ctx, board, ledger, drift)
    try:
        return await finish_outer_step(pending)
    finally:
        await pending.abandon()  # a no-op once finished; cancels the exchange if we were
