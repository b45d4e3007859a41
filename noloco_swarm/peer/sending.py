"""Sending rows on: a replica's rows of one microbatch to the next stage's replicas, and their
gradients back (the sender's side of rpc_forward; the receiver's side is peer/inner.py).

Each receiver gets the rows the step plan routes to it, in the run's wire format, in one call.
A next-stage replica that failed us (gone: `Detours.around`) gets no rows: the plan routes them
to its stand-in (protocol.plan, `StepPlan.around`), and the header says so, so that the stand-in
and the stages after it know whose rows they run. A stand-in's headers name whom it stands in
for (on stage 0: the gone replicas whose shards it reads). A call whose stream broke is made again while
the receiver answers a probe (the receiver answers a resend with what it computed the first
time); rows whose gradient never comes back are dropped from the step (their gradient stays
zero), with the reason in a `dropped` event. A stage between the first and the last answers such
rows of its own senders as lost (the reply's `lost`, with zero gradients), so that every stage
before it leaves their losses out too.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from noloco_swarm.peer import carry, events
from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.detours import next_stage_ranks
from noloco_swarm.peer.net.streams import PeerUnavailable, RemoteRefused, StreamClosed, StreamTruncated
from noloco_swarm.protocol import plausible, routing
from noloco_swarm.protocol.codec import MessageError, TensorMeta
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.protocol.plan import Row
from noloco_swarm.protocol.plausible import Implausible
from noloco_swarm.protocol.rpc import BackwardHeader, ForwardHeader

logger = logging.getLogger(__name__)
# batch rows, their gradients, losses, and which of them (indices into the rows) were lost further on
GradRows = tuple[list[int], torch.Tensor, tuple[float, ...], tuple[int, ...]]


@dataclass(frozen=True)
class Lost:
    """Why the rows of one call got no gradient, and whether they are worth feeding again (the
    receiver failed and is routed around from now on, not a live peer that would refuse them)."""

    reason: str
    again: bool


@dataclass(frozen=True)
class Returned:
    """What came back for the rows of one microbatch sent on: a gradient per row (zero where the
    row was lost), a loss per row (0.0 where lost), the rows lost (here or further on), and of
    those the ones worth feeding again (peer/carry.py)."""

    grad: torch.Tensor
    losses: list[float]
    lost: frozenset[int]
    again: frozenset[int] = frozenset()

    def kept_losses(self) -> list[float]:
        """The losses of the rows that were not lost, in row order."""
        return [v for j, v in enumerate(self.losses) if j not in self.lost]


@dataclass(frozen=True)
class Around:
    """What a forward header says about routing around gone replicas (ForwardHeader's fields)."""

    stands_in_for: tuple[int, ...]
    routes_around: tuple[int, ...]


# A forward whose stream broke is sent at most this many times in all, while the receiver answers.
SEND_ATTEMPTS = 3


class RowSender:
    """One replica's sending side of every inner step."""

    def __init__(self, ctx: PeerContext) -> None:
        self.ctx = ctx
        self.dropped_samples = 0  # over the run
        self.began = math.inf  # when this replica's current step began (monotonic; InnerSteps.run)
        # The (step, microbatch) whose rows we sent on last, and the next-stage ranks we sent them
        # to (our status answer says so: a receiver not among them stops waiting for us).
        self.sent: tuple[tuple[int, int], tuple[int, ...]] = ((-1, -1), ())

    async def send_on(
        self,
        t: int,
        m: int,
        out: torch.Tensor,
        tokens: torch.Tensor,
        rows: Sequence[Row] | None = None,
        carried: Sequence[int] = (),
    ) -> Returned:
        """Send each row of microbatch m on to the replica the plan names, routing around the
        next-stage replicas we know are gone; return what came back for each row. `rows`: the
        rows of this step `out` holds, in its order (stage 0: its own rows, the default), after
        the rows of the step before it holds first (`carried`: their sample indices), which go
        along with this step's rows to the receivers those go to (peer/carry.py)."""
        ctx = self.ctx
        view = ctx.view_at(t)
        rank = view.rank_of(ctx.me)[1]
        base = ctx.plan_at(t)
        plan = base.routing_around(ctx.rounds.detours.around(view))
        if rows is None:
            rows = [x.row for x in plan.rows(t, ctx.stage, rank, m)]
        planned = plan.route(t, ctx.stage, rows)
        routes = carry.along(planned, len(carried))
        self.sent = ((t, m), tuple(routes))
        around = Around(
            stands_in_for=plan.stands_in_for(t, ctx.stage, rank, rows),
            routes_around=next_stage_ranks(plan.around, ctx.stage),
        )
        if around.routes_around:
            self._note_rerouted(t, base.route(t, ctx.stage, rows), planned, around.routes_around)
        n = len(carried)
        results: dict[int, asyncio.Task[GradRows | Lost]] = {}
        ids: dict[int, tuple[int, ...]] = {}  # the sample indices sent to each receiver
        async with asyncio.TaskGroup() as group:
            for receiver, sent in routes.items():
                samples = ids[receiver] = tuple(
                    carried[j] if j < n else routing.sample_index(t, rows[j - n].position, ctx.B)
                    for j in sent
                )
                older = sum(j < n for j in sent)
                call = self._call_or_drop(view, receiver, sent, samples, out, tokens, (t, m), around, older)
                results[receiver] = group.create_task(call)
        # Rows whose gradient never came back are dropped from this step: their gradient stays 0.
        # (Rows a later stage lost came back with a zero gradient; that stage said so in an event.)
        grad = torch.zeros_like(out)
        losses = [0.0] * out.shape[0]
        lost = set(range(out.shape[0]))
        reasons: list[str] = []
        dropped: list[int] = []  # the sample indices of rows whose call failed here
        again: set[int] = set()
        for receiver, task in results.items():
            result = task.result()
            if isinstance(result, Lost):
                reasons.append(result.reason)
                dropped += ids[receiver]
                again.update(routes[receiver] if result.again else ())
                continue
            sent, grad_rows, sample_losses, further = result
            grad[sent] = grad_rows.to(grad.device)
            for j, v in zip(sent, sample_losses, strict=True):
                losses[j] = v
            lost -= set(sent)
            for i in further:  # lost further on: no gradient, whatever the reply held
                grad[sent[i]] = 0.0
                lost.add(sent[i])
                again.add(sent[i])
        if dropped:
            self.dropped_samples += len(dropped)
            ctx.events.emit(
                events.Dropped(
                    step=t,
                    hop=ctx.stage,
                    samples=len(dropped),
                    side="sender",
                    reasons=reasons,
                    sample_ids=dropped,
                )
            )
        return Returned(grad, losses, frozenset(lost), frozenset(again))

    def _note_rerouted(
        self, t: int, planned: dict[int, list[int]], routes: dict[int, list[int]], around: tuple[int, ...]
    ) -> None:
        """Say how many rows went to stand-ins instead of the replicas the plan first named."""
        where = {j: r for r, sent in routes.items() for j in sent}
        moved = [(j, where[j]) for r in around for j in planned.get(r, [])]
        if moved:
            ctx = self.ctx
            ctx.events.emit(
                events.Rerouted(
                    step=t,
                    hop=ctx.stage,
                    samples=len(moved),
                    around=list(around),
                    to=sorted({r for _, r in moved}),
                )
            )

    async def _passed(self, receiver: str, t: int, m: int) -> int | None:
        """The step `receiver` is at if it passed step t or collected its microbatch m: it would
        refuse our rows as late, so they are not sent (no stale traffic from a peer that fell
        behind). Known from our last probe of it; a step that outlasted the step deadline before
        sending (this process was stopped, or waited on someone who was) asks it first, once: a
        receiver that answered since the step's deadline passed was asked after the stall."""
        ctx = self.ctx
        stall = self.began + ctx.deadlines.step
        unasked = ctx.rounds.answered.get(receiver, -math.inf) < stall < time.monotonic()
        if unasked and receiver not in ctx.rounds.dead and ctx.rounds.passed(receiver, t, m) is None:
            await ctx.rounds.probe(receiver)
        return ctx.rounds.passed(receiver, t, m)

    async def _call_or_drop(
        self,
        view: MembershipView,
        receiver_rank: int,
        sent: list[int],
        samples: tuple[int, ...],
        out: torch.Tensor,
        tokens: torch.Tensor,
        slot: tuple[int, int],
        around: Around,
        carried: int = 0,
    ) -> GradRows | Lost:
        """Forward `sent` rows of `slot` (step, microbatch) to one receiver; if they are lost,
        why (for the Dropped event)."""
        ctx, hop, (t, m) = self.ctx, self.ctx.stage, slot
        receiver = view.peer_at(hop + 1, receiver_rank)
        # (Only before the first call: a receiver past step t still answers a resend after a
        # broken stream with what it computed for these rows.)
        if (at := await self._passed(receiver, t, m)) is not None:
            ctx.events.emit(events.Unsent(step=t, peer=receiver, at=at, samples=len(sent)))
            where = f"past step {t}" if at > t else f"done collecting microbatch {m} of step {t}"
            return Lost(f"{receiver} is at step {at}, {where}: not sent", again=False)
        ids = tokens[sent]
        # Encoded on the CPU. Under subspace, rows that leave F[t] + span(U) are refused here
        # (protocol.subspace.OutsideSubspace): this model is not the run's, and that ends the peer.
        acts = await asyncio.to_thread(ctx.boundary.encode_rows, out[sent].cpu(), ids)
        toks = ctx.boundary.ids_to_wire(ids)
        header = ForwardHeader(
            run_id=ctx.run_id,
            round=view.round,
            step=t,
            hop=hop,
            sender_rank=view.rank_of(ctx.me)[1],
            samples=samples,
            activations=TensorMeta.of(acts[0]),
            tokens=TensorMeta.of(toks),
            view=view.digest(),
            scale=TensorMeta.of(acts[1]) if len(acts) > 1 else None,
            stands_in_for=around.stands_in_for,
            routes_around=around.routes_around,
            carried=carried,
        )
        for attempt in range(SEND_ATTEMPTS):  # a live receiver whose stream broke gets them again
            if receiver in ctx.rounds.dead:
                return Lost(f"{receiver} is gone", again=True)
            try:
                reply, tensors = await ctx.rounds.watched(
                    receiver,
                    ctx.transport.call(
                        receiver, "rpc_forward", header, [*acts, toks], timeout=ctx.deadlines.step
                    ),
                    f"the forward of step {t}",
                )
                if not isinstance(reply, BackwardHeader) or len(reply.losses) != len(sent):
                    raise MessageError(f"{receiver} answered step {t} with a malformed reply")
                # The transport checked the floats for NaN/inf as they landed.
                shape = (len(sent), *out.shape[1:])
                grad = await asyncio.to_thread(ctx.boundary.decode_grads, tensors, shape, check_finite=False)
                plausible.check_rows(grad, f"gradients from {receiver} for step {t}")
                if not all(math.isfinite(v) for v in reply.losses):
                    raise Implausible("nonfinite", f"{receiver} answered step {t} with non-finite losses")
                ctx.rounds.detours.told_gone(view, reply.gone, receiver, ctx.rounds.suspect)
                return sent, grad, reply.losses, reply.lost
            except RemoteRefused as e:  # alive but disagrees (e.g. another view): drop these rows
                logger.warning("stage %d peer %s refused step %d: %s", hop + 1, receiver, t, e)
                ctx.events.emit(events.Refused(step=t, peer=receiver, reason=str(e)))
                return Lost(str(e), again=False)  # it would refuse them again
            except (StreamTruncated, StreamClosed) as e:  # the stream broke, maybe not the receiver
                last = attempt == SEND_ATTEMPTS - 1
                if last or await ctx.rounds.suspect(receiver, f"forward of step {t} broke: {e}"):
                    return Lost(f"{receiver}: {e}", again=True)
                logger.warning(
                    "the forward of step %d to %s broke (%s); sending it once more", t, receiver, e
                )
                ctx.events.emit(events.Retried(step=t, peer=receiver, reason=str(e)))
            except PeerUnavailable as e:
                await ctx.rounds.suspect(receiver, f"forward of step {t} failed: {e}")
                return Lost(f"{receiver}: {e}", again=True)
            except Implausible as e:  # absurd gradients (or losses): drop these rows, keep the peer
                logger.warning("dropped the rows of step %d sent to %s: %s", t, receiver, e)
                return Lost(f"{receiver}: {e}", again=False)  # it stays a receiver
            except MessageError as e:  # it answered with garbage: do not trust it again
                ctx.rounds.mark_dead(receiver, f"malformed answer to the forward of step {t}: {e}")
                return Lost(f"{receiver}: {e}", again=True)  # routed around from now on
        raise AssertionError("the last attempt always returns")
