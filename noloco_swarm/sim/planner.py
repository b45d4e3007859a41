"""`noloco plan`: a swarm's candidate schedules, ranked by projected wall-clock time to a target loss.

Pure: no file, clock or print. The caller gives the swarm (preset, stages, replicas), its link and
GPU, and the measured token costs (rows of docs/results/token_cost.json, which the CLI reads);
this module enumerates schedules, projects each one's tokens/s with the wall-clock model
(sim/wallclock.py), and its time to the target as tokens needed / tokens/s.

Tokens needed = the dense run's tokens to the target x the schedule's token multiplier:

- the dense run is fp32 rows at NoLoCo's default H = 50; its tokens are the preset's total steps
  x D replicas x 8 rows x seq (the defaults' run), unless the caller gives them;
- the multiplier of a (wire, rank, H) comes only from a token-cost row with exactly those values
  (the dense one's is 1 by definition). Nothing is interpolated between measured ranks or H, nor
  carried from one format to another: a schedule without its row is *unmeasured*, gets no time,
  and ranks after every measured one (among themselves by tokens/s);
- a row measured over a longer run than the dense one (its learning-rate schedule stretched) gives
  its tokens to the dense loss over those of the dense run stretched alike where that control was
  run (the stretched schedule alone changes when a loss is reached: the dense run stretched 2x
  gets there with 0.855x the tokens), else over the dense run's own;
- an overlapped exchange (k = H/2, the largest k measured) takes the multiplier of its k = 0
  schedule: NoLoCo showed no cost the seeds could resolve up to k = H/2
  (docs/results/overlap.json; tiny preset, H = 10, 3 seeds). Each projection names its sources;
- the batch size is assumed not to change the tokens needed (not measured): candidates stay
  within the batches the GPU's memory holds.

The link is the wall-clock model's: TCP payload efficiency, `hop_rtts` round trips per pipeline
message, and the exchange at its measured goodput, capped at 93% of the link (what
`peer.exchange_max_mbit = auto`, the default, sets from the rate partners measure) unless the
caller plans without the cap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from noloco_swarm.model.presets import SCHEDULES, ModelConfig
from noloco_swarm.sim.costs import Gpu, preset_stages
from noloco_swarm.sim.wallclock import (
    EXCHANGE_GOODPUT,
    TCP_EFFICIENCY,
    Link,
    Schedule,
    StageCost,
    Swarm,
    Timing,
    exchange_bytes,
    simulate,
    step_bytes,
)
from noloco_swarm.train.memory import stage_estimate

DENSE_WIRE, DENSE_H = "fp32", 50  # the reference run: exact rows, NoLoCo's default H
DEFAULT_BATCH = 8  # inner.batch_size's default: the dense run's rows per replica and step
WIRES = ("fp32", "bf16", "int8")
OVERLAP_MEASURED = 0.5  # the largest k / H whose cost was measured (docs/results/overlap.json)


@dataclass(frozen=True)
class TokenCost:
    """One measured row of docs/results/token_cost.json: a format's tokens to the dense loss."""

    wire: str
    rank: int
    H: int
    seeds: int
    steps: int
    tokens_to_dense_loss_ratio: float
    """Tokens this schedule needs to reach the dense run's final loss, over the dense run's."""
    loss_ratio_at_equal_tokens: float | None
    """None for a run longer than the dense one (a stretched schedule): no equal-token point."""
    same_schedule_ratio: float | None = None
    """For a stretched run: its tokens to the dense loss over the dense run's stretched alike
    (`tokens_to_dense_loss_ratio_same_schedule`), where that control was run; the multiplier then."""

    @property
    def multiplier(self) -> float:
        """Tokens to the target over the dense run's, on like schedules where measured so."""
        return (
            self.tokens_to_dense_loss_ratio if self.same_schedule_ratio is None else self.same_schedule_ratio
        )

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> TokenCost:
        """A row of the file, checked: ValueError naming what is wrong."""
        names = (
            "wire",
            "rank",
            "H",
            "seeds",
            "steps",
            "tokens_to_dense_loss_ratio",
            "loss_ratio_at_equal_tokens",
        )
        missing = [name for name in names if name not in row]
        if missing:
            raise ValueError(f"token cost row {dict(row)} lacks {', '.join(missing)}")
        cost = cls(
            wire=str(row["wire"]),
            rank=int(row["rank"] or 0),
            H=int(row["H"]),
            seeds=int(row["seeds"]),
            steps=int(row["steps"]),
            tokens_to_dense_loss_ratio=float(row["tokens_to_dense_loss_ratio"]),
            loss_ratio_at_equal_tokens=(
                None
                if row["loss_ratio_at_equal_tokens"] is None
                else float(row["loss_ratio_at_equal_tokens"])
            ),
            same_schedule_ratio=(
                None if (same := row.get("tokens_to_dense_loss_ratio_same_schedule")) is None else float(same)
            ),
        )
        for name, value in (
            ("tokens_to_dense_loss_ratio", cost.tokens_to_dense_loss_ratio),
            ("tokens_to_dense_loss_ratio_same_schedule", cost.same_schedule_ratio),
        ):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"token cost row {dict(row)}: {name} must be a number > 0")
        return cost


