"""A wall-clock model of the swarm's schedule: a discrete-event simulation in seconds, no clock read.

What it models (issue 11), for P stages x D replicas, one peer per replica with one GPU and one
link:

- **Compute.** Each peer runs one task at a time: the forward of a microbatch, or its backward
  (the last stage runs both at once, since the loss is there). Cost is linear in rows:
  `StageCost.forward_s` per sample, backward likewise. Among ready tasks a peer takes the earliest
  step first, then backwards before forwards (1F1B-like), then the lowest microbatch. With
  `Swarm.colocated`, replica d's stages run on one processor, shared equally while both compute
  (the testbed on a CPU; bench/plan_validation.py).
- **Inner step.** The batch of B samples is cut into M microbatches (B/M rows each, or the sizes
  `Schedule.microbatch_sizes` names). Stage s forwards microbatch m
  once the rows of m from every replica of stage s-1 are in (routes are per sample and random, so
  the model spreads each microbatch evenly over the D receivers: B/(M*D) rows per pair, a fluid
  mean of the plan's permutations). Gradients come back on the same pairs. The optimizer steps
  once all M backwards are done (a flush), and the next step's forwards wait for it. M = 1 is
  today's schedule: one batch in flight and a full round trip per hop per step.
- **Wire.** Activations carry `seq x hidden` elements per row at 4/2/1 bytes (fp32/bf16/int8),
  int8 adds one fp32 scale per token row, and the forward also carries the row's int64 token ids
  (the last stage needs them); gradients cross in the same format, without token ids. The
  subspace format at rank k (`model.subspace_rank`) sends k bf16 coefficients and one int32 token
  id per token, each way: 2k + 4 bytes against 2 x hidden for bf16.
- **The stack's round trips.** Besides a message's own one-way latency, the transport may wait
  on the other side before a pipeline message is through (a request's acknowledgement, a flow
  control window, TCP's slow start after an idle gap): `Swarm.hop_rtts` round trips are added to
  every activation and gradient message. 0 is the bare link; the testbed's M = 1 runs at RTT 50 ms
  took about 4 more per message than the model (docs/results/wallclock_validation.json, an older
  transport), which a pipeline kept busy with microbatches should largely avoid.
- **Links.** Every peer has one uplink and one downlink (full duplex) of its `Link`'s rate; a
  transfer from a to b uses a's uplink and b's downlink, and concurrent transfers share links
  max-min fairly (as long-lived TCP flows roughly do); messages between one pair go out in order
  (one connection), so microbatch m+1 follows m. A message is delivered when its last byte
  has been serialised plus a one-way latency of (rtt_a + rtt_b) / 4, so two peers of one profile
  see its RTT. Not modelled: TCP slow start and window limits (a window below rate x RTT would cap
  a flow) beyond `hop_rtts`, loss, jitter, protocol CPU costs, framing beyond `Link.efficiency`.
- **Outer exchange**, every H steps, of the stage's fp32 parameters: NoLoCo sends the whole stage
  to each partner of its gossip group (a pairwise swap, both ways at once); DiLoCo all-reduces in
  shards (reduce-scatter then all-gather, 2(D-1)/D of the stage each way). With
  `overlap_steps = k` training goes on for k steps and waits only before step boundary + k + 1 for
  the exchange to end; k = 0 blocks at the boundary as in the paper. The exchange's bytes share
  the links with the pipeline's. The outer update's own compute is not modelled (it is a few
  element-wise passes over the stage). A pair swap both ways at once gets less of the link than
  one flow: `Swarm.exchange_goodput` is the share of the link rate its payload gets (measured:
  `EXCHANGE_GOODPUT`); unset, it gets the link's `efficiency` like any flow.
- **Symmetry.** When every peer has the same link and the exchange's groups are all alike, the D
  replicas of a stage do the same things at the same times, so the model plays one replica per
  stage whose flows stand for D (flows.py's weights): the same times, D^2 times fewer flows.

`simulate` reports one outer period in steady state: H steps and the exchange; it plays out only
the steps the exchange can touch and counts the others at a steady step's time (every step ends
with a flush, so they are all alike), which a test checks against playing out whole periods.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from noloco_swarm.protocol.gossip import make_groups
from noloco_swarm.protocol.plan import check_microbatch_sizes
from noloco_swarm.sim.flows import Graph, Task

Wire = Literal["fp32", "bf16", "int8", "subspace"]
Exchange = Literal["noloco", "diloco"]
WIRE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "int8": 1, "subspace": 2}  # per element
INT8_SCALE_BYTES = 4  # one fp32 scale per token row of `hidden` elements
TOKEN_ID_BYTES = 8  # int64 token ids travel forward with each row
SUBSPACE_TOKEN_ID_BYTES = 4  # the subspace format's int32 token id, each way, instead
PARAM_BYTES = 4  # outer-step tensors cross in fp32, uncompressed (DESIGN.md section 3)
TCP_EFFICIENCY = 1448 / 1514  # TCP payload per Ethernet frame at MTU 1500 (docs/benchmarks.md)
# The outer exchange's payload rate over the link's rate: a pair swap both ways at once, p2pd over
# TCP, 16 runs each (N = 2 and 4, 25 and 100 Mbit/s): the median of floor / ready, uncapped 0.722
# (ready / floor 1.056-1.731) and with `peer.exchange_max_mbit` at 93% of the link 0.920
# (1.077-1.098). docs/results/outer_sync_cap.json, docs/benchmarks.md "The outer step alone".
EXCHANGE_GOODPUT: dict[str, float] = {"uncapped": 0.722, "capped": 0.920}
EXCHANGE_CAP = 0.93  # the cap those runs used, as a share of the link's rate


@dataclass(frozen=True)
class Link:
    """One peer's access link: rates each way and its round-trip time to the others."""

    up_mbit: float
    """Uplink rate in Mbit/s; math.inf for an unshaped link."""
    down_mbit: float
    """Downlink rate in Mbit/s; math.inf for an unshaped link."""
    rtt_s: float = 0.0
    """Round-trip time in seconds between two peers that both have this link."""
    efficiency: float = 1.0
    """Share of the rate that carries payload (TCP_EFFICIENCY for TCP over Ethernet)."""

    def __post_init__(self) -> None:
        if not (self.up_mbit > 0 and self.down_mbit > 0):
            raise ValueError(f"link rates must be > 0 Mbit/s, got {self.up_mbit} / {self.down_mbit}")
        if self.rtt_s < 0 or not 0 < self.efficiency <= 1:
            raise ValueError(f"need rtt_s >= 0 and 0 < efficiency <= 1, got {self.rtt_s}, {self.efficiency}")

    @classmethod
    def symmetric(cls, mbit: float, rtt_s: float = 0.0, efficiency: float = 1.0) -> Link:
        return cls(mbit, mbit, rtt_s, efficiency)

    def bytes_per_s(self, up: bool) -> float:
        return (self.up_mbit if up else self.down_mbit) * 1e6 / 8 * self.efficiency


