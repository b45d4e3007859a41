"""One replica of one stage: its weights, inner optimiser and outer-step state.

The simulator holds N x P of these; a networked peer holds one. Both call the same methods in the
same order, which is what lets the swarm end a run with the simulator's exact weights.

The loss of a sample is its mean token cross-entropy divided by B, the per-replica batch (the
official code's scaling), so every replica's gradient is the sum over the samples it served;
`backward_losses` is the one place that turns per-sample losses into the backward pass.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from noloco_swarm.model import Stage, build_stage, flat_params, load_flat_params_, state_hash
from noloco_swarm.model.subspace import make_subspace
from noloco_swarm.protocol import outer
from noloco_swarm.protocol.clock import lr_at
from noloco_swarm.protocol.plan import OuterPlan
from noloco_swarm.protocol.plausible import distance
from noloco_swarm.protocol.wire import SUBSPACE, Boundary
from noloco_swarm.train.config import RunConfig


def boundary_of(cfg: RunConfig) -> Boundary:
    """The run's stage boundary (`wire.activations`), with U and F from the seed under subspace;
    what the simulator and every peer encode and decode rows with, on the CPU."""
    fmt = cfg.wire.activations
    return Boundary(fmt, make_subspace(cfg.model, cfg.seed) if fmt == SUBSPACE else None)


class StageReplica:
    """Stage `stage` of a run: fp32 master weights, AdamW (moments stay local), phi and delta."""

    def __init__(
        self, cfg: RunConfig, stage: int, module: Stage | None = None, device: str | torch.device = "cpu"
    ) -> None:
        self.cfg, self.stage = cfg, stage
        module = module if module is not None else build_stage(cfg.model, stage, cfg.num_stages, cfg.seed)
        self.module = module.to(device)  # init is drawn on the CPU, so every device starts equal
        self.device = torch.device(device)
        inner = cfg.inner
        # foreach: one pass over all tensors; on CPU the default per-tensor loop is much slower.
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(),
            lr=inner.lr,
            betas=inner.betas,
            weight_decay=inner.weight_decay,
            foreach=True,
        )
        # Slow weights (the weights at the start of the round) and outer momentum. The one-tensor
        # NoLoCo step changes both in place (no whole-stage temporaries); other steps replace them.
        self.phi = flat_params(self.module)
        self.delta = torch.zeros_like(self.phi)
        self.moved = 0.0  # ||phi after - phi before|| of the last outer step

    def lr_at(self, step: int) -> float:
        inner = self.cfg.inner
        return lr_at(
            step,
            base_lr=inner.lr,
            min_lr=inner.min_lr,
            warmup_steps=inner.warmup_steps,
            total_steps=inner.total_steps,
        )

    def backward_losses(self, losses: torch.Tensor) -> None:
        """Backward from the last stage's per-sample losses, scaled as the official code does."""
        (losses.sum() / self.cfg.inner.batch_size).backward()

    def optimizer_step(self, lr: float) -> None:
        """Clip this stage's gradient (per stage, as the official code does), then one AdamW step."""
        if self.cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.inner.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def theta(self) -> torch.Tensor:
        """The fast weights as one flat fp32 vector (a copy)."""
        return flat_params(self.module)

    def apply_outer(
        self,
        plan: OuterPlan,
        thetas: Mapping[int, torch.Tensor],
        phis: Mapping[int, torch.Tensor] | None = None,
        *,
        snapshot: torch.Tensor | None = None,
    ) -> None:
        """The outer step `plan` names (`plan.update`) with the group's fast weights (and slow
        weights, NoLoCo with gamma != beta only), keyed by rank; `snapshot` as for apply_noloco."""
        if plan.update == "noloco":
            self.apply_noloco(thetas, phis, snapshot=snapshot)
        else:
            self.apply_diloco(thetas, snapshot=snapshot, variant=plan.update)

    @torch.no_grad()
    def apply_noloco(
        self,
        thetas: Mapping[int, torch.Tensor],
        phis: Mapping[int, torch.Tensor] | None = None,
        *,
        snapshot: torch.Tensor | None = None,
    ) -> None:
        """NoLoCo outer step with the group's fast weights (this replica's included), keyed by rank.

        `snapshot`: an overlapped step (`outer.overlap_steps` > 0): thetas are of the boundary,
        whose fast weights were `snapshot`, and the progress made since then is carried over."""
        o = self.cfg.outer
        thetas, phis = self._here(thetas), self._here(phis) if phis is not None else None
        if o.gamma is None or o.gamma == o.outer_lr:  # the one-tensor form: phi and delta in place
            self.moved = outer.noloco_step_flat_(
                self.phi, self.delta, thetas, alpha=o.outer_momentum, beta=o.outer_lr
            )
            self._load(snapshot)
            return
        res = outer.noloco_step(
            self.phi, self.delta, thetas, alpha=o.outer_momentum, beta=o.outer_lr, gamma=o.gamma, phis=phis
        )
        self._set(res, snapshot)

    @torch.no_grad()
    def apply_diloco(
        self,
        thetas: Mapping[int, torch.Tensor],
        *,
        snapshot: torch.Tensor | None = None,
        variant: str | None = None,
    ) -> None:
        """DiLoCo outer step (`variant`, default `outer.diloco_variant`) with every replica's fast
        weights, keyed by rank (`snapshot`: as for `apply_noloco`)."""
        o = self.cfg.outer
        thetas = self._here(thetas)
        res = outer.diloco_step(
            self.phi,
            self.delta,
            thetas,
            lr=o.outer_lr,
            momentum_coef=o.outer_momentum,
            variant=variant or o.diloco_variant,
        )
        self._set(res, snapshot)

    def _here(self, tensors: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Received tensors (on the CPU) moved to this replica's device (a no-op on the CPU)."""
        return {k: v.to(self.device) for k, v in tensors.items()}

    def _set(self, res: outer.OuterResult, snapshot: torch.Tensor | None = None) -> None:
        """Take the step's new phi and delta (new tensors: the old ones are replaced, not changed)."""
        assert isinstance(res.phi, torch.Tensor) and isinstance(res.delta, torch.Tensor)
        self.moved = distance(res.phi, self.phi)
        self.phi, self.delta = res.phi, res.delta
        self._load(snapshot)

    def _load(self, snapshot: torch.Tensor | None) -> None:
        """The fast weights after an outer step, from the new phi."""
        if snapshot is None:  # theta = phi: the next round starts from the slow weights
            load_flat_params_(self.module, self.phi)
        else:  # overlapped: the steps trained since the boundary are kept on top of the new phi
            load_flat_params_(self.module, outer.carry_over(self.phi, self.theta(), snapshot.to(self.device)))

    def state_hash(self) -> str:
        return state_hash(self.module)

    @torch.no_grad()
    def state_parts(self, *, with_theta: bool = False) -> tuple[dict[str, torch.Tensor], int]:
        """Everything a new replica needs to continue as this one from a round boundary.

        Flat fp32 copies keyed by `messages.STATE_PARTS` (phi, delta and the AdamW moments, laid
        out as `flat_params`), and AdamW's step count. Taken at a boundary after a blocking outer
        step, where theta == phi; `with_theta` adds the fast weights as "theta", for a boundary
        whose overlapped outer step is still to come (theta != phi there).
        """
        params = list(self.module.parameters())
        state = [self.optimizer.state.get(p, {}) for p in params]

        def moment(name: str) -> torch.Tensor:
            return torch.cat(
                [
                    s[name].reshape(-1) if name in s else torch.zeros(p.numel())
                    for s, p in zip(state, params, strict=True)
                ]
            )

        adam_step = int(state[0]["step"]) if state and "step" in state[0] else 0
        parts = {
            "phi": self.phi.clone(),
            "delta": self.delta.clone(),
            "exp_avg": moment("exp_avg"),
            "exp_avg_sq": moment("exp_avg_sq"),
        }
        if with_theta:
            parts["theta"] = self.theta()
        return {k: v.cpu() for k, v in parts.items()}, adam_step

    @torch.no_grad()
    def load_state_parts(self, parts: Mapping[str, torch.Tensor], adam_step: int) -> None:
        """Become the replica `state_parts` was taken from (weights = theta if given, else phi;
        moments, step count)."""
        n = self.phi.numel()
        if set(parts) - {"theta"} != {"phi", "delta", "exp_avg", "exp_avg_sq"} or any(
            t.shape != (n,) for t in parts.values()
        ):
            raise ValueError(
                f"state parts must be phi, delta, exp_avg, exp_avg_sq (and maybe theta) of {n} elements each"
            )
        here = {k: v.to(self.device, copy=True) for k, v in parts.items()}
        load_flat_params_(self.module, here.get("theta", here["phi"]))
        self.phi, self.delta = here["phi"], here["delta"]
        offset = 0
        for p in self.module.parameters():
            k = p.numel()
            self.optimizer.state[p] = {
                "step": torch.tensor(float(adam_step)),  # AdamW keeps its step count on the CPU
                "exp_avg": here["exp_avg"][offset : offset + k].view_as(p).clone(),
                "exp_avg_sq": here["exp_avg_sq"][offset : offset + k].view_as(p).clone(),
            }
            offset += k