@dataclass(frozen=True)
class Problem:
    """What the planner is asked: a swarm's shape, its peers' link and GPU, and what to try."""

    model: ModelConfig
    stages: int
    replicas: int
    rate_mbit: float
    """Every peer's link rate, each way."""
    rtt_s: float
    gpu: Gpu
    mfu: float = 0.4
    """Share of the GPU's peak a stage sustains."""
    hop_rtts: float = 1.0
    """Round trips the stack adds to every pipeline message (Swarm.hop_rtts)."""
    capped: bool = True
    """Cap the exchange at 93% of the link (peer.exchange_max_mbit = auto, the default), at its
    measured goodput; False plans `peer.exchange_max_mbit = 0` (no cap)."""
    target_tokens: float | None = None
    """The dense run's tokens to the target loss; None: the preset's total steps x D x 8 x seq."""
    batches: tuple[int, ...] = (8, 16, 32, 64)
    microbatches: tuple[int, ...] = (1, 4, 8, 16, 32)
    ranks: tuple[int, ...] = (32, 64, 128, 256)
    """Ranks of the subspace format to try (those below the hidden size)."""
    inner_steps: tuple[int, ...] = (50, 100, 250)

    def __post_init__(self) -> None:
        if self.stages < 1 or self.replicas < 1 or self.stages > self.model.num_layers:
            raise ValueError(f"need 1 <= stages <= {self.model.num_layers} layers and replicas >= 1")
        if not (self.rate_mbit > 0 and self.rtt_s >= 0 and 0 < self.mfu <= 1 and self.hop_rtts >= 0):
            raise ValueError("need a rate > 0 Mbit/s, an RTT >= 0, 0 < MFU <= 1 and hop round trips >= 0")
        if self.target_tokens is not None and not self.target_tokens > 0:
            raise ValueError(f"the target's tokens must be > 0, got {self.target_tokens}")

    @property
    def dense_tokens(self) -> float:
        """Tokens the dense run needs to reach the target."""
        if self.target_tokens is not None:
            return self.target_tokens
        steps = SCHEDULES[self.model.name]["total_steps"]  # every preset has its schedule
        return float(steps * self.replicas * DEFAULT_BATCH * self.model.seq_len)

    @property
    def memory_bytes(self) -> float | None:
        return None if self.gpu.memory_gb is None else self.gpu.memory_gb * 1e9


@dataclass(frozen=True)
class Candidate:
    """One schedule to try."""

    batch: int
    microbatches: int
    wire: str
    rank: int
    inner_steps: int
    overlap_steps: int
    capped: bool

    @property
    def schedule(self) -> Schedule:
        return Schedule(
            microbatches=self.microbatches, wire=self.wire, overlap_steps=self.overlap_steps, rank=self.rank
        )  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        wire = f"subspace k={self.rank}" if self.wire == "subspace" else self.wire
        overlap = f"overlap {self.overlap_steps}" if self.overlap_steps else "blocking"
        cap = "" if self.capped else ", uncapped"  # the default caps it (peer/net/uplink.py)
        return f"B={self.batch} M={self.microbatches} {wire} H={self.inner_steps} {overlap}{cap}"


# `noloco join`'s defaults today: one batch of 8 in flight, bf16 rows, H = 50, a blocking
# exchange capped near 93% of the link (peer.exchange_max_mbit = auto: 97% of the payload rate its
# partners measured, peer/net/uplink.py).
BASELINE = Candidate(DEFAULT_BATCH, 1, "bf16", 0, DENSE_H, 0, capped=True)