@dataclass(frozen=True)
class StageCost:
    """What one replica of a stage costs: compute per sample and the parameters it exchanges."""

    forward_s: float
    """Seconds of forward compute per sample (one row of seq_len tokens)."""
    backward_s: float
    """Seconds of backward compute per sample (about 2x the forward)."""
    params: int
    """Parameters of the stage, exchanged in fp32 at every outer step."""
    optimizer_s: float = 0.0
    """Seconds of the optimizer step after the flush."""


@dataclass(frozen=True)
class Schedule:
    """How the swarm runs its steps: microbatches in flight, wire format, outer exchange."""

    microbatches: int = 1
    """M: microbatches per inner step (1: today's schedule, one batch in flight)."""
    wire: Wire = "fp32"
    """Format of activations and gradients on the wire."""
    overlap_steps: int = 0
    """k: inner steps the outer exchange overlaps (0: training waits for it at the boundary)."""
    exchange: Exchange = "noloco"
    """NoLoCo's exchange within gossip groups, or DiLoCo's sharded all-reduce over all D."""
    group_size: int = 2
    """NoLoCo's group size n."""
    microbatch_sizes: tuple[int, ...] = ()
    """The M microbatches' rows in batch order (summing to the batch); empty: B/M each."""
    rank: int = 0
    """k of the subspace format (coefficients per token); 0 for the other formats."""

    def __post_init__(self) -> None:
        if self.microbatches < 1 or self.overlap_steps < 0 or self.group_size < 1:
            raise ValueError("need microbatches >= 1, overlap_steps >= 0 and group_size >= 1")
        if (self.wire == "subspace") != (self.rank > 0) or self.rank < 0:
            raise ValueError(
                f"the subspace format needs a rank >= 1, and only it: got {self.wire!r}, {self.rank}"
            )
        if self.microbatch_sizes and (
            len(self.microbatch_sizes) != self.microbatches or min(self.microbatch_sizes) < 1
        ):
            raise ValueError(f"need {self.microbatches} microbatch sizes of at least 1")
        if self.wire not in WIRE_BYTES or self.exchange not in ("noloco", "diloco"):
            raise ValueError(f"unknown wire {self.wire!r} or exchange {self.exchange!r}")


