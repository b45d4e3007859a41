"""Validation along fixed paths: stage-0 replica q sends the held-out windows to replica q of
every later stage (for q below the smallest replica count: protocol.plan.eval_paths), and the
last stage answers with the per-sample losses. Run once, at the end of training, with the trained
weights.
"""

from __future__ import annotations

import asyncio
import logging
import math

import torch

from noloco_swarm.data.stream import validation_windows
from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.inner import InnerSteps
from noloco_swarm.peer.net.limits import Accepts
from noloco_swarm.peer.net.streams import PeerUnavailable, RemoteRefused
from noloco_swarm.peer.rows import check_sender, checked_rows
from noloco_swarm.protocol import codec
from noloco_swarm.protocol.codec import MessageError, TensorMeta
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.protocol.plan import eval_paths
from noloco_swarm.protocol.rpc import EvalHeader, EvalReply

logger = logging.getLogger(__name__)
EVAL_BATCH = 16


class Evaluation:
    """The end-of-run validation pass of one replica, and its rpc_eval handler."""

    def __init__(self, ctx: PeerContext, inner: InnerSteps) -> None:
        self.ctx, self.inner = ctx, inner
        self.trained = asyncio.Event()  # set once our own last training step is done
        self._served: asyncio.Queue[None] = asyncio.Queue()  # one item per batch we passed on
        # fp32 activations of one validation batch and their token ids.
        model = ctx.cfg.model
        ctx.transport.register(
            "rpc_eval", self.rpc_eval, Accepts.rows(EVAL_BATCH, model.seq_len, model.hidden_size, "fp32")
        )

    def _paths(self) -> tuple[MembershipView, int]:
        """The last round's view and how many fixed paths it has."""
        view = self.ctx.view_at(self.ctx.step - 1)
        return view, eval_paths(view.replica_counts())

    async def evaluate(self) -> float | None:
        """Stage-0 replica q runs the validation windows along path q; returns the mean loss."""
        ctx = self.ctx
        windows = validation_windows(ctx.cfg.data)[: ctx.cfg.eval_windows]
        view, paths = self._paths()
        rank = view.rank_of(ctx.me)[1]
        if rank >= paths:
            return None
        broken = [s for s in range(ctx.P) if view.peer_at(s, rank) in ctx.rounds.dead]
        if broken:
            logger.warning("no evaluation: this replica's fixed path is broken at stage %d", min(broken))
            return None
        if not ctx.is_first:
            try:
                for _ in range(math.ceil(len(windows) / EVAL_BATCH)):
                    await asyncio.wait_for(self._served.get(), ctx.cfg.peer.step_timeout * 4)
            except TimeoutError:
                logger.warning("the previous stage did not run its evaluation; finishing without it")
            return None
        total, count = 0.0, 0
        for b, start in enumerate(range(0, len(windows), EVAL_BATCH)):
            w = windows[start : start + EVAL_BATCH]
            try:
                losses = await self._batch(view, rank, b, w[:, :-1], w[:, 1:])
            except (PeerUnavailable, RemoteRefused, MessageError) as e:
                logger.warning("evaluation failed on this replica's path: %s", e)
                return None
            total += sum(losses)
            count += len(losses)
        return total / count

    async def _batch(
        self, view: MembershipView, rank: int, b: int, x: torch.Tensor, y: torch.Tensor
    ) -> list[float]:
        ctx = self.ctx
        x, targets = x.to(ctx.device), (y.to(ctx.device) if ctx.is_last else None)

        def forward() -> torch.Tensor:
            with torch.no_grad():  # grad mode is per thread: it must be set in the worker
                return ctx.replica.module(x, targets)

        out = await asyncio.to_thread(forward)
        if ctx.is_last:
            return [float(v) for v in out]
        header = EvalHeader(ctx.run_id, ctx.step, ctx.stage, rank, b, TensorMeta.of(out), TensorMeta.of(y))
        reply, _ = await ctx.transport.call(
            view.peer_at(ctx.stage + 1, rank),
            "rpc_eval",
            header,
            [out, y.contiguous()],
            timeout=ctx.cfg.peer.step_timeout,
        )
        if not isinstance(reply, EvalReply) or len(reply.losses) != len(x):
            raise MessageError("malformed eval reply")
        return list(reply.losses)

    async def rpc_eval(
        self, peer_id: str, header: codec.Message, tensors: list[torch.Tensor]
    ) -> tuple[codec.Message, list[torch.Tensor]]:
        """Validation rows along fixed path `header.rank`; answered with per-sample losses."""
        ctx = self.ctx
        if not isinstance(header, EvalHeader):
            raise MessageError("expected an eval header")
        try:  # evaluate the trained weights: wait until our own last step is done
            await asyncio.wait_for(self.trained.wait(), ctx.cfg.peer.step_timeout * 2)
        except TimeoutError as e:
            raise MessageError("this peer has not finished training yet") from e
        if header.step != ctx.step:
            raise MessageError(f"evaluation after step {header.step}; this peer ended at step {ctx.step}")
        view, paths = self._paths()
        check_sender(self.ctx, peer_id, view, header.run_id, header.hop, header.rank)
        if header.rank >= paths or view.rank_of(ctx.me)[1] != header.rank:
            raise MessageError("evaluation follows the fixed path: same rank at every stage")
        acts, toks = checked_rows(self.ctx, tensors)
        losses = await self._batch(view, header.rank, header.batch, acts, toks)
        self._served.put_nowait(None)
        return EvalReply(tuple(losses)), []
