"""Validation along fixed paths: stage-0 replica q sends the held-out windows to replica q of
every later stage (for q below the smallest replica count), and the last stage answers with the
per-sample losses. Run once, at the end of training, with the trained weights.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING

import torch

from noloco_swarm.data.stream import validation_windows
from noloco_swarm.peer.streams import PeerUnavailable, RemoteRefused
from noloco_swarm.protocol import messages
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.protocol.messages import EvalHeader, EvalReply, MessageError, TensorMeta

if TYPE_CHECKING:
    from noloco_swarm.peer.runtime import Peer

logger = logging.getLogger(__name__)
EVAL_BATCH = 16


def _paths(peer: Peer) -> tuple[MembershipView, int]:
    """The last round's view and how many fixed paths it has: path q is replica q of every
    stage, for q below the smallest replica count."""
    view = peer.view_at(peer.step - 1)
    return view, min(view.replica_counts())


async def evaluate(peer: Peer) -> float | None:
    """Stage-0 replica q runs the validation windows along path q; returns the mean loss."""
    windows = validation_windows(peer.cfg.data)[: peer.cfg.eval_windows]
    view, paths = _paths(peer)
    rank = view.rank_of(peer.me)[1]
    if rank >= paths:
        return None
    broken = [s for s in range(peer.P) if view.peer_at(s, rank) in peer.rounds.dead]
    if broken:
        logger.warning("no evaluation: this replica's fixed path is broken at stage %d", min(broken))
        return None
    if not peer.is_first:
        try:
            for _ in range(math.ceil(len(windows) / EVAL_BATCH)):
                await asyncio.wait_for(peer.eval_queue.get(), peer.opts.step_timeout * 4)
        except TimeoutError:
            logger.warning("the previous stage did not run its evaluation; finishing without it")
        return None
    total, count = 0.0, 0
    for b, start in enumerate(range(0, len(windows), EVAL_BATCH)):
        w = windows[start : start + EVAL_BATCH]
        try:
            losses = await _batch(peer, view, rank, b, w[:, :-1], w[:, 1:])
        except (PeerUnavailable, RemoteRefused, MessageError) as e:
            logger.warning("evaluation failed on this replica's path: %s", e)
            return None
        total += sum(losses)
        count += len(losses)
    return total / count


async def _batch(
    peer: Peer, view: MembershipView, rank: int, b: int, x: torch.Tensor, y: torch.Tensor
) -> list[float]:
    x = x.to(peer.device)
    with torch.no_grad():
        out = await asyncio.to_thread(peer.replica.module, x, y.to(peer.device) if peer.is_last else None)
    if peer.is_last:
        return [float(v) for v in out]
    header = EvalHeader(
        peer.opts.run_id, peer.step, peer.stage, rank, b, TensorMeta.of(out), TensorMeta.of(y)
    )
    reply, _ = await peer.transport.call(
        view.peer_at(peer.stage + 1, rank),
        "rpc_eval",
        header,
        [out, y.contiguous()],
        timeout=peer.opts.step_timeout,
    )
    if not isinstance(reply, EvalReply) or len(reply.losses) != len(x):
        raise MessageError("malformed eval reply")
    return list(reply.losses)


async def serve(
    peer: Peer, peer_id: str, header: messages.Message, tensors: list[torch.Tensor]
) -> tuple[messages.Message, list[torch.Tensor]]:
    """Validation rows along fixed path `header.rank`; answered with per-sample losses."""
    if not isinstance(header, EvalHeader):
        raise MessageError("expected an eval header")
    try:  # evaluate the trained weights: wait until our own last step is done
        await asyncio.wait_for(peer.trained.wait(), peer.opts.step_timeout * 2)
    except TimeoutError as e:
        raise MessageError("this peer has not finished training yet") from e
    if header.step != peer.step:
        raise MessageError(f"evaluation after step {header.step}; this peer ended at step {peer.step}")
    view, paths = _paths(peer)
    peer.check_sender(peer_id, view, header.run_id, header.hop, header.rank)
    if header.rank >= paths or view.rank_of(peer.me)[1] != header.rank:
        raise MessageError("evaluation follows the fixed path: same rank at every stage")
    acts, toks = peer.checked_rows(tensors)
    losses = await _batch(peer, view, header.rank, header.batch, acts, toks)
    peer.eval_queue.put_nowait(None)
    return EvalReply(tuple(losses)), []