@dataclass(frozen=True)
class Swarm:
    """The swarm's shape: stages, replicas, batch, model width, outer period and links."""

    stages: tuple[StageCost, ...]
    replicas: int
    """D: replicas of every stage."""
    batch: int
    """B: samples per replica per inner step."""
    seq_len: int
    hidden: int
    inner_steps: int
    """H: inner steps per outer step."""
    link: Link
    """Every peer's link, unless `links` names another for it."""
    links: tuple[tuple[int, int, Link], ...] = ()
    """(stage, replica, link) for peers whose link differs, e.g. one slow peer."""
    hop_rtts: float = 0.0
    """Round trips the transport adds to every activation and gradient message (0: the bare link)."""
    exchange_goodput: float | None = None
    """Share of a link's rate the outer exchange's payload gets (EXCHANGE_GOODPUT has measured
    ones); None: the link's `efficiency`, as every other flow."""
    colocated: bool = False
    """Replica d's stages share one processor (the testbed on a CPU: `cpu_share` pins the 2x2
    swarm's stage-0 and stage-1 peers of replica d to CPU d); False: every peer has its own GPU."""

    def __post_init__(self) -> None:
        if not self.stages or self.replicas < 1 or self.batch < 1 or self.inner_steps < 1:
            raise ValueError("need at least one stage, replica, sample and inner step")
        if self.hop_rtts < 0 or not (self.exchange_goodput is None or 0 < self.exchange_goodput <= 1):
            raise ValueError(
                f"need hop_rtts >= 0 and 0 < exchange_goodput <= 1, got {self.hop_rtts}, {self.exchange_goodput}"
            )

    def link_of(self, stage: int, replica: int) -> Link:
        for s, d, link in self.links:
            if (s, d) == (stage, replica):
                return link
        return self.link

    def exchange_scale(self, link: Link) -> float:
        """Bytes the model moves at `link`'s payload rate per byte of the exchange, so that the
        exchange alone on the link takes bytes / (rate x exchange_goodput)."""
        return 1.0 if self.exchange_goodput is None else link.efficiency / self.exchange_goodput

    @property
    def tokens_per_step(self) -> int:
        """Tokens fed into the pipeline per inner step by all stage-0 replicas."""
        return self.replicas * self.batch * self.seq_len


@dataclass(frozen=True)
class Timing:
    """What `simulate` found for one outer period in steady state (H steps, one exchange)."""

    period_s: float
    """Seconds for H inner steps and one outer exchange, in steady state."""
    step_s: float
    """Seconds per inner step away from the exchange."""
    exchange_s: float
    """Seconds from the exchange's start to its end on the slowest replica (overlap included)."""
    tokens_per_s: float
    utilisation: float
    """tokens_per_s over the compute-bound rate (the busiest stage computing all the time)."""
    busy: tuple[float, ...] = field(default=())
    """Per stage, the share of the period each of its replicas spends computing."""


def wire_bytes(rows: float, seq_len: int, hidden: int, wire: Wire, token_ids: bool, rank: int = 0) -> float:
    """Bytes of `rows` samples' activations (token_ids=True) or gradients on the wire; `rank` is
    the subspace format's k (its int32 token id crosses both ways)."""
    if wire == "subspace":
        if not 1 <= rank <= hidden:
            raise ValueError(f"the subspace rank must be in 1..{hidden} (the hidden size), got {rank}")
        return rows * seq_len * (rank * WIRE_BYTES[wire] + SUBSPACE_TOKEN_ID_BYTES)
    per_token = hidden * WIRE_BYTES[wire] + (INT8_SCALE_BYTES if wire == "int8" else 0)
    return rows * seq_len * (per_token + (TOKEN_ID_BYTES if token_ids else 0))


