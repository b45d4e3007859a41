"""What every room of a peer shares: its config, stage, replica, views, transport and events.

The rooms (inner steps, the outer exchange, joining, evaluation) each own their own state; this
is the part they all read, and `step`, which only the run loop (and a join) advances.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from noloco_swarm.peer.deadlines import Deadlines
from noloco_swarm.peer.events import Events
from noloco_swarm.peer.net.transport import Transport
from noloco_swarm.peer.views import Rounds
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.protocol.plan import StepPlan
from noloco_swarm.train.config import RunConfig
from noloco_swarm.train.replica import StageReplica, boundary_of


@dataclass
class PeerContext:
    cfg: RunConfig
    stage: int
    transport: Transport
    rounds: Rounds
    replica: StageReplica
    events: Events
    step: int = 0
    """Inner steps this replica has completed."""

    def __post_init__(self) -> None:
        self.run_plan = self.cfg.run_plan()  # the same rules the simulator reads (protocol.plan.RunPlan)
        self.clock = self.run_plan.clock
        self.deadlines = Deadlines(self.cfg.peer)
        self.events.sinks.append(self.deadlines)  # it leaves out steps in which a peer failed us
        self.boundary = boundary_of(self.cfg)  # the wire format of rows (U and F under subspace)

    @property
    def me(self) -> str:
        return self.transport.peer_id

    @property
    def run_id(self) -> str:
        return self.cfg.peer.run_id

    @property
    def B(self) -> int:  # noqa: N802 - the paper's name
        return self.cfg.inner.batch_size

    @property
    def P(self) -> int:  # noqa: N802 - the paper's name
        return self.cfg.num_stages

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.P - 1

    @property
    def device(self) -> torch.device:
        return self.replica.device

    def view_at(self, t: int) -> MembershipView:
        """The frozen view of inner step t's round."""
        return self.rounds.at(self.clock.round_of(t))

    def rank_at(self, t: int) -> int:
        return self.view_at(t).rank_of(self.me)[1]

    def plan_at(self, t: int) -> StepPlan:
        """The step plan of inner step t's round (its replica counts)."""
        return self.run_plan.step_plan(self.view_at(t).replica_counts())
