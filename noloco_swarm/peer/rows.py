"""A forward request's rows on a receiving replica: who may send them, what they are, and the
backward reply that answers them (the microbatch flight itself is inner.py's)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from noloco_swarm.peer.context import PeerContext
from noloco_swarm.protocol import codec
from noloco_swarm.protocol.codec import MessageError, TensorMeta
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.protocol.plan import StepPlan
from noloco_swarm.protocol.rpc import BackwardHeader, ForwardHeader
from noloco_swarm.protocol.wire import SUBSPACE


def rows_of(ctx: PeerContext, view: MembershipView, header: ForwardHeader) -> tuple[list[int], list[int]]:
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


def gone_senders(ctx: PeerContext, view: MembershipView) -> tuple[int, ...]:
    """On stage 1: the ranks of stage 0 that failed us, said in our answers (stage 0 stands in
    for them from its next step: peer/detours.py). Elsewhere nobody acts on it: ()."""
    if ctx.stage != 1:
        return ()
    return tuple(r for r, peer in enumerate(view.stages[0]) if peer in ctx.rounds.dead)


def senders_plan(ctx: PeerContext, view: MembershipView, header: ForwardHeader) -> StepPlan:
    """The plan the sender of `header` follows: the round's, routing around the replicas of our
    stage it says it routes around, and with it standing in for those of its own stage it names."""
    try:
        return sender_routing(ctx, header.step, header.hop, header.stands_in_for, header.routes_around)
    except ValueError as e:
        raise MessageError(f"the sender routes around replicas this round does not have: {e}") from e


def sender_routing(
    ctx: PeerContext, step: int, hop: int, stands_in: Iterable[int], routes_around: Iterable[int]
) -> StepPlan:
    """Step `step`'s plan as a replica of stage `hop` (the one before ours) follows it: standing in
    for the ranks `stands_in` of its stage, routing around the ranks `routes_around` of ours, as
    its forward header or its status answer says. ValueError for ranks the round does not have."""
    places = {(hop, r) for r in stands_in} | {(ctx.stage, r) for r in routes_around}
    return ctx.plan_at(step).routing_around(places)


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
    grads = ctx.boundary.encode_grads(grad)
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


def decode_rows(
    ctx: PeerContext, tensors: list[torch.Tensor], payload: TensorMeta
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 activations and int64 token ids from the wire tensors of a forward request, in the
    run's format (`wire.activations`) only; MessageError for anything malformed.

    The ids come first: under subspace the rows are rebuilt from them (U c + F[t]). (The
    transport already checked the floats for NaN/inf.)"""
    fmt, model = ctx.cfg.wire.activations, ctx.cfg.model
    if payload.dtype != codec.WIRE_DTYPES["bf16" if fmt == SUBSPACE else fmt]:
        raise MessageError(f"rows came as {payload.dtype}; this run sends activations as {fmt}")
    if len(tensors) < 2:
        raise MessageError(f"expected activations and token ids, got {len(tensors)} tensors")
    *parts, toks = tensors
    ids = ctx.boundary.ids_from_wire(toks, payload.shape[0], model.seq_len, model.vocab_size)
    return ctx.boundary.decode_rows(parts, ids, check_finite=False), ids


def checked_rows(
    ctx: PeerContext, decoded: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations and token ids from another peer, checked against this model before use.

    (The transport already checked them against the header's metas and for NaN/inf, and
    `decode_rows` the ids' shape and range.)"""
    model = ctx.cfg.model
    acts, toks = decoded
    if acts.dtype != torch.float32 or acts.shape[1:] != (model.seq_len, model.hidden_size):
        raise MessageError(f"activations {acts.dtype} {tuple(acts.shape)} do not fit this model")
    if toks.dtype != torch.int64 or toks.shape[0] != acts.shape[0]:
        raise MessageError("token ids must be int64, one row per row of activations")
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
