"""Sending rows on: a replica's rows of one microbatch to the next stage's replicas, and their
gradients back (the sender's side of rpc_forward; the receiver's side is peer/inner.py).

Each receiver gets the rows the step plan routes to it, in the run's wire format, in one call.
A call whose stream broke is made again while the receiver answers a probe (the receiver answers
a resend with what it computed the first time); rows whose gradient never comes back are dropped
from the step (their gradient stays zero), with the reason in a `dropped` event.
"""

from __future__ import annotations

import asyncio
import logging
import math

import torch

from noloco_swarm.peer import events
from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.streams import PeerUnavailable, RemoteRefused, StreamClosed, StreamTruncated
from noloco_swarm.protocol import plausible, routing, wire
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.protocol.messages import BackwardHeader, ForwardHeader, MessageError, TensorMeta
from noloco_swarm.protocol.plausible import Implausible

logger = logging.getLogger(__name__)
GradRows = tuple[list[int], torch.Tensor, tuple[float, ...]]  # batch rows, their gradients, losses
# A forward whose stream broke is sent at most this many times in all, while the receiver answers.
SEND_ATTEMPTS = 3


class RowSender:
    """One replica's sending side of every inner step."""

    def __init__(self, ctx: PeerContext) -> None:
        self.ctx = ctx
        self.dropped_samples = 0  # over the run

    async def send_on(
        self, t: int, m: int, out: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, list[float]]:
        """Send each row of microbatch m to the replica the plan names; return the gradient rows
        and losses."""
        ctx = self.ctx
        view, plan = ctx.view_at(t), ctx.plan_at(t)
        rank = view.rank_of(ctx.me)[1]
        held = plan.rows(t, ctx.stage, rank, m)
        results: dict[int, asyncio.Task[GradRows | str]] = {}
        async with asyncio.TaskGroup() as group:
            for receiver, sent in plan.sends(t, ctx.stage, rank, m).items():
                samples = tuple(routing.sample_index(t, held[j].row.position, ctx.B) for j in sent)
                call = self._call_or_drop(view, receiver, sent, samples, out, tokens, t)
                results[receiver] = group.create_task(call)
        # Rows whose gradient never came back are dropped from this step: their gradient stays 0.
        grad = torch.zeros_like(out)
        losses: list[float] = []
        lost: list[str] = []
        for task in results.values():
            result = task.result()
            if isinstance(result, str):
                lost.append(result)
                continue
            sent, rows, sample_losses = result
            grad[sent] = rows.to(grad.device)
            losses.extend(sample_losses)
        dropped = out.shape[0] - len(losses)
        if dropped:
            self.dropped_samples += dropped
            ctx.events.emit(
                events.Dropped(step=t, hop=ctx.stage, samples=dropped, side="sender", reasons=lost)
            )
        return grad, losses

    async def _call_or_drop(
        self,
        view: MembershipView,
        receiver_rank: int,
        sent: list[int],
        samples: tuple[int, ...],
        out: torch.Tensor,
        tokens: torch.Tensor,
        t: int,
    ) -> GradRows | str:
        """Forward `sent` rows to one receiver; if they are lost, why (for the Dropped event)."""
        ctx, hop = self.ctx, self.ctx.stage
        receiver = view.peer_at(hop + 1, receiver_rank)
        fmt, toks = ctx.cfg.wire.activations, tokens[sent].contiguous()
        acts = await asyncio.to_thread(wire.encode, out[sent].cpu(), fmt)  # encoded on the CPU
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
        )
        for attempt in range(SEND_ATTEMPTS):  # a live receiver whose stream broke gets them again
            if receiver in ctx.rounds.dead:
                return f"{receiver} is gone"
            try:
                reply, tensors = await ctx.rounds.watched(
                    receiver,
                    ctx.transport.call(
                        receiver, "rpc_forward", header, [*acts, toks], timeout=ctx.cfg.peer.step_timeout
                    ),
                    f"the forward of step {t}",
                )
                if not isinstance(reply, BackwardHeader) or len(reply.losses) != len(sent):
                    raise MessageError(f"{receiver} answered step {t} with a malformed reply")
                # The transport checked the floats for NaN/inf as they landed.
                grad = await asyncio.to_thread(wire.decode, tensors, fmt, acts[0].shape, check_finite=False)
                plausible.check_rows(grad, f"gradients from {receiver} for step {t}")
                if not all(math.isfinite(v) for v in reply.losses):
                    raise Implausible("nonfinite", f"{receiver} answered step {t} with non-finite losses")
                return sent, grad, reply.losses
            except RemoteRefused as e:  # alive but disagrees (e.g. another view): drop these rows
                logger.warning("stage %d peer %s refused step %d: %s", hop + 1, receiver, t, e)
                ctx.events.emit(events.Refused(step=t, peer=receiver, reason=str(e)))
                return str(e)
            except (StreamTruncated, StreamClosed) as e:  # the stream broke, maybe not the receiver
                last = attempt == SEND_ATTEMPTS - 1
                if last or await ctx.rounds.suspect(receiver, f"forward of step {t} broke: {e}"):
                    return f"{receiver}: {e}"
                logger.warning(
                    "the forward of step %d to %s broke (%s); sending it once more", t, receiver, e
                )
                ctx.events.emit(events.Retried(step=t, peer=receiver, reason=str(e)))
            except PeerUnavailable as e:
                await ctx.rounds.suspect(receiver, f"forward of step {t} failed: {e}")
                return f"{receiver}: {e}"
            except Implausible as e:  # absurd gradients (or losses): drop these rows, keep the peer
                logger.warning("dropped the rows of step %d sent to %s: %s", t, receiver, e)
                return f"{receiver}: {e}"
            except MessageError as e:  # it answered with garbage: do not trust it again
                ctx.rounds.mark_dead(receiver, f"malformed answer to the forward of step {t}: {e}")
                return f"{receiver}: {e}"
        raise AssertionError("the last attempt always returns")