def step_bytes(swarm: Swarm, schedule: Schedule, stage: int) -> tuple[float, float]:
    """(up, down): bytes one replica of `stage` sends and receives per inner step, its share of
    the outer exchange (1/H of it) included."""
    P, B = len(swarm.stages), swarm.batch
    act = wire_bytes(B, swarm.seq_len, swarm.hidden, schedule.wire, True, schedule.rank)
    grad = wire_bytes(B, swarm.seq_len, swarm.hidden, schedule.wire, False, schedule.rank)
    outer = exchange_bytes(swarm.stages[stage].params, schedule, swarm.replicas) / swarm.inner_steps
    up = (act if stage < P - 1 else 0.0) + (grad if stage > 0 else 0.0) + outer
    down = (act if stage > 0 else 0.0) + (grad if stage < P - 1 else 0.0) + outer
    return up, down


def exchange_bytes(params: int, schedule: Schedule, replicas: int) -> float:
    """Bytes one replica sends (and receives) per outer step."""
    stage = params * PARAM_BYTES
    if schedule.exchange == "diloco":
        return 2 * (replicas - 1) / replicas * stage
    group = max(len(g) for g in make_groups(replicas, 0, schedule.group_size))
    return (group - 1) * stage


def compute_bound_tokens_per_s(swarm: Swarm) -> float:
    """The rate when the busiest stage (colocated: every processor) computes all the time (no
    network, no pipeline bubble)."""
    per_sample = [s.forward_s + s.backward_s + s.optimizer_s / swarm.batch for s in swarm.stages]
    slowest = sum(per_sample) if swarm.colocated else max(per_sample)
    return swarm.tokens_per_step / (swarm.batch * slowest) if slowest > 0 else math.inf


def resource_bound_s(swarm: Swarm, schedule: Schedule) -> float:
    """A floor on seconds per inner step: the busiest GPU, uplink or downlink of any peer.

    Per step a peer computes its stage's B samples, sends activations on and gradients back,
    receives the same, and carries 1/H of its outer exchange each way. No schedule beats this;
    a deep enough pipeline with overlap approaches it.
    """
    B = swarm.batch
    floor = 0.0
    for s, cost in enumerate(swarm.stages):
        outer = exchange_bytes(cost.params, schedule, swarm.replicas) / swarm.inner_steps
        up, down = step_bytes(swarm, schedule, s)
        for d in range(swarm.replicas):
            link = swarm.link_of(s, d)
            extra = outer * (swarm.exchange_scale(link) - 1.0)  # the exchange's lower goodput
            compute = B * (cost.forward_s + cost.backward_s) + cost.optimizer_s
            sent, got = (up + extra) / link.bytes_per_s(up=True), (down + extra) / link.bytes_per_s(up=False)
            floor = max(floor, compute, sent, got)
    if swarm.colocated:  # one processor runs every stage's compute
        floor = max(floor, sum(B * (c.forward_s + c.backward_s) + c.optimizer_s for c in swarm.stages))
    return floor


# ---------------------------------------------------------------------- the swarm's schedule


def symmetric(swarm: Swarm, schedule: Schedule) -> bool:
    """Whether the D replicas of every stage do the same things at the same times: every peer has
    the same link and every exchange group has the same size (DiLoCo's all-reduce: always)."""
    D, n = swarm.replicas, schedule.group_size
    return not swarm.links and (schedule.exchange == "diloco" or D % n == 0 or n > D)


