"""Checkpoints at round boundaries, and resuming a stopped swarm from them (`noloco join --resume`).

Every `peer.checkpoint_every` outer steps (and at the end of the run) a replica writes its full
state to `peer.checkpoint_dir` (see `checkpoint.py`). A peer started with `--resume` then either

  - finds the swarm still training past its checkpoint (a live peer answers with a later step):
    its state is stale, so it joins as a late joiner and downloads a live replica's state; or
  - finds the swarm stopped: it loads its newest checkpoint, says so to anyone who asks (its
    status reports the checkpoint's step), and waits until every member of the checkpoint's
    round answers. Members may hold different newest checkpoints (one crashed before writing its
    last): each goes back to the oldest step any member reports, which all still keep, so the
    swarm restarts from one boundary. Round R's view is the members of the round that ended
    there, so routes and groups continue as if the swarm had never stopped: the run's final
    weights equal those of the run that did not stop, bit for bit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from noloco_swarm.peer import checkpoint, events
from noloco_swarm.peer.checkpoint import Checkpoint
from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.liveness import ask_status_at
from noloco_swarm.peer.net.streams import PeerUnavailable, RemoteRefused
from noloco_swarm.protocol import codec, rpc
from noloco_swarm.protocol.membership import MembershipView

logger = logging.getLogger(__name__)
POLL = 0.5  # seconds between looks at the members while a stopped swarm comes back


class SwarmMovedOn(RuntimeError):
    """The swarm trains on past this peer's checkpoint: join it as a late joiner instead."""


