"""The reference simulator: N replicas x P stages of one model, trained in one process.

It drives the same protocol functions the peers use (routing.route_permutation for every sample
and hop, gossip.make_groups and outer.noloco_step / diloco_step at every outer step, clock.lr_at
for the schedule), with no network. It is the fast tool for algorithm experiments and the oracle
the networked swarm must reproduce (DESIGN.md section 4).

Batching: replica r of stage s+1 receives, for each batch position i, the sample that the route
of sample k = t*B + i sends it; since every route is a bijection it receives exactly B samples per
step, which it runs as one batch in position order. Gradients flow back along the same rows.
The loss of a sample is its mean token cross-entropy divided by B (the official code's scaling),
so every replica's gradient is the sum over the samples it served.
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from noloco_swarm.model import Stage, build_stage, flat_params, load_flat_params_
from noloco_swarm.protocol import gossip, outer, routing
from noloco_swarm.protocol.clock import StepClock
from noloco_swarm.train.config import RunConfig
from noloco_swarm.train.replica import StageReplica

BatchFn = Callable[[int, int], torch.Tensor]
"""(replica, step) -> LongTensor (B, seq_len + 1): the training windows of a stage-0 replica."""


@dataclass(frozen=True)
class StepStats:
    """What one inner step did."""

    step: int  # inner steps taken after this one
    loss: float  # mean per-sample loss over every replica's samples
    lr: float
    outer_step: bool  # an outer step (or all-reduce round) followed this inner step


class Simulator:
    """N replicas x P stages with AdamW inner steps and the configured outer step."""

    def __init__(self, cfg: RunConfig, batches: BatchFn) -> None:
        self.cfg = cfg
        self.batches = batches
        self.clock = StepClock(cfg.outer.inner_steps, cfg.inner.batch_size, cfg.inner.total_steps)
        P, D = cfg.num_stages, cfg.num_replicas
        # Every replica starts from the same weights, derived from the run seed (DESIGN.md 2).
        first = [build_stage(cfg.model, s, P, cfg.seed) for s in range(P)]
        self.replicas: list[list[StageReplica]] = [
            [StageReplica(cfg, s, first[s] if d == 0 else copy.deepcopy(first[s])) for d in range(D)]
            for s in range(P)
        ]
        self.step = 0
        self.tokens = 0
        self.outer_steps = 0
        self.spread_before_outer = 0.0  # weight spread of the fast weights at the last outer step

    @property
    def stages(self) -> list[list[Stage]]:
        """The stage modules, [stage][replica]."""
        return [[r.module for r in row] for row in self.replicas]

    # ------------------------------------------------------------------ inner step

    def route(self, hop: int) -> list[list[int]]:
        """senders[r][i]: the replica of stage `hop` whose position-i sample goes to replica r."""
        P, D, B = self.cfg.num_stages, self.cfg.num_replicas, self.cfg.inner.batch_size
        if not self.cfg.outer.random_routing:
            return [[r] * B for r in range(D)]
        inverses = [
            routing.inverse_permutation(routing.route_permutation(self.step * B + i, hop, P, D))
            for i in range(B)
        ]
        return [[inverses[i][r] for i in range(B)] for r in range(D)]

    def forward_backward(self) -> float:
        """Forward every replica's batch along its routes, backward, leave gradients in place."""
        P, D, B = self.cfg.num_stages, self.cfg.num_replicas, self.cfg.inner.batch_size
        windows = [self.batches(d, self.step) for d in range(D)]
        for d, w in enumerate(windows):
            if w.shape != (B, self.cfg.model.seq_len + 1):
                raise ValueError(
                    f"replica {d} got a batch of shape {tuple(w.shape)}, expected ({B}, seq_len + 1)"
                )
        inputs = [w[:, :-1] for w in windows]
        targets = [w[:, 1:] for w in windows]
        for s in range(P):
            if s > 0:
                senders = self.route(s - 1)
                inputs = [torch.stack([inputs[senders[r][i]][i] for i in range(B)]) for r in range(D)]
                targets = [torch.stack([targets[senders[r][i]][i] for i in range(B)]) for r in range(D)]
            last = s == P - 1
            inputs = [self.stages[s][r](inputs[r], targets[r] if last else None) for r in range(D)]
        losses = torch.stack(inputs)  # (D, B) per-sample losses at the last stage
        (losses.sum() / B).backward()
        return float(losses.detach().mean())

    def inner_step(self) -> StepStats:
        cfg = self.cfg
        lr = self.replicas[0][0].lr_at(self.step)
        loss = self.forward_backward()
        if cfg.outer.method == "allreduce":
            self._allreduce_gradients()
        for row in self.replicas:
            for replica in row:
                replica.optimizer_step(lr)
        self.step += 1
        self.tokens += cfg.num_replicas * cfg.inner.batch_size * cfg.model.seq_len
        due = cfg.outer.method in ("noloco", "diloco") and self.clock.outer_step_due(self.step)
        if due:
            self.outer_step()
        return StepStats(step=self.step, loss=loss, lr=lr, outer_step=due)

    def _allreduce_gradients(self) -> None:
        for row in self.stages:
            params = [list(m.parameters()) for m in row]
            for tensors in zip(*params, strict=True):
                mean = outer.allreduce_mean({d: p.grad for d, p in enumerate(tensors)})
                for p in tensors:
                    p.grad = mean.clone()

    # ------------------------------------------------------------------ outer step

    @torch.no_grad()
    def outer_step(self) -> None:
        """The outer step that follows inner step `self.step` (a multiple of H)."""
        o, D = self.cfg.outer, self.cfg.num_replicas
        all_thetas = [{d: r.theta() for d, r in enumerate(row)} for row in self.replicas]
        self.spread_before_outer = _spread([list(t.values()) for t in all_thetas])
        for row, thetas in zip(self.replicas, all_thetas, strict=True):
            if o.method == "diloco":
                for replica in row:
                    replica.apply_diloco(thetas)
                continue
            # Every member computes its step from the group's values as they were before the
            # step: phis are read here, before any member of the group updates its own.
            for group in gossip.make_groups(D, self.step, o.group_size):
                phis = {m: row[m].phi for m in group}
                for d in group:
                    row[d].apply_noloco({m: thetas[m] for m in group}, phis)
        self.outer_steps += 1

    # ------------------------------------------------------------------ inspection

    def replica_hashes(self) -> list[list[str]]:
        """state_hash of every stage replica, [stage][replica]."""
        return [[r.state_hash() for r in row] for row in self.replicas]

    def state_hash(self) -> str:
        """One hash over every replica of every stage, in (stage, replica) order."""
        h = hashlib.sha256()
        for row in self.replica_hashes():
            for digest in row:
                h.update(digest.encode())
        return h.hexdigest()

    @torch.no_grad()
    def weight_spread(self) -> float:
        """RMS distance of every replica's weights to its stage mean (0 when replicas agree)."""
        return _spread([[flat_params(m) for m in row] for row in self.stages])

    @torch.no_grad()
    def evaluate(self, windows: torch.Tensor, batch_size: int = 16) -> dict[str, float]:
        """Validation loss/perplexity: each replica on its own fixed path, averaged in log space.

        Also the perplexity of the averaged model (every stage's replicas averaged), the model a
        run would publish.
        """
        D = self.cfg.num_replicas
        per_replica = [_chain_loss([row[d] for row in self.stages], windows, batch_size) for d in range(D)]
        averaged = []
        for row in self.stages:
            mean = outer.group_mean({d: flat_params(m) for d, m in enumerate(row)})
            module = copy.deepcopy(row[0])
            load_flat_params_(module, mean)
            averaged.append(module)
        avg_loss = _chain_loss(averaged, windows, batch_size)
        val_loss = sum(per_replica) / D
        return {
            "val_loss": val_loss,
            "val_ppl": math.exp(val_loss),
            "val_ppl_avg_model": math.exp(avg_loss),
            "val_ppl_best_replica": math.exp(min(per_replica)),
        }


def _spread(stages: list[list[torch.Tensor]]) -> float:
    """RMS distance of each replica's flat weights to the mean of its stage, over all stages."""
    total, count = 0.0, 0
    for row in stages:
        flats = torch.stack(row).double()
        total += float(((flats - flats.mean(dim=0)) ** 2).sum())
        count += flats.numel()
    return math.sqrt(total / count)


def _chain_loss(stages: list[Stage], windows: torch.Tensor, batch_size: int) -> float:
    """Mean token loss of one fixed path of stages over the validation windows."""
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        w = windows[start : start + batch_size]
        x = w[:, :-1]
        for s, module in enumerate(stages):
            x = module(x, w[:, 1:] if s == len(stages) - 1 else None)
        total += float(x.sum())
        count += len(w)
    return total / count


def timed_steps(sim: Simulator, steps: int) -> tuple[list[StepStats], float]:
    """Run `steps` inner steps; return their stats and the wall seconds they took."""
    start = time.perf_counter()
    stats = [sim.inner_step() for _ in range(steps)]
    return stats, time.perf_counter() - start