@dataclass(frozen=True)
class Projection:
    """A candidate's projected speed, bytes and time to the target."""

    candidate: Candidate
    timing: Timing
    bytes_per_step: float
    """Bytes the busiest peer sends (or receives) per inner step, its 1/H of the exchange included."""
    pipeline_bytes_per_step: float
    """Of those, activations and gradients."""
    exchange_bytes_per_step: float
    """Of those, the outer exchange's share (its bytes / H)."""
    memory_gb: float
    """The largest stage's memory estimate (train/memory.py)."""
    multiplier: float | None
    """Tokens needed over the dense run's; None: unmeasured."""
    multiplier_source: str
    time_to_target_s: float | None
    config: dict[str, str]

    @property
    def measured(self) -> bool:
        return self.time_to_target_s is not None


def candidates(problem: Problem) -> list[Candidate]:
    """Every schedule to try: batch sizes the GPU holds, microbatch counts that cut them, the wire
    formats (subspace at each rank below the hidden size), H, and overlap off or k = H/2."""
    wires = [(w, 0) for w in WIRES] + [
        ("subspace", k) for k in problem.ranks if k < problem.model.hidden_size
    ]
    out = []
    for batch in problem.batches:
        for m in problem.microbatches:
            if m > batch or batch % m or not fits(problem, batch, m):
                continue
            for (wire, rank), H in ((w, h) for w in wires for h in problem.inner_steps):
                for k in (0, int(H * OVERLAP_MEASURED)):
                    out.append(Candidate(batch, m, wire, rank, H, k, problem.capped))
    return out


def memory_needed(problem: Problem, batch: int, microbatches: int) -> float:
    """Bytes the largest stage needs at this batch and cut (train/memory.py's estimate)."""
    largest = batch // microbatches
    return max(
        stage_estimate(problem.model, problem.stages, s, batch, largest).total for s in range(problem.stages)
    )


def fits(problem: Problem, batch: int, microbatches: int) -> bool:
    limit = problem.memory_bytes
    return limit is None or memory_needed(problem, batch, microbatches) <= limit


def multiplier(candidate: Candidate, costs: Sequence[TokenCost]) -> tuple[float | None, str]:
    """The candidate's token multiplier and where it comes from; (None, why) if unmeasured."""
    key = (candidate.wire, candidate.rank, candidate.inner_steps)
    overlap = (
        f"; overlap k={candidate.overlap_steps} as k=0 (overlap.json, measured to k = H/2)"
        if candidate.overlap_steps
        else ""
    )
    if candidate.overlap_steps > OVERLAP_MEASURED * candidate.inner_steps:
        return None, f"unmeasured: overlap beyond k = H/2{overlap}"
    if key == (DENSE_WIRE, 0, DENSE_H):  # its stretched control's row measures the schedule, not it
        return 1.0, "the dense run itself" + overlap
    rows = [c for c in costs if (c.wire, c.rank, c.H) == key]
    if rows:
        # the best-measured row of that schedule, a control's over one without
        row = max(rows, key=lambda c: (c.same_schedule_ratio is not None, c.seeds, c.steps))
        source = f"token_cost.json: {row.seeds} seeds, {row.steps} steps"
        if row.same_schedule_ratio is not None:
            source += ", against the dense run stretched alike"
        return row.multiplier, source + overlap
    rank = f" rank {candidate.rank}" if candidate.rank else ""
    return None, f"unmeasured: no token_cost.json row for {candidate.wire}{rank} at H={candidate.inner_steps}"


def config_of(problem: Problem, candidate: Candidate) -> dict[str, str]:
    """The run's config keys for this schedule, as `--set KEY=VALUE` takes them."""
    config = {
        "preset": problem.model.name,
        "method": "noloco",
        "num_stages": str(problem.stages),
        "num_replicas": str(problem.replicas),
        "inner.batch_size": str(candidate.batch),
        "inner.microbatches": str(candidate.microbatches),
        "wire.activations": candidate.wire,
        "outer.inner_steps": str(candidate.inner_steps),
        "outer.overlap_steps": str(candidate.overlap_steps),
    }
    if candidate.wire == "subspace":
        config["model.subspace_rank"] = str(candidate.rank)
    if not candidate.capped:  # the default caps it near 93% of the link, measured by each peer
        config["peer.exchange_max_mbit"] = "0"
    return config


def swarm_of(problem: Problem, candidate: Candidate, stages: tuple[StageCost, ...]) -> Swarm:
    """The wall-clock model's swarm for this candidate."""
    link = Link.symmetric(problem.rate_mbit, rtt_s=problem.rtt_s, efficiency=TCP_EFFICIENCY)
    goodput = EXCHANGE_GOODPUT["capped" if candidate.capped else "uncapped"]
    return Swarm(
        stages,
        replicas=problem.replicas,
        batch=candidate.batch,
        seq_len=problem.model.seq_len,
        hidden=problem.model.hidden_size,
        inner_steps=candidate.inner_steps,
        link=link,
        hop_rtts=problem.hop_rtts,
        exchange_goodput=goodput,
    )


