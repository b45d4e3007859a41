"""A wall-clock model of the swarm's schedule: a discrete-event simulation in seconds, no clock read.

What it models (issue 11), for P stages x D replicas, one peer per replica with one GPU and one
link:

- **Compute.** Each peer runs one task at a time: the forward of a microbatch, or its backward
  (the last stage runs both at once, since the loss is there). Cost is linear in rows:
  `StageCost.forward_s` per sample, backward likewise. Among ready tasks a peer takes the earliest
  step first, then backwards before forwards (1F1B-like), then the lowest microbatch.
- **Inner step.** The batch of B samples is cut into M microbatches (B/M rows each, or the sizes
  `Schedule.microbatch_sizes` names). Stage s forwards microbatch m
  once the rows of m from every replica of stage s-1 are in (routes are per sample and random, so
  the model spreads each microbatch evenly over the D receivers: B/(M*D) rows per pair, a fluid
  mean of the plan's permutations). Gradients come back on the same pairs. The optimizer steps
  once all M backwards are done (a flush), and the next step's forwards wait for it. M = 1 is
  today's schedule: one batch in flight and a full round trip per hop per step.
- **Wire.** Activations carry `seq x hidden` elements per row at 4/2/1 bytes (fp32/bf16/int8),
  int8 adds one fp32 scale per token row, and the forward also carries the row's int64 token ids
  (the last stage needs them); gradients cross in the same format, without token ids.
- **Links.** Every peer has one uplink and one downlink (full duplex) of its `Link`'s rate; a
  transfer from a to b uses a's uplink and b's downlink, and concurrent transfers share links
  max-min fairly (as long-lived TCP flows roughly do); messages between one pair go out in order
  (one connection), so microbatch m+1 follows m. A message is delivered when its last byte
  has been serialised plus a one-way latency of (rtt_a + rtt_b) / 4, so two peers of one profile
  see its RTT. Not modelled: TCP slow start and window limits (a window below rate x RTT would cap
  a flow), loss, jitter, protocol CPU costs, framing beyond `Link.efficiency`.
- **Outer exchange**, every H steps, of the stage's fp32 parameters: NoLoCo sends the whole stage
  to each partner of its gossip group (a pairwise swap, both ways at once); DiLoCo all-reduces in
  shards (reduce-scatter then all-gather, 2(D-1)/D of the stage each way). With
  `overlap_steps = k` training goes on for k steps and waits only before step boundary + k + 1 for
  the exchange to end; k = 0 blocks at the boundary as in the paper. The exchange's bytes share
  the links with the pipeline's. The outer update's own compute is not modelled (it is a few
  element-wise passes over the stage).

`simulate` reports one outer period in steady state: H steps and the exchange; it plays out only
the steps the exchange can touch and counts the others at a steady step's time (every step ends
with a flush, so they are all alike), which a test checks against playing out whole periods.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from noloco_swarm.model.presets import ModelConfig, count_stage_parameters, layer_parameters
from noloco_swarm.model.split import split_layers
from noloco_swarm.protocol.gossip import make_groups
from noloco_swarm.protocol.plan import check_microbatch_sizes
from noloco_swarm.sim.flows import Graph, Task

Wire = Literal["fp32", "bf16", "int8"]
Exchange = Literal["noloco", "diloco"]
WIRE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "int8": 1}
INT8_SCALE_BYTES = 4  # one fp32 scale per token row of `hidden` elements
TOKEN_ID_BYTES = 8  # int64 token ids travel forward with each row
PARAM_BYTES = 4  # outer-step tensors cross in fp32, uncompressed (DESIGN.md section 3)
TCP_EFFICIENCY = 1448 / 1514  # TCP payload per Ethernet frame at MTU 1500 (docs/benchmarks.md)


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

    def __post_init__(self) -> None:
        if self.microbatches < 1 or self.overlap_steps < 0 or self.group_size < 1:
            raise ValueError("need microbatches >= 1, overlap_steps >= 0 and group_size >= 1")
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

    def __post_init__(self) -> None:
        if not self.stages or self.replicas < 1 or self.batch < 1 or self.inner_steps < 1:
            raise ValueError("need at least one stage, replica, sample and inner step")

    def link_of(self, stage: int, replica: int) -> Link:
        for s, d, link in self.links:
            if (s, d) == (stage, replica):
                return link
        return self.link

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


def wire_bytes(rows: float, seq_len: int, hidden: int, wire: Wire, token_ids: bool) -> float:
    """Bytes of `rows` samples' activations (token_ids=True) or gradients on the wire."""
    per_token = hidden * WIRE_BYTES[wire] + (INT8_SCALE_BYTES if wire == "int8" else 0)
    return rows * seq_len * (per_token + (TOKEN_ID_BYTES if token_ids else 0))


