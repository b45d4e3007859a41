"""The step plan: who sends what to whom at inner step t, and who averages with whom after it.

This is the one file that turns the draws (routing.py, gossip.py) and a round's replica counts
into what one replica does. The simulator and the peer both run it, so every rule a peer follows
is checked against the simulator's weights:

  inner step t   a row is batch position i of stage-0 replica o (`Row`). Replica `rank` of stage s
                 sends each row it holds to the replica of stage s+1 that the row's route names
                 (`StepPlan.sends`); a replica of stage s+1 expects the rows whose routes name it
                 (`StepPlan.expects`) and runs them as one batch in (position, origin) order, so
                 arrival order never changes the result. Gradients return on the same rows.
                 With M microbatches (`StepPlan.microbatches`), microbatch m is batch positions
                 [m B/M, (m+1) B/M) of every stage-0 replica, or the m-th run of consecutive
                 positions of the sizes `StepPlan.sizes` names: each replica runs, sends and
                 receives microbatch by microbatch (the same rules, restricted to those rows),
                 in ascending m, and backpropagates them in ascending m too.
                 Uneven replica counts use routing.route_uneven; with S > R senders a receiver
                 may hold two rows of one position (from different origins).
  routing around a replica that is gone (`StepPlan.around`): its rows go to its stand-in, the
                 next rank of its stage (cyclically) that is not routed around, which runs them
                 with its own in (position, origin) order and sends them on along the gone
                 replica's routes. A sender routes around the replicas it knows are gone, so it
                 loses only the rows it sent one before it found it dead. A stage-0 stand-in
                 reads the gone replica's rows from that replica's data shard: its batch
                 positions are the same, its origin stays the gone replica's rank.
  outer step     after inner step t = H, 2H, ... the replica averages with its group
                 (`outer_plan`): NoLoCo draws pairs, DiLoCo takes the whole stage and, with more
                 than two replicas, all-reduces in shards (`ShardLayout`). Within a group the lower
                 rank calls the higher one; both name the exchange by `exchange_key`. The plan
                 names the update to apply (`OuterPlan.update`); StageReplica.apply_outer applies it.
  the run        `RunPlan` holds a config's rules (the clock, the step plan of a round's replica
                 counts, the outer plan of a boundary); `RunConfig.run_plan()` builds it, and the
                 simulator and the peer both ask it.
  joining        a newcomer enters `JOIN_MARGIN_ROUNDS` rounds after the furthest step it hears of.
  evaluation     fixed paths: path q is replica q of every stage, for q below the smallest count.

Pure: no I/O, no clock; equal inputs give equal plans on every peer.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from noloco_swarm.protocol import gossip, routing
from noloco_swarm.protocol.clock import StepClock
from noloco_swarm.protocol.membership import JOIN_MARGIN_ROUNDS

# The outer updates (`OuterPlan.update`, protocol/outer.py): NoLoCo's step with the group, or
# DiLoCo's over the whole stage, heavy-ball (the NoLoCo paper's baseline) or Nesterov (the DiLoCo
# paper's). Methods without an outer step (allreduce, local) have none.
UPDATES = ("noloco", "heavyball", "nesterov")


@dataclass(frozen=True, order=True)
class Row:
    """One sample on its way through the pipeline: batch position i of stage-0 replica `origin`.

    Every replica runs its rows as one batch sorted by (position, origin), so arrival order never
    changes the result. (With equal replica counts a replica holds one row per position.)"""

    position: int
    origin: int


@dataclass(frozen=True)
class Incoming:
    """A row that replica r of stage s > 0 receives: from which rank of stage s-1."""

    row: Row
    sender: int


Flow = tuple[tuple[tuple[Incoming, ...], ...], ...]


def check_microbatch_sizes(sizes: Sequence[int], microbatches: int, batch_size: int) -> None:
    """Raise ValueError unless `sizes` cut a batch of `batch_size` into `microbatches` runs."""
    if len(sizes) != microbatches or min(sizes, default=0) < 1 or sum(sizes) != batch_size:
        raise ValueError(
            f"microbatch sizes {list(sizes)} must be {microbatches} sizes of at least 1 "
            f"that sum to the batch of {batch_size}"
        )


@functools.lru_cache(maxsize=1024)
def _flow(
    step: int, counts: tuple[int, ...], batch: int, random_routing: bool, around: frozenset[tuple[int, int]]
) -> Flow:
    """_base_flow with every replica routed around replaced by its stand-in: as holder of its rows
    and as their sender to the next stage."""
    base = _base_flow(step, counts, batch, random_routing)
    if not around:
        return base

    def stand_in(stage: int, rank: int) -> int:
        return _stand_in(counts, around, stage, rank)

    flow = []
    for stage in range(len(counts)):
        held: list[list[Incoming]] = [[] for _ in range(counts[stage])]
        for rank, rows in enumerate(base[stage]):
            holder = stand_in(stage, rank)
            for item in rows:
                # stage 0's rows come from the holder's own reading of the shard: it sends them
                sender = stand_in(stage - 1, item.sender) if stage else holder
                held[holder].append(Incoming(item.row, sender))
        flow.append(tuple(tuple(sorted(rows, key=lambda x: x.row)) for rows in held))
    return tuple(flow)


@functools.lru_cache(maxsize=1024)
def _holders(
    step: int, counts: tuple[int, ...], batch: int, random_routing: bool, around: frozenset[tuple[int, int]]
) -> tuple[dict[Row, int], ...]:
    """holders[s][row]: the rank of stage s that runs `row` at `step` (every row is held by
    exactly one replica of each stage). Read-only: it is cached."""
    return tuple(
        {x.row: rank for rank, rows in enumerate(stage) for x in rows}
        for stage in _flow(step, counts, batch, random_routing, around)
    )


def _stand_in(counts: tuple[int, ...], around: frozenset[tuple[int, int]], stage: int, rank: int) -> int:
    """Who holds the rows of replica `rank` of `stage`: itself, or (routed around) the next rank
    of the stage, cyclically, that is not; itself again if every replica of the stage is."""
    n = counts[stage]
    for k in range(n):
        candidate = (rank + k) % n
        if (stage, candidate) not in around:
            return candidate
    return rank


@functools.lru_cache(maxsize=1024)
def _base_flow(step: int, counts: tuple[int, ...], batch: int, random_routing: bool) -> Flow:
    """flow[s][r]: the rows replica r of stage s holds at `step`, in its batch order, with the
    rank of stage s-1 each came from (stage 0: its own rows, sender = itself)."""
    flow = [tuple(tuple(Incoming(Row(i, d), d) for i in range(batch)) for d in range(counts[0]))]
    for hop in range(len(counts) - 1):
        senders, receivers = counts[hop], counts[hop + 1]
        held: list[list[Incoming]] = [[] for _ in range(receivers)]
        for d, rows in enumerate(flow[-1]):
            for item in rows:
                i = item.row.position
                if random_routing:
                    k = routing.sample_index(step, i, batch)
                    r = routing.route_uneven(k, hop, len(counts), senders, receivers)[d]
                else:  # fixed chains (the routing ablation): replica d feeds replica d
                    r = d % receivers
                held[r].append(Incoming(item.row, d))
        flow.append(tuple(tuple(sorted(rows, key=lambda x: x.row)) for rows in held))
    return tuple(flow)


@dataclass(frozen=True)
class StepPlan:
    """The inner-step rules of one round: its replica counts per stage and the per-replica batch."""

    counts: tuple[int, ...]
    """Replicas of every stage this round (ranks are 0..count-1: sorted peer ids on a swarm)."""
    batch_size: int
    """B: rows every stage-0 replica feeds into the pipeline per inner step."""
    random_routing: bool = True
    """Per-sample random routes (the paper); False: replica d of every stage feeds replica d."""
    microbatches: int = 1
    """M: microbatches per inner step: B/M consecutive batch positions each (M divides B), unless
    `sizes` cuts them otherwise."""
    sizes: tuple[int, ...] = ()
    """The M microbatches' sizes in batch order, summing to B (consecutive positions each);
    empty: B/M each."""
    around: frozenset[tuple[int, int]] = frozenset()
    """(stage, rank) of replicas that are routed around (gone): their stand-ins hold their rows
    (on stage 0: read them from the gone replica's shard). Empty on a healthy swarm and in the
    simulator."""

    def __post_init__(self) -> None:
        if not self.counts or min(self.counts) < 1:
            raise ValueError(f"every stage needs at least one replica, got counts {list(self.counts)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.sizes:
            check_microbatch_sizes(self.sizes, self.microbatches, self.batch_size)
        elif self.microbatches < 1 or self.batch_size % self.microbatches:
            raise ValueError(f"{self.microbatches} microbatches do not divide a batch of {self.batch_size}")
        for stage, rank in self.around:
            if not 0 <= stage < len(self.counts) or not 0 <= rank < self.counts[stage]:
                raise ValueError(
                    f"cannot route around replica {rank} of stage {stage} with counts {list(self.counts)}"
                )

    @classmethod
    def of(
        cls,
        counts: Sequence[int],
        batch_size: int,
        random_routing: bool = True,
        microbatches: int = 1,
        around: Iterable[tuple[int, int]] = (),
        sizes: Sequence[int] = (),
    ) -> StepPlan:
        return cls(tuple(counts), batch_size, random_routing, microbatches, tuple(sizes), frozenset(around))

    def routing_around(self, around: Iterable[tuple[int, int]]) -> StepPlan:
        """This plan, with `around` routed around too."""
        return dataclasses.replace(self, around=self.around | frozenset(around))

    def stand_in(self, stage: int, rank: int) -> int:
        """The replica of `stage` that holds `rank`'s rows (`rank` itself unless routed around)."""
        self._check_rank(stage, rank)
        return _stand_in(self.counts, self.around, stage, rank)

    def stands_in_for(self, step: int, stage: int, rank: int, rows: Iterable[Row]) -> tuple[int, ...]:
        """The ranks of `stage`, other than `rank`, whose rows are among `rows` (rows held by
        `rank`): whom it stands in for, ascending. Said in its forward headers, so that the next
        stage can place the rows."""
        base = dataclasses.replace(self, around=frozenset())
        return tuple(sorted({base.holder(step, stage, row) for row in rows} - {rank}))

    def holder(self, step: int, stage: int, row: Row) -> int:
        """The rank of `stage` that runs `row` at `step`."""
        holders = _holders(step, self.counts, self.batch_size, self.random_routing, self.around)[stage]
        if row not in holders:
            raise ValueError(f"no replica of stage {stage} runs row {row} at step {step}")
        return holders[row]

    def route(self, step: int, stage: int, rows: Sequence[Row]) -> dict[int, list[int]]:
        """Receiver rank (of stage+1) -> indices into `rows` (rows a replica of `stage` holds, in
        its batch order), ascending, of the rows it sends there."""
        if not 0 <= stage < self.num_stages - 1:
            raise ValueError(f"stage {stage} of {self.num_stages} sends nothing on")
        where = _holders(step, self.counts, self.batch_size, self.random_routing, self.around)[stage + 1]
        out: dict[int, list[int]] = {}
        for j, row in enumerate(rows):
            out.setdefault(where[row], []).append(j)
        return dict(sorted(out.items()))

    def microbatch_of(self, position: int) -> int:
        """The microbatch that batch position `position` belongs to."""
        if not 0 <= position < self.batch_size:
            raise ValueError(f"no batch position {position} in a batch of {self.batch_size}")
        return bisect.bisect_right(self._starts, position) - 1

    def span(self, microbatch: int) -> range:
        """The batch positions of `microbatch`."""
        if not 0 <= microbatch < self.microbatches:
            raise ValueError(f"no microbatch {microbatch} of {self.microbatches}")
        starts = self._starts
        stop = starts[microbatch + 1] if microbatch + 1 < len(starts) else self.batch_size
        return range(starts[microbatch], stop)

    @functools.cached_property
    def _starts(self) -> tuple[int, ...]:
        sizes = self.sizes or (self.batch_size // self.microbatches,) * self.microbatches
        return tuple(itertools.accumulate(sizes[:-1], initial=0))

    @property
    def num_stages(self) -> int:
        return len(self.counts)

    def rows(self, step: int, stage: int, rank: int, microbatch: int | None = None) -> tuple[Incoming, ...]:
        """The rows replica `rank` of `stage` runs at `step` (in `microbatch` only, if given), in
        batch order, with their senders."""
        self._check_rank(stage, rank)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rows = _flow(step, self.counts, self.batch_size, self.random_routing, self.around)[stage][rank]
        if microbatch is None:
            return rows
        if not 0 <= microbatch < self.microbatches:
            raise ValueError(f"no microbatch {microbatch} of {self.microbatches}")
        return tuple(x for x in rows if self.microbatch_of(x.row.position) == microbatch)

    def expects(
        self, step: int, stage: int, rank: int, microbatch: int | None = None
    ) -> tuple[Incoming, ...]:
        """What replica `rank` of `stage` > 0 receives at `step` (in `microbatch`), in the order it
        runs the rows."""
        if stage == 0:
            raise ValueError("stage 0 reads its rows from its data shard; it expects none")
        return self.rows(step, stage, rank, microbatch)

    def expects_from(
        self, step: int, stage: int, rank: int, sender: int, microbatch: int | None = None
    ) -> list[Row]:
        """The rows `sender` (a rank of stage-1) sends replica `rank` of `stage`, in sending order."""
        return [x.row for x in self.expects(step, stage, rank, microbatch) if x.sender == sender]

    def sends(self, step: int, stage: int, rank: int, microbatch: int | None = None) -> dict[int, list[int]]:
        """Receiver rank (of stage+1) -> indices into `rows(step, stage, rank, microbatch)`,
        ascending, of the rows replica `rank` of `stage` sends it (gradients come back for the
        same rows)."""
        if not 0 <= stage < self.num_stages - 1:
            raise ValueError(f"stage {stage} of {self.num_stages} sends nothing on")
        return self.route(step, stage, [x.row for x in self.rows(step, stage, rank, microbatch)])

    def _check_rank(self, stage: int, rank: int) -> None:
        if not 0 <= stage < self.num_stages or not 0 <= rank < self.counts[stage]:
            raise ValueError(f"no replica {rank} of stage {stage} with counts {list(self.counts)}")


@dataclass(frozen=True)
class OuterPlan:
    """What replica `rank` of a stage with `num_replicas` replicas does after inner step `step`."""

    step: int
    rank: int
    group: tuple[int, ...]
    """The ranks that average together, this one included, ascending (the order means are reduced in)."""
    sharded: bool
    """All-reduce in shards (reduce-scatter, then all-gather) instead of whole-vector swaps."""
    update: str
    """The outer update to apply with the group's tensors: one of `UPDATES`."""

    @property
    def partners(self) -> tuple[int, ...]:
        return tuple(m for m in self.group if m != self.rank)

    def calls(self, partner: int) -> bool:
        """True if this replica opens the exchange with `partner` (the lower rank calls)."""
        return self.rank < partner


def outer_update(method: str, diloco_variant: str = "heavyball") -> str | None:
    """The update (one of `UPDATES`) that `method`'s outer step applies; None for methods without
    an outer step (allreduce averages gradients every step, local never averages)."""
    if method == "noloco":
        return "noloco"
    if method == "diloco":
        if diloco_variant not in UPDATES[1:]:
            raise ValueError(f"unknown DiLoCo variant {diloco_variant!r}; use heavyball or nesterov")
        return diloco_variant
    return None


def outer_plan(
    method: str,
    group_size: int,
    num_replicas: int,
    step: int,
    rank: int,
    draw_seed: int | None = None,
    diloco_variant: str = "heavyball",
) -> OuterPlan | None:
    """The outer step after inner step `step` (a multiple of H); None for methods without one.

    `draw_seed` (NoLoCo): None draws groups from the step alone, as the official code does; the
    run seed when `outer.seeded_groups` is on (`RunConfig.group_draw_seed`).
    """
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
    update = outer_update(method, diloco_variant)
    if update == "noloco":
        group = tuple(sorted(gossip.group_of(num_replicas, step, group_size, rank, draw_seed)))
        return OuterPlan(step, rank, group, sharded=False, update=update)
    if update is not None:
        return OuterPlan(step, rank, tuple(range(num_replicas)), sharded=num_replicas > 2, update=update)
    return None


@dataclass(frozen=True)
class RunPlan:
    """A run's rules, read once from its config (`RunConfig.run_plan()`): its clock, the step plan
    of a round's replica counts, and the outer plan of a boundary. The simulator and the peer both
    ask it, so neither chooses a route, a group or an update by method itself."""

    clock: StepClock
    """H, B and the run's length."""
    random_routing: bool = True
    microbatches: int = 1
    sizes: tuple[int, ...] = ()
    """As in StepPlan."""
    method: str = "noloco"
    group_size: int = 2
    draw_seed: int | None = None
    diloco_variant: str = "heavyball"
    """As in outer_plan."""

    def __post_init__(self) -> None:
        outer_update(self.method, self.diloco_variant)  # an unknown variant fails here, not later

    @property
    def update(self) -> str | None:
        """The update every outer step of the run applies; None: the method has no outer step."""
        return outer_update(self.method, self.diloco_variant)

    @property
    def allreduces_gradients(self) -> bool:
        """Gradients are averaged over the stage's replicas after every inner step (allreduce)."""
        return self.method == "allreduce"

    def outer_step_due(self, steps_taken: int) -> bool:
        """True when an outer step follows inner step `steps_taken` (never without one)."""
        return self.update is not None and self.clock.outer_step_due(steps_taken)

    def step_plan(self, counts: Sequence[int], around: Iterable[tuple[int, int]] = ()) -> StepPlan:
        """The inner-step plan of a round with `counts` replicas per stage."""
        return StepPlan.of(
            counts, self.clock.batch_size, self.random_routing, self.microbatches, around, self.sizes
        )

    def outer_plan(self, step: int, rank: int, num_replicas: int) -> OuterPlan | None:
        """What replica `rank` of a stage of `num_replicas` does after inner step `step`."""
        return outer_plan(
            self.method, self.group_size, num_replicas, step, rank, self.draw_seed, self.diloco_variant
        )


def exchange_key(round_: int, step: int, phase: int = 0) -> tuple[int, ...]:
    """The name both sides give one exchange: phase 0 is a whole-vector swap, phases 1 and 2 the
    reduce-scatter and all-gather of a sharded all-reduce."""
    return (round_, step) if phase == 0 else (round_, step, phase)


@dataclass(frozen=True)
class ShardLayout:
    """A flat vector of `numel` values cut into `parts` equal shards (the last one zero-padded)."""

    numel: int
    parts: int

    @property
    def size(self) -> int:
        return -(-self.numel // self.parts)

    @property
    def padded(self) -> int:
        return self.size * self.parts


def join_round(furthest_step: int, inner_steps: int) -> int:
    """The round a newcomer enters at, given the furthest inner step any live peer reports."""
    return furthest_step // inner_steps + JOIN_MARGIN_ROUNDS


def eval_paths(counts: Sequence[int]) -> int:
    """Fixed evaluation paths: path q is replica q of every stage, for q below the smallest count."""
    return min(counts)