def simulate(swarm: Swarm, schedule: Schedule, exact: bool = False, fold: bool | None = None) -> Timing:
    """Time one outer period in steady state: H inner steps and one outer exchange.

    Every inner step ends with a flush, so steps away from the exchange all take the same time.
    The model plays out steps 1..w (w = 3) with the exchange after step w, and the steps it can
    touch: step w itself (the exchange of a stage that finished early shares links with the
    others' last transfers), k overlapped steps, the one that waits for it and two to settle; it
    counts the period's other steps at step 2's time. `exact` plays out steps 1..2H with
    exchanges after steps H and 2H instead and times steps H+1..2H (slower; a test checks that
    both agree). Needs H >= 3 when exact. `fold` plays one replica per stage for all D (default:
    whenever `symmetric`; a test checks that both agree).
    """
    P, D, M, H = len(swarm.stages), swarm.replicas, schedule.microbatches, swarm.inner_steps
    fold = symmetric(swarm, schedule) if fold is None else fold
    if fold and not symmetric(swarm, schedule):
        raise ValueError("only a symmetric swarm can be folded (same links, groups of one size)")
    R = 1 if fold else D  # replicas played per stage; each flow of a folded one stands for D
    k = min(schedule.overlap_steps, H - 1)
    if exact and H < 3:
        raise ValueError(f"an exact simulation needs H >= 3, got {H}")
    w = H if exact else 3  # an exchange follows step w (and, when exact, step 2H)
    n = 2 * H if exact else w + min(H, k + 3)  # steps played out: the waiting one (w + k + 1) included
    peer = {(s, d): s * R + d for s in range(P) for d in range(R)}
    links = [swarm.link_of(s, d) for s in range(P) for d in range(R)]
    processors = [d for s in range(P) for d in range(R)] if swarm.colocated else None  # replica d's CPU
    graph = Graph(
        [x.bytes_per_s(up=True) for x in links], [x.bytes_per_s(up=False) for x in links], processors
    )

    def flow(a: int, b: int, nbytes: float, deps: list[int], weight: int = 1, hop: bool = True) -> int:
        """A pipeline message (hop) or an exchange's transfer, of `weight` flows of `nbytes` each."""
        one_way = (links[a].rtt_s + links[b].rtt_s) / 4
        latency = one_way + (2 * one_way * swarm.hop_rtts if hop else 0.0)
        amount = nbytes * weight * (1.0 if hop else swarm.exchange_scale(links[a]))
        return graph.add(Task("flow", peer=a, dst=b, amount=amount, latency=latency, weight=weight), deps)

    if schedule.microbatch_sizes:  # the swarm's own rule; the schedule alone cannot know B
        check_microbatch_sizes(schedule.microbatch_sizes, M, swarm.batch)
    rows = schedule.microbatch_sizes or (swarm.batch / M,) * M  # per microbatch of one replica
    sizes = (swarm.seq_len, swarm.hidden, schedule.wire)
    act = [wire_bytes(r / D, *sizes, token_ids=True, rank=schedule.rank) for r in rows]
    grad = [wire_bytes(r / D, *sizes, token_ids=False, rank=schedule.rank) for r in rows]
    fan = D // R  # flows a played flow stands for
    opt: dict[tuple[int, int], int] = {}  # (stage, replica) -> last optimizer step's task
    exchange_start: dict[tuple[int, int], int] = {}  # of the exchange after step w
    exchange_done: dict[tuple[int, int], int] = {}
    step_end: dict[int, list[int]] = {}
    for t in range(1, n + 1):
        fwd: dict[tuple[int, int, int], int] = {}
        bwd: dict[tuple[int, int, int], int] = {}
        sent: dict[tuple[int, int, int, int], int] = {}  # (stage, from, to, m) -> activation flow
        for s in range(P):
            cost = swarm.stages[s]
            last = s == P - 1
            for d in range(R):
                gate_deps = [opt[(s, d)]] if (s, d) in opt else []
                if t == w + k + 1:
                    gate_deps.append(exchange_done[(s, d)])
                gate = graph.add(Task("gate"), gate_deps)
                for m in range(M):
                    deps = [gate] + [sent[(s - 1, e, d, m)] for e in range(R)] if s else [gate]
                    seconds = rows[m] * (cost.forward_s + (cost.backward_s if last else 0.0))
                    task = Task("compute", peer=peer[(s, d)], amount=seconds, priority=(t, 1, m))
                    fwd[(s, d, m)] = graph.add(task, deps)
                    if not last:
                        for e in range(R):
                            sent[(s, d, e, m)] = flow(
                                peer[(s, d)], peer[(s + 1, e)], act[m], [fwd[(s, d, m)]], fan
                            )
        for s in reversed(range(P)):
            cost = swarm.stages[s]
            for d in range(R):
                ends = []
                for m in range(M):
                    if s == P - 1:
                        bwd[(s, d, m)] = fwd[(s, d, m)]
                    else:
                        deps = [fwd[(s, d, m)]]
                        deps += [
                            flow(peer[(s + 1, e)], peer[(s, d)], grad[m], [bwd[(s + 1, e, m)]], fan)
                            for e in range(R)
                        ]
                        task = Task("compute", peer=peer[(s, d)], amount=rows[m] * cost.backward_s)
                        task.priority = (t, 0, m)
                        bwd[(s, d, m)] = graph.add(task, deps)
                    ends.append(bwd[(s, d, m)])
                task = Task("compute", peer=peer[(s, d)], amount=cost.optimizer_s, priority=(t, 0, M))
                opt[(s, d)] = graph.add(task, ends)
                step_end.setdefault(t, []).append(opt[(s, d)])
        if t == w or (exact and t == n):
            starts, dones = (exchange_start, exchange_done) if t == w else ({}, {})
            for s in range(P):
                _add_exchange(
                    graph, schedule, (s, D, H, R), swarm.stages[s].params, peer, opt, flow, starts, dones
                )
    graph.run()
    tasks = graph.tasks

    def end_of(t: int) -> float:
        return max(tasks[i].end for i in step_end[t])

    step = end_of(w - 1) - end_of(w - 2)
    # Steps w..n played out, the others of the period at `step` (with k = H - 1 the waiting step
    # is the next period's first, so one step too many was played out: the count goes to -1).
    period = end_of(n) - end_of(w - 1) + (H - (n - w + 1)) * step if not exact else end_of(n) - end_of(w)
    exchange = max(tasks[exchange_done[key]].end - tasks[exchange_start[key]].end for key in exchange_done)
    busy = [H * (swarm.batch * (c.forward_s + c.backward_s) + c.optimizer_s) / period for c in swarm.stages]
    tokens_per_s = H * swarm.tokens_per_step / period
    return Timing(
        period_s=period,
        step_s=step,
        exchange_s=exchange,
        tokens_per_s=tokens_per_s,
        utilisation=tokens_per_s / compute_bound_tokens_per_s(swarm),
        busy=tuple(busy),
    )