def exchange_bytes(params: int, schedule: Schedule, replicas: int) -> float:
    """Bytes one replica sends (and receives) per outer step."""
    stage = params * PARAM_BYTES
    if schedule.exchange == "diloco":
        return 2 * (replicas - 1) / replicas * stage
    group = max(len(g) for g in make_groups(replicas, 0, schedule.group_size))
    return (group - 1) * stage


def compute_bound_tokens_per_s(swarm: Swarm) -> float:
    """The rate when the busiest stage computes all the time (no network, no pipeline bubble)."""
    slowest = max(s.forward_s + s.backward_s + s.optimizer_s / swarm.batch for s in swarm.stages)
    return swarm.tokens_per_step / (swarm.batch * slowest) if slowest > 0 else math.inf


def resource_bound_s(swarm: Swarm, schedule: Schedule) -> float:
    """A floor on seconds per inner step: the busiest GPU, uplink or downlink of any peer.

    Per step a peer computes its stage's B samples, sends activations on and gradients back,
    receives the same, and carries 1/H of its outer exchange each way. No schedule beats this;
    a deep enough pipeline with overlap approaches it.
    """
    P, B = len(swarm.stages), swarm.batch
    act = wire_bytes(B, swarm.seq_len, swarm.hidden, schedule.wire, token_ids=True)
    grad = wire_bytes(B, swarm.seq_len, swarm.hidden, schedule.wire, token_ids=False)
    floor = 0.0
    for s, cost in enumerate(swarm.stages):
        outer = exchange_bytes(cost.params, schedule, swarm.replicas) / swarm.inner_steps
        up = (act if s < P - 1 else 0.0) + (grad if s > 0 else 0.0) + outer
        down = (act if s > 0 else 0.0) + (grad if s < P - 1 else 0.0) + outer
        for d in range(swarm.replicas):
            link = swarm.link_of(s, d)
            compute = B * (cost.forward_s + cost.backward_s) + cost.optimizer_s
            floor = max(floor, compute, up / link.bytes_per_s(up=True), down / link.bytes_per_s(up=False))
    return floor


# ---------------------------------------------------------------------- FLOPs of the presets


def stage_flops_per_token(cfg: ModelConfig, num_stages: int) -> list[float]:
    """Forward FLOPs per token of each stage: 2 per matmul weight, plus causal-free attention.

    2 x (layer weights) per token for each layer, plus 4 x seq x hidden for its scores and
    weighted sum (counted without the causal mask's saving, as the usual 6N + 12 L s h
    convention does); the last stage adds its LM head (2 x hidden x vocab). The embedding is a
    lookup: no FLOPs. Backward is twice the forward.
    """
    out = []
    for s, layers in enumerate(split_layers(cfg.num_layers, num_stages)):
        per_layer = 2 * layer_parameters(cfg) + 4 * cfg.seq_len * cfg.hidden_size
        flops = len(layers) * per_layer
        if s == num_stages - 1:
            flops += 2 * cfg.hidden_size * cfg.vocab_size
        out.append(float(flops))
    return out


def preset_stages(cfg: ModelConfig, num_stages: int, flops_per_s: float) -> tuple[StageCost, ...]:
    """Stage costs of a preset on a GPU that sustains `flops_per_s` (peak x MFU)."""
    costs = []
    ranges = split_layers(cfg.num_layers, num_stages)
    for s, flops in enumerate(stage_flops_per_token(cfg, num_stages)):
        forward = flops * cfg.seq_len / flops_per_s
        params = count_stage_parameters(cfg, ranges[s], first=s == 0, last=s == num_stages - 1)
        costs.append(StageCost(forward_s=forward, backward_s=2 * forward, params=params))
    return tuple(costs)


# ---------------------------------------------------------------------- the swarm's schedule