def stage_costs(problem: Problem) -> tuple[StageCost, ...]:
    return preset_stages(problem.model, problem.stages, problem.gpu.peak_tflops * 1e12 * problem.mfu)


def project(
    problem: Problem,
    candidate: Candidate,
    costs: Sequence[TokenCost],
    stages: tuple[StageCost, ...] | None = None,
) -> Projection:
    """One candidate through the wall-clock model, with its bytes, memory and time to the target."""
    swarm = swarm_of(problem, candidate, stages or stage_costs(problem))
    schedule = candidate.schedule
    timing = simulate(swarm, schedule)
    busiest = (0.0, 0.0, 0.0)  # (bytes, pipeline, exchange) of the busiest peer
    for s, cost in enumerate(swarm.stages):
        outer = exchange_bytes(cost.params, schedule, swarm.replicas) / swarm.inner_steps
        most = max(step_bytes(swarm, schedule, s))
        busiest = max(busiest, (most, most - outer, outer))
    factor, source = multiplier(candidate, costs)
    time = None if factor is None else problem.dense_tokens * factor / timing.tokens_per_s
    return Projection(
        candidate=candidate,
        timing=timing,
        bytes_per_step=busiest[0],
        pipeline_bytes_per_step=busiest[1],
        exchange_bytes_per_step=busiest[2],
        memory_gb=memory_needed(problem, candidate.batch, candidate.microbatches) / 1e9,
        multiplier=factor,
        multiplier_source=source,
        time_to_target_s=time,
        config=config_of(problem, candidate),
    )


def rank_key(p: Projection) -> tuple[int, float, float, str]:
    """Measured schedules first, fastest to the target first; then unmeasured ones by tokens/s."""
    first = p.time_to_target_s if p.time_to_target_s is not None else -p.timing.tokens_per_s
    return (0 if p.measured else 1, first, -p.timing.tokens_per_s, p.candidate.label)


@dataclass(frozen=True)
class Plan:
    problem: Problem
    schedules: list[Projection]
    """Every candidate, best first (rank_key)."""
    baseline: Projection
    """`noloco join`'s default schedule on the same swarm."""


def plan(problem: Problem, costs: Sequence[TokenCost] = ()) -> Plan:
    """Project every candidate and rank them; project today's default schedule beside them."""
    stages = stage_costs(problem)
    projections = sorted((project(problem, c, costs, stages) for c in candidates(problem)), key=rank_key)
    baseline = project(problem, BASELINE, costs, stages)
    return Plan(problem, projections, baseline)


def projection_json(p: Projection) -> dict[str, Any]:
    c = p.candidate
    return {
        "label": c.label,
        "utilisation": p.timing.utilisation,
        "tokens_per_s": p.timing.tokens_per_s,
        "bytes_per_step": p.bytes_per_step,
        "pipeline_bytes_per_step": p.pipeline_bytes_per_step,
        "exchange_bytes_per_step": p.exchange_bytes_per_step,
        "time_to_target_s": p.time_to_target_s,
        "token_multiplier": p.multiplier,
        "token_multiplier_source": p.multiplier_source,
        "step_s": p.timing.step_s,
        "exchange_s": p.timing.exchange_s,
        "period_s": p.timing.period_s,
        "memory_gb": p.memory_gb,
        "config": p.config,
    }


def plan_json(result: Plan, top: int | None = None) -> dict[str, Any]:
    """The plan as JSON: the schedules best first (the first `top`), today's default beside them."""
    pr = result.problem
    return {
        "problem": {
            "preset": pr.model.name,
            "stages": pr.stages,
            "replicas": pr.replicas,
            "rate_mbit": pr.rate_mbit,
            "rtt_ms": pr.rtt_s * 1000,
            "gpu": pr.gpu.name,
            "gpu_peak_tflops": pr.gpu.peak_tflops,
            "gpu_memory_gb": pr.gpu.memory_gb,
            "mfu": pr.mfu,
            "hop_rtts": pr.hop_rtts,
            "exchange_capped": pr.capped,
            "exchange_goodput": EXCHANGE_GOODPUT["capped" if pr.capped else "uncapped"],
            "dense_tokens_to_target": pr.dense_tokens,
        },
        "candidates": len(result.schedules),
        "schedules": [projection_json(p) for p in result.schedules[:top]],
        "baseline": projection_json(result.baseline),
    }