class Resume:
    """This peer's checkpoints: writing them at boundaries, and resuming from them."""

    def __init__(self, ctx: PeerContext, config_hash: str, announce: Callable[[], Awaitable[bool]]) -> None:
        self.ctx, self.config_hash, self._announce = ctx, config_hash, announce
        opts = ctx.cfg.peer
        self.directory = Path(opts.checkpoint_dir) if opts.checkpoint_dir else None
        self.resuming = False  # between loading a checkpoint and its round's start (status says so)
        self.resumed_from: int | None = None  # the step the swarm restarted from (status says so)

    def latest(self, at_most: int | None = None) -> Checkpoint | None:
        if self.directory is None:
            return None
        ctx = self.ctx
        return checkpoint.load(self.directory, ctx.run_id, self.config_hash, ctx.stage, at_most=at_most)

    async def save(
        self, *, joined_round: int, outer_steps: int, tokens: int, final: bool, with_theta: bool = False
    ) -> None:
        """At a boundary (right after a blocking outer step; with overlap, before the exchange
        starts, `with_theta`): write a checkpoint if one is due."""
        ctx, opts = self.ctx, self.ctx.cfg.peer
        if self.directory is None or not ctx.clock.outer_step_due(ctx.step):
            return
        if not final and ctx.clock.round_of(ctx.step) % opts.checkpoint_every != 0:
            return
        parts, adam_step = await asyncio.to_thread(lambda: ctx.replica.state_parts(with_theta=with_theta))
        ckpt = Checkpoint(
            run_id=ctx.run_id,
            config_hash=self.config_hash,
            stage=ctx.stage,
            peer_id=ctx.me,
            step=ctx.step,
            round=ctx.clock.round_of(ctx.step),
            members=ctx.view_at(ctx.step - 1).stages,
            joined_round=joined_round,
            outer_steps=outer_steps,
            tokens=tokens,
            adam_step=adam_step,
            state_hash=ctx.replica.state_hash(),
            parts=parts,
        )
        path = await asyncio.to_thread(checkpoint.save, self.directory, ckpt, opts.checkpoint_keep)
        ctx.events.emit(events.Checkpointed(step=ctx.step, round=ckpt.round, path=str(path)))

    async def restore(self, ckpt: Checkpoint) -> Checkpoint:
        """Bring a stopped swarm back from `ckpt` together with the other members of its round.

        Returns the checkpoint resumed from (an older one if a member holds no newer one); the
        replica then holds its state and views of its round are set. Raises SwarmMovedOn if a
        live peer is already past it, RuntimeError if a member does not come back in time.
        """
        ctx = self.ctx
        if ckpt.peer_id != ctx.me:
            raise RuntimeError(
                f"the checkpoint in {self.directory} was written by peer {ckpt.peer_id}, this is "
                f"{ctx.me}: resume with the --identity it ran with"
            )
        self._load(ckpt)
        self.resuming = True
        await self._announce()  # with this run's new addresses: the others look for them
        try:
            return await self._meet(ckpt)
        finally:
            self.resuming = False

    async def _meet(self, ckpt: Checkpoint) -> Checkpoint:
        ctx = self.ctx
        others = sorted({p for s in ckpt.members for p in s} - {ctx.me})
        timeout = ctx.cfg.peer.start_timeout
        deadline = time.monotonic() + timeout
        while True:
            answers = await self._members(others)
            if any(a.resumed_from == ckpt.step and not a.resuming for a in answers.values()):
                break  # a member started from our step: it saw every member back at it
            training = [p for p, a in answers.items() if not a.resuming and a.step > ckpt.step]
            if training:
                raise SwarmMovedOn(f"members {training} train on past step {ckpt.step}")
            steps = {p: a.step for p, a in answers.items() if a.resuming}  # the others are not back yet
            low = min(steps.values(), default=ckpt.step)
            if low < ckpt.step:  # a member lacks our newest: all go back to its step
                older = self.latest(at_most=low)
                if older is None or older.step != low:
                    raise RuntimeError(
                        f"a member of round {ckpt.round} resumes from step {low}, and this peer keeps "
                        f"no checkpoint of that step in {self.directory}; raise peer.checkpoint_keep"
                    )
                ckpt = older
                self._load(ckpt)
                logger.warning("going back to the checkpoint of step %d, the newest all members hold", low)
            elif len(steps) == len(others) and all(s == ckpt.step for s in steps.values()):
                break
            if time.monotonic() > deadline:
                missing = [p for p in others if steps.get(p) != ckpt.step]
                raise RuntimeError(
                    f"members {missing} of round {ckpt.round} did not come back at step {ckpt.step} "
                    f"within {timeout:.0f} s: start them with --resume, or start the run anew"
                )
            await asyncio.sleep(POLL)
        self.resumed_from = ckpt.step
        ended = MembershipView(ckpt.round - 1, ckpt.members)
        ctx.rounds.set(ended)
        ctx.rounds.set(MembershipView(ckpt.round, ckpt.members))
        # The reports its members outlived before this round stay void after the restart, as they
        # were one at a time before it (every member resumes alike).
        ctx.rounds.evidence.judgement.adopt(MembershipView(ckpt.round, ckpt.members))
        ctx.events.emit(events.Resumed(step=ckpt.step, round=ckpt.round, state_hash=ckpt.state_hash))
        return ckpt

    def _load(self, ckpt: Checkpoint) -> None:
        ctx = self.ctx
        ctx.replica.load_state_parts(ckpt.parts, ckpt.adam_step)
        if ctx.replica.state_hash() != ckpt.state_hash:
            raise RuntimeError(f"checkpoint of step {ckpt.step} in {self.directory} fails its hash check")
        ctx.step = ckpt.step

    async def _members(self, others: list[str]) -> dict[str, rpc.PeerStatus]:
        """The answer of each member that answers (a resuming one reports its checkpoint's step)."""
        ctx = self.ctx
        addresses = {a.peer_id: a.addresses for a in await asyncio.to_thread(ctx.rounds.read_peers)}

        async def ask(peer: str) -> rpc.PeerStatus | None:
            try:
                return await ask_status_at(ctx.transport, peer, addresses.get(peer, ()), ctx.run_id)
            except (PeerUnavailable, RemoteRefused, codec.MessageError):
                return None

        async with asyncio.TaskGroup() as group:
            asked = {p: group.create_task(ask(p)) for p in others}
        return {p: a for p, task in asked.items() if (a := task.result()) is not None}
