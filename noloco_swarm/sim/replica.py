"""One replica of one stage: its weights, inner optimiser and outer-step state.

The simulator holds N x P of these; a networked peer holds one. Both call the same methods in the
same order, which is what lets the swarm end a run with the simulator's exact weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from noloco_swarm.model import Stage, build_stage, flat_params, load_flat_params_, state_hash
from noloco_swarm.protocol import outer
from noloco_swarm.protocol.clock import lr_at
from noloco_swarm.sim.config import RunConfig


class StageReplica:
    """Stage `stage` of a run: fp32 master weights, AdamW (moments stay local), phi and delta."""

    def __init__(self, cfg: RunConfig, stage: int, module: Stage | None = None) -> None:
        self.cfg, self.stage = cfg, stage
        self.module = (
            module if module is not None else build_stage(cfg.model, stage, cfg.num_stages, cfg.seed)
        )
        inner = cfg.inner
        # foreach: one pass over all tensors; on CPU the default per-tensor loop is much slower.
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(),
            lr=inner.lr,
            betas=inner.betas,
            weight_decay=inner.weight_decay,
            foreach=True,
        )
        self.phi = flat_params(self.module)  # slow weights: the weights at the start of the round
        self.delta = torch.zeros_like(self.phi)  # outer momentum

    def lr_at(self, step: int) -> float:
        inner = self.cfg.inner
        return lr_at(
            step,
            base_lr=inner.lr,
            min_lr=inner.min_lr,
            warmup_steps=inner.warmup_steps,
            total_steps=inner.total_steps,
        )

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

    @torch.no_grad()
    def apply_noloco(
        self, thetas: Mapping[int, torch.Tensor], phis: Mapping[int, torch.Tensor] | None = None
    ) -> None:
        """NoLoCo outer step with the group's fast weights (this replica's included), keyed by rank."""
        o = self.cfg.outer
        res = outer.noloco_step(
            self.phi, self.delta, thetas, alpha=o.outer_momentum, beta=o.outer_lr, gamma=o.gamma, phis=phis
        )
        self._set(res)

    @torch.no_grad()
    def apply_diloco(self, thetas: Mapping[int, torch.Tensor]) -> None:
        """DiLoCo outer step with every replica's fast weights, keyed by rank."""
        o = self.cfg.outer
        res = outer.diloco_step(
            self.phi, self.delta, thetas, lr=o.outer_lr, momentum_coef=o.outer_momentum, nesterov=o.nesterov
        )
        self._set(res)

    def _set(self, res: outer.OuterResult) -> None:
        assert isinstance(res.phi, torch.Tensor) and isinstance(res.delta, torch.Tensor)
        self.phi, self.delta = res.phi, res.delta
        load_flat_params_(self.module, self.phi)  # theta = phi: the next round starts from the slow weights

    def state_hash(self) -> str:
        return state_hash(self.module)
