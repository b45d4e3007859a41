"""The reference simulator: replicas of every stage of one model, trained in one process.

It runs the same step plan as the peers (protocol.plan: which rows each replica receives, in which
order, and who averages with whom), the same StageReplica (train/) and the same schedule, with no
network. It is the fast tool for algorithm experiments and the oracle the networked swarm must
reproduce bit for bit. Stages may hold different numbers of replicas
(`RunConfig.stage_replicas`).

Every replica computes the way a peer does: stage by stage, each replica runs the rows the plan
routes to it as one batch in (position, origin) order; the last stage turns per-sample losses
into the backward pass (StageReplica.backward_losses); gradients flow back stage by stage along
the same rows, each replica backpropagating its whole batch once. Activations going forward and
gradients coming back make the round trip of the run's wire format (protocol.wire) where a peer
would send and receive them, in the groups a peer sends them in.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from noloco_swarm.model import Stage, build_stage, flat_params, load_flat_params_
from noloco_swarm.protocol import outer
from noloco_swarm.protocol.plan import Incoming, Row, eval_paths
from noloco_swarm.train.config import RunConfig
from noloco_swarm.train.replica import StageReplica, boundary_of

BatchFn = Callable[[int, int], torch.Tensor]
"""(replica, step) -> LongTensor (B, seq_len + 1): the training windows of a stage-0 replica."""


@dataclass(frozen=True)
class StepStats:
    """What one inner step did."""

    step: int  # inner steps taken after this one
    loss: float  # mean per-sample loss over every replica's samples
    lr: float
    outer_step: bool  # an outer step was applied (or an all-reduce round done) after this inner step


class Simulator:
    """Replicas x stages with AdamW inner steps and the configured outer step."""

    def __init__(self, cfg: RunConfig, batches: BatchFn, device: str | torch.device = "cpu") -> None:
        """`device`: where every replica computes (as a peer's `peer.device`); batches come from
        the CPU and are moved there. On the CPU every move is a no-op."""
        self.cfg = cfg
        self.batches = batches
        self.device = torch.device(device)
        self.run_plan = cfg.run_plan()  # the same rules a peer reads (protocol.plan.RunPlan)
        self.clock = self.run_plan.clock
        self.plan = self.run_plan.step_plan(cfg.replica_counts)
        self.boundary = boundary_of(cfg)  # the wire format's round trip, U and F under subspace
        # Every replica starts from the same weights, derived from the run seed.
        self.replicas: list[list[StageReplica]] = []
        for s, count in enumerate(cfg.replica_counts):
            first = build_stage(cfg.model, s, cfg.num_stages, cfg.seed)
            row = [
                StageReplica(cfg, s, first if d == 0 else copy.deepcopy(first), device=self.device)
                for d in range(count)
            ]
            self.replicas.append(row)
        self.step = 0
        self.tokens = 0
        self.outer_steps = 0
        self.spread_before_outer = 0.0  # weight spread of the fast weights at the last outer step
        # An overlapped outer step under way (outer.overlap_steps > 0): its boundary step and every
        # replica's theta there, [stage][replica]; applied after inner step boundary + k.
        self.pending: tuple[int, list[list[torch.Tensor]]] | None = None
        self.last_window_losses = torch.zeros(0, dtype=torch.float64)  # per window, last evaluate()

    @property
    def stages(self) -> list[list[Stage]]:
        """The stage modules, [stage][replica]."""
        return [[r.module for r in row] for row in self.replicas]

    # ------------------------------------------------------------------ inner step

    def forward_backward(self) -> float:
        """Run every replica's rows through the pipeline and back, microbatch by microbatch in
        ascending order (as the peers backpropagate them); leave gradients in place."""
        cfg, plan, t = self.cfg, self.plan, self.step
        B = cfg.inner.batch_size
        windows = [self.batches(d, t).to(self.device) for d in range(plan.counts[0])]
        for d, w in enumerate(windows):
            if w.shape != (B, cfg.model.seq_len + 1):
                raise ValueError(
                    f"replica {d} got a batch of shape {tuple(w.shape)}, expected ({B}, seq_len + 1)"
                )
        losses = [x for m in range(plan.microbatches) for x in self._microbatch(windows, m)]
        return float(torch.cat(losses).mean())

    def _microbatch(self, windows: list[torch.Tensor], m: int) -> list[torch.Tensor]:
        """Forward and backward of microbatch m through every stage; its per-sample losses, per
        last-stage replica that ran rows of it. A replica the routes give no row of m skips it."""
        cfg, plan, t = self.cfg, self.plan, self.step
        P = cfg.num_stages
        span = plan.span(m)
        # Forward, stage by stage: inputs[r] are replica r's rows, a leaf as a peer receives them.
        inputs: list[torch.Tensor | None] = [w[span.start : span.stop, :-1] for w in windows]
        targets: list[torch.Tensor | None] = [w[span.start : span.stop, 1:] for w in windows]
        leaves: list[list[torch.Tensor | None]] = []
        outputs: list[list[torch.Tensor | None]] = []
        for s in range(P):
            if s > 0:
                index = [
                    {x.row: j for j, x in enumerate(plan.rows(t, s - 1, d, m))}
                    for d in range(plan.counts[s - 1])
                ]
                rows = [plan.rows(t, s, r, m) for r in range(plan.counts[s])]
                # Rows cross the wire: the receiver computes with what the wire format delivers.
                inputs = [
                    self._across(outputs[-1], index, rs, windows).requires_grad_(True) if rs else None
                    for rs in rows
                ]
                targets = [
                    torch.stack([windows[x.row.origin][x.row.position, 1:] for x in rs]) if rs else None
                    for rs in rows
                ]
            leaves.append(inputs)
            last = s == P - 1
            outputs.append(
                [
                    None if x is None else self.replicas[s][r].module(x, targets[r] if last else None)
                    for r, x in enumerate(inputs)
                ]
            )
        losses = outputs[-1]
        for replica, sample_losses in zip(self.replicas[-1], losses, strict=True):
            if sample_losses is not None:
                replica.backward_losses(sample_losses)
        # Backward, stage by stage: each replica's output rows get the gradients of the rows it sent.
        for s in range(P - 2, -1, -1):
            for d, out in enumerate(outputs[s]):
                if out is None:
                    continue
                grad = torch.zeros_like(out)
                for r, sent in plan.sends(t, s, d, m).items():
                    mine = [j for j, x in enumerate(plan.rows(t, s + 1, r, m)) if x.sender == d]
                    back = self.boundary.grads_round_trip(leaves[s + 1][r].grad[mine].cpu())  # over the wire
                    grad[sent] = back.to(self.device)
                out.backward(grad)
        return [x.detach() for x in losses if x is not None]

    def _across(
        self,
        outputs: list[torch.Tensor | None],
        index: list[dict[Row, int]],
        rows: list[Incoming],
        windows: list[torch.Tensor],
    ) -> torch.Tensor:
        """The `rows` one replica receives, as the wire delivers them: each sender's rows make the
        round trip together, as the one message a peer sends a receiver per microbatch (the
        subspace format's matmuls may round a row differently in a batch of another shape). The
        round trip runs on the CPU, where peers encode and decode."""
        got: list[torch.Tensor | None] = [None] * len(rows)
        for sender in sorted({x.sender for x in rows}):
            js = [j for j, x in enumerate(rows) if x.sender == sender]
            out = outputs[sender]
            assert out is not None
            sent = torch.stack([out[index[sender][rows[j].row]].detach() for j in js]).cpu()
            ids = torch.stack([windows[rows[j].row.origin][rows[j].row.position] for j in js]).cpu()
            back = self.boundary.rows_round_trip(sent, ids).to(self.device)
            for i, j in enumerate(js):
                got[j] = back[i]
        return torch.stack(got)  # type: ignore[arg-type]

    def inner_step(self) -> StepStats:
        cfg = self.cfg
        lr = self.replicas[0][0].lr_at(self.step)
        loss = self.forward_backward()
        if self.run_plan.allreduces_gradients:
            self._allreduce_gradients()
        for row in self.replicas:
            for replica in row:
                replica.optimizer_step(lr)
        self.step += 1
        self.tokens += self.plan.counts[0] * cfg.inner.batch_size * cfg.model.seq_len
        applied = False
        if self.pending is not None and self.step == self.pending[0] + cfg.outer.overlap_steps:
            applied = self.finish()
        if self.run_plan.outer_step_due(self.step):
            if cfg.outer.overlap_steps == 0:
                self.outer_step()
                applied = True
            else:  # the exchange starts: its inputs are the thetas of this boundary
                self.pending = (self.step, [[r.theta() for r in row] for row in self.replicas])
        return StepStats(step=self.step, loss=loss, lr=lr, outer_step=applied)

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
        """The blocking outer step that follows inner step `self.step` (a multiple of H), by the plan."""
        self._apply_outer(self.step, [[r.theta() for r in row] for row in self.replicas], carry=False)

    @torch.no_grad()
    def finish(self) -> bool:
        """Apply the overlapped outer step under way, if any, now. `inner_step` calls it k steps
        after the boundary; a run that ends sooner calls it after its last step (as a peer does
        at its end). True if there was one."""
        if self.pending is None:
            return False
        boundary, thetas = self.pending
        self.pending = None
        self._apply_outer(boundary, thetas, carry=True)
        return True

    def _apply_outer(self, boundary: int, all_thetas: list[list[torch.Tensor]], *, carry: bool) -> None:
        """The outer step of `boundary` from every replica's theta there. `carry`: overlapped, so
        each replica keeps the progress it made since its theta (StageReplica's snapshot)."""
        self.spread_before_outer = _spread(all_thetas)
        for row, thetas in zip(self.replicas, all_thetas, strict=True):
            # Every member computes its step from the group's values as they were before the
            # step: phis are read here, before any member of the group updates its own (phi
            # changes only in an outer step, so with overlap it is still the boundary's).
            phis = {d: r.phi for d, r in enumerate(row)}
            for d, replica in enumerate(row):
                plan = self.run_plan.outer_plan(boundary, d, len(row))
                assert plan is not None
                group = {m: thetas[m] for m in plan.group}, {m: phis[m] for m in plan.group}
                replica.apply_outer(plan, *group, snapshot=thetas[d] if carry else None)
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
        """Validation loss/perplexity: each fixed path (protocol.plan.eval_paths), averaged in log space.

        Also the perplexity of the averaged model (every stage's replicas averaged), the model a
        run would publish; `val_tokens`, the predicted tokens the perplexity is over; and
        `val_loss_se`, the standard error of val_loss over windows (the evaluation's own noise).
        """
        paths = eval_paths(self.plan.counts)
        windows = windows.to(self.device)
        per_window = [
            _chain_losses([row[q] for row in self.stages], windows, batch_size) for q in range(paths)
        ]
        per_replica = [float(losses.mean()) for losses in per_window]
        # The evaluation's own sampling error: the standard error over windows of the path-mean loss.
        path_mean = torch.stack(per_window).mean(dim=0)
        self.last_window_losses = path_mean.cpu()  # for paired comparisons of runs on the same windows
        se = float(path_mean.std() / math.sqrt(len(path_mean))) if len(path_mean) > 1 else float("nan")
        averaged = []
        for row in self.stages:
            mean = outer.group_mean({d: flat_params(m) for d, m in enumerate(row)})
            module = copy.deepcopy(row[0])
            load_flat_params_(module, mean)
            averaged.append(module)
        avg_loss = float(_chain_losses(averaged, windows, batch_size).mean())
        val_loss = sum(per_replica) / paths
        return {
            "val_loss": val_loss,
            "val_loss_se": se,
            "val_tokens": len(windows) * (windows.shape[1] - 1),
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


def _chain_losses(stages: list[Stage], windows: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Mean token loss of every validation window along one fixed path of stages (float64)."""
    out = []
    for start in range(0, len(windows), batch_size):
        w = windows[start : start + batch_size]
        x = w[:, :-1]
        for s, module in enumerate(stages):
            x = module(x, w[:, 1:] if s == len(stages) - 1 else None)
        out.append(x.detach().double())
    return torch.cat(out)