def simulate(swarm: Swarm, schedule: Schedule, exact: bool = False) -> Timing:
    """Time one outer period in steady state: H inner steps and one outer exchange.

    Every inner step ends with a flush, so steps away from the exchange all take the same time.
    The model plays out steps 1..w (w = 3) with the exchange after step w, and the steps it can
    touch: step w itself (the exchange of a stage that finished early shares links with the
    others' last transfers), k overlapped steps, the one that waits for it and two to settle; it
    counts the period's other steps at step 2's time. `exact` plays out steps 1..2H with
    exchanges after steps H and 2H instead and times steps H+1..2H (slower; a test checks that
    both agree). Needs H >= 3 when exact.
    """
    P, D, M, H = len(swarm.stages), swarm.replicas, schedule.microbatches, swarm.inner_steps
    k = min(schedule.overlap_steps, H - 1)
    if exact and H < 3:
        raise ValueError(f"an exact simulation needs H >= 3, got {H}")
    w = H if exact else 3  # an exchange follows step w (and, when exact, step 2H)
    n = 2 * H if exact else w + min(H, k + 3)  # steps played out: the waiting one (w + k + 1) included
    peer = {(s, d): s * D + d for s in range(P) for d in range(D)}
    links = [swarm.link_of(s, d) for s in range(P) for d in range(D)]
    graph = Graph([x.bytes_per_s(up=True) for x in links], [x.bytes_per_s(up=False) for x in links])

    def latency(a: int, b: int) -> float:
        return (links[a].rtt_s + links[b].rtt_s) / 4

    def flow(a: int, b: int, nbytes: float, deps: list[int]) -> int:
        return graph.add(Task("flow", peer=a, dst=b, amount=nbytes, latency=latency(a, b)), deps)

    if schedule.microbatch_sizes:  # the swarm's own rule; the schedule alone cannot know B
        check_microbatch_sizes(schedule.microbatch_sizes, M, swarm.batch)
    rows = schedule.microbatch_sizes or (swarm.batch / M,) * M  # per microbatch of one replica
    act = [wire_bytes(r / D, swarm.seq_len, swarm.hidden, schedule.wire, token_ids=True) for r in rows]
    grad = [wire_bytes(r / D, swarm.seq_len, swarm.hidden, schedule.wire, token_ids=False) for r in rows]
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
            for d in range(D):
                gate_deps = [opt[(s, d)]] if (s, d) in opt else []
                if t == w + k + 1:
                    gate_deps.append(exchange_done[(s, d)])
                gate = graph.add(Task("gate"), gate_deps)
                for m in range(M):
                    deps = [gate] + [sent[(s - 1, e, d, m)] for e in range(D)] if s else [gate]
                    seconds = rows[m] * (cost.forward_s + (cost.backward_s if last else 0.0))
                    task = Task("compute", peer=peer[(s, d)], amount=seconds, priority=(t, 1, m))
                    fwd[(s, d, m)] = graph.add(task, deps)
                    if not last:
                        for e in range(D):
                            sent[(s, d, e, m)] = flow(
                                peer[(s, d)], peer[(s + 1, e)], act[m], [fwd[(s, d, m)]]
                            )
        for s in reversed(range(P)):
            cost = swarm.stages[s]
            for d in range(D):
                ends = []
                for m in range(M):
                    if s == P - 1:
                        bwd[(s, d, m)] = fwd[(s, d, m)]
                    else:
                        deps = [fwd[(s, d, m)]]
                        deps += [
                            flow(peer[(s + 1, e)], peer[(s, d)], grad[m], [bwd[(s + 1, e, m)]])
                            for e in range(D)
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
                _add_exchange(graph, swarm, schedule, s, peer, opt, flow, starts, dones)
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
    swarm: Swarm,
    schedule: Schedule,
    s: int,
    peer: dict[tuple[int, int], int],
    opt: dict[tuple[int, int], int],
    flow: Callable[[int, int, float, list[int]], int],
    exchange_start: dict[tuple[int, int], int],
    exchange_done: dict[tuple[int, int], int],
) -> None:
    """Stage s's outer exchange after step H: NoLoCo's group swaps or DiLoCo's sharded all-reduce."""
    D, H = swarm.replicas, swarm.inner_steps
    stage_bytes = swarm.stages[s].params * PARAM_BYTES
    for d in range(D):
        exchange_start[(s, d)] = graph.add(Task("gate"), [opt[(s, d)]])
    incoming: dict[int, list[int]] = {d: [] for d in range(D)}
    outgoing: dict[int, list[int]] = {d: [] for d in range(D)}
    if schedule.exchange == "noloco":
        for group in make_groups(D, H, schedule.group_size):
            for a in group:
                for b in group:
                    if a != b:
                        f = flow(peer[(s, a)], peer[(s, b)], stage_bytes, [exchange_start[(s, a)]])
                        incoming[b].append(f)
                        outgoing[a].append(f)
    else:
        shard = stage_bytes / D
        scatter: dict[int, list[int]] = {d: [] for d in range(D)}  # owner -> shards it receives
        for a in range(D):
            for b in range(D):
                if a != b:
                    f = flow(peer[(s, a)], peer[(s, b)], shard, [exchange_start[(s, a)]])
                    scatter[b].append(f)
                    outgoing[a].append(f)
        for owner in range(D):
            reduced = graph.add(Task("gate"), [exchange_start[(s, owner)], *scatter[owner]])
            for b in range(D):
                if b != owner:
                    f = flow(peer[(s, owner)], peer[(s, b)], shard, [reduced])
                    incoming[b].append(f)
                    outgoing[owner].append(f)
    for d in range(D):
        deps = [exchange_start[(s, d)], *incoming[d], *outgoing[d]]
        exchange_done[(s, d)] = graph.add(Task("gate"), deps)