def _add_exchange(
    graph: Graph,
    schedule: Schedule,
    where: tuple[int, int, int, int],
    params: int,
    peer: dict[tuple[int, int], int],
    opt: dict[tuple[int, int], int],
    flow: Callable[..., int],
    exchange_start: dict[tuple[int, int], int],
    exchange_done: dict[tuple[int, int], int],
) -> None:
    """Stage s's outer exchange after step H: NoLoCo's group swaps or DiLoCo's sharded all-reduce,
    for its R played replicas of D (R = 1: the one played replica's flows to itself stand for
    its flows to and from the D - 1 others, which use the same uplink and downlink)."""
    s, D, H, R = where
    stage_bytes = params * PARAM_BYTES
    for d in range(R):
        exchange_start[(s, d)] = graph.add(Task("gate"), [opt[(s, d)]])
    incoming: dict[int, list[int]] = {d: [] for d in range(R)}
    outgoing: dict[int, list[int]] = {d: [] for d in range(R)}
    me = peer[(s, 0)]
    if schedule.exchange == "noloco":
        groups = make_groups(D, H, schedule.group_size)
        if R == 1 and len(groups[0]) > 1:
            f = flow(me, me, stage_bytes, [exchange_start[(s, 0)]], len(groups[0]) - 1, hop=False)
            incoming[0].append(f)
            outgoing[0].append(f)
        for group in groups if R > 1 else []:
            for a in group:
                for b in group:
                    if a != b:
                        f = flow(peer[(s, a)], peer[(s, b)], stage_bytes, [exchange_start[(s, a)]], hop=False)
                        incoming[b].append(f)
                        outgoing[a].append(f)
    elif R == 1 and D > 1:  # DiLoCo, folded: the reduce-scatter, then the all-gather
        scatter = flow(me, me, stage_bytes / D, [exchange_start[(s, 0)]], D - 1, hop=False)
        reduced = graph.add(Task("gate"), [exchange_start[(s, 0)], scatter])
        gather = flow(me, me, stage_bytes / D, [reduced], D - 1, hop=False)
        incoming[0].append(gather)
        outgoing[0] += [scatter, gather]
    elif R > 1:
        shard = stage_bytes / D
        scattered: dict[int, list[int]] = {d: [] for d in range(D)}  # owner -> shards it receives
        for a in range(D):
            for b in range(D):
                if a != b:
                    f = flow(peer[(s, a)], peer[(s, b)], shard, [exchange_start[(s, a)]], hop=False)
                    scattered[b].append(f)
                    outgoing[a].append(f)
        for owner in range(D):
            reduced = graph.add(Task("gate"), [exchange_start[(s, owner)], *scattered[owner]])
            for b in range(D):
                if b != owner:
                    f = flow(peer[(s, owner)], peer[(s, b)], shard, [reduced], hop=False)
                    incoming[b].append(f)
                    outgoing[owner].append(f)
    for d in range(R):
        deps = [exchange_start[(s, d)], *incoming[d], *outgoing[d]]
        exchange_done[(s, d)] = graph.add(Task("gate"), deps)
