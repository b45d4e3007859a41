"""Subspace boundaries in the simulator: every outer step (NoLoCo, both DiLoCo variants) averages
the trainable factors, so the weights stay in the subspace and every hop's rows can be sent."""

from __future__ import annotations

import copy

import pytest
import torch

from noloco_swarm.model import flat_params, load_flat_params_
from noloco_swarm.model.subspace import SpanEmbedding, SpanLinear
from noloco_swarm.protocol import outer, subspace
from noloco_swarm.sim.engine import Simulator
from noloco_swarm.train.config import RunConfig

K, T, STEPS = 16, 16, 5


def run(method: str, variant: str = "heavyball") -> Simulator:
    cfg = RunConfig.create(
        "tiny",
        method,
        model={"seq_len": T, "subspace_rank": K},
        inner={"batch_size": 2, "warmup_steps": 1, "total_steps": 10, "weight_decay": 0.1},
        outer={"inner_steps": 2, "diloco_variant": variant},
        wire={"activations": "subspace"},
        num_stages=3,
        num_replicas=2,
    )
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.model.vocab_size, (2, STEPS, 2, T + 1), generator=g)
    sim = Simulator(cfg, lambda d, t: data[d, t])
    for _ in range(STEPS):  # every hop's rows pass the sender's check, or this raises OutsideSubspace
        sim.inner_step()
    return sim


def off_subspace(module: torch.nn.Module, basis: torch.Tensor) -> float:
    """The largest share of a constrained weight's columns outside span(U)."""
    worst = 0.0
    for m in module.modules():
        if isinstance(m, SpanLinear | SpanEmbedding):
            w = m.effective_weight().detach()
            w = w if isinstance(m, SpanLinear) else w.T
            worst = max(worst, float((w - basis @ (basis.T @ w)).norm() / w.norm()))
    return worst


@pytest.mark.parametrize(
    ("method", "variant"), [("noloco", ""), ("diloco", "heavyball"), ("diloco", "nesterov")]
)
def test_outer_steps_keep_the_weights_in_the_subspace(method: str, variant: str, one_thread: None) -> None:
    sim = run(method, variant or "heavyball")
    assert sim.outer_steps == 2 and sim.weight_spread() > 0  # averaged twice, then apart again
    space = sim.boundary.space
    assert space is not None
    windows = torch.randint(
        0, sim.cfg.model.vocab_size, (2, T + 1), generator=torch.Generator().manual_seed(1)
    )
    for s in (0, 1):  # the stages whose output crosses a boundary
        row = sim.stages[s]
        # The mean of the replicas' trainable parameters (what an all-reduce or a group of all
        # averages) is a model of the same form, so it is in the subspace too.
        mean = copy.deepcopy(row[0])
        load_flat_params_(mean, outer.group_mean({d: flat_params(m) for d, m in enumerate(row)}))
        for module in [*row, mean]:
            assert off_subspace(module, space.basis) < 1e-5
        with torch.no_grad():
            x = windows[:, :-1]
            for before in range(s):
                x = sim.stages[before][0](x)
            x = mean(x)
        assert subspace.outside(space, x, windows[:, :-1]) < subspace.SEND_TOLERANCE / 10


def test_the_last_stage_is_unconstrained_and_a_run_is_deterministic(one_thread: None) -> None:
    sim = run("noloco")
    last = sim.stages[-1][0]
    assert not any(isinstance(m, SpanLinear | SpanEmbedding) for m in last.modules())
    again = run("noloco")
    assert sim.replica_hashes() == again.replica_hashes(), "subspace boundaries are deterministic"
