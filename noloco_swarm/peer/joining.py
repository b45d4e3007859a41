"""Joining a running swarm: which round to enter at, and a stage's state at that round's start.

A newcomer asks the live peers where they are (rpc_status), announces the round two after the
furthest step it hears of (so every member reads the announcement before that boundary), and
downloads its stage's state at that boundary from a live replica of the stage. The replica keeps
a snapshot taken right after the outer step that closed the previous round (theta == phi then)
and serves it one part per request (phi, delta, the AdamW moments), so no reply is bigger than
one stage's weights. The newcomer checks the parts against the announced weights hash, and
adopts the server's view of the round, which admits it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from noloco_swarm.peer.rounds import ask_status
from noloco_swarm.peer.transport import Transport
from noloco_swarm.protocol import messages
from noloco_swarm.protocol.clock import StepClock
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.protocol.messages import STATE_PARTS, MessageError, StateReply, TensorMeta
from noloco_swarm.train.replica import StageReplica

JOIN_MARGIN_ROUNDS = 2
STATUS_TIMEOUT = 10.0


@dataclass
class Snapshot:
    """A replica's state at the start of a round, kept for the peers that join at that round."""

    view: MembershipView
    step: int
    adam_step: int
    state_hash: str
    parts: dict[str, torch.Tensor]

    @classmethod
    def take(cls, replica: StageReplica, view: MembershipView, step: int) -> Snapshot:
        parts, adam_step = replica.state_parts()
        return cls(view, step, adam_step, replica.state_hash(), parts)

    def reply(self, run_id: str, stage: int, part: str) -> tuple[StateReply, torch.Tensor]:
        tensor = self.parts[part]
        header = StateReply(
            run_id=run_id,
            stage=stage,
            round=self.view.round,
            step=self.step,
            view=self.view.stages,
            adam_step=self.adam_step,
            state_hash=self.state_hash,
            part=part,
            meta=TensorMeta.of(tensor),
        )
        return header, tensor


async def pick_join_round(
    transport: Transport,
    run_id: str,
    others: list[messages.PeerAnnouncement],
    clock: StepClock,
    end_step: int,
) -> int:
    """The round to join at: two after the furthest step any live peer reports (asked directly,
    since the announcements' step is only as fresh as the last heartbeat)."""

    answers = await asyncio.gather(
        *(ask_status(transport, a.peer_id, run_id, STATUS_TIMEOUT) for a in others), return_exceptions=True
    )
    steps = [a.step for a in others] + [x.step for x in answers if isinstance(x, messages.PeerStatus)]
    target = clock.round_of(max(steps, default=0)) + JOIN_MARGIN_ROUNDS
    if clock.round_start(target) >= end_step:
        raise RuntimeError(
            f"the run ends at step {end_step}, before round {target} (step {clock.round_start(target)}) "
            "where this peer could join"
        )
    return target


async def fetch_state(
    transport: Transport,
    server: str,
    run_id: str,
    round_: int,
    replica: StageReplica,
    *,
    me: str,
    timeout: float,
) -> tuple[MembershipView, int]:
    """Download `replica`'s stage state at the start of `round_` from `server` and load it.

    Returns the server's view of the round (it admits us) and the step the round starts at.
    Raises MessageError (nothing is loaded) if the server sends anything inconsistent.
    """
    stage, n = replica.stage, replica.phi.numel()
    parts: dict[str, torch.Tensor] = {}
    first: StateReply | None = None
    for part in STATE_PARTS:
        request = messages.StateRequest(run_id, stage, round_, part)
        reply, tensors = await transport.call(server, "rpc_fetch_state", request, timeout=timeout)
        if not isinstance(reply, StateReply) or reply.part != part or len(tensors) != 1:
            raise MessageError(f"{server} answered the state request for {part} with something else")
        if reply.stage != stage or reply.round != round_ or reply.meta.shape != (n,):
            raise MessageError(
                f"{server} sent state for stage {reply.stage} round {reply.round}, {reply.meta}"
            )
        if first is not None and (reply.view, reply.state_hash, reply.adam_step, reply.step) != (
            first.view,
            first.state_hash,
            first.adam_step,
            first.step,
        ):
            raise MessageError(f"{server} changed its snapshot between parts")
        first = first or reply
        parts[part] = tensors[0]
    assert first is not None
    view = MembershipView(round=round_, stages=first.view)  # validates the ids' order
    if len(view.stages) != replica.cfg.num_stages or me not in view.stages[stage]:
        raise MessageError(f"{server}'s view of round {round_} does not admit this peer")
    backup = replica.state_parts()
    await asyncio.to_thread(replica.load_state_parts, parts, first.adam_step)
    if replica.state_hash() != first.state_hash:
        replica.load_state_parts(*backup)
        raise MessageError(f"the state from {server} does not hash to what it announced")
    return view, first.step


def servers_for(others: list[messages.PeerAnnouncement], stage: int, round_: int) -> list[str]:
    """Peers of `stage` that were members before `round_` (they hold its state)."""
    return [a.peer_id for a in others if a.stage == stage and a.joined_round < round_]


def check_request(header: messages.Message, run_id: str, stage: int) -> messages.StateRequest:
    if not isinstance(header, messages.StateRequest):
        raise MessageError("expected a state request")
    if header.run_id != run_id or header.stage != stage:
        raise MessageError(
            f"this is stage {stage} of {run_id!r}, not stage {header.stage} of {header.run_id!r}"
        )
    return header
