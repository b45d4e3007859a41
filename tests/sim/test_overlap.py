"""The simulator's overlapped outer step: k = 0 is today's blocking run bit for bit, and k > 0
applies the boundary's step k inner steps later with the progress made meanwhile carried over."""

from __future__ import annotations

import copy

import pytest
import torch

from noloco_swarm.model import flat_params
from noloco_swarm.protocol import outer
from noloco_swarm.sim.engine import Simulator
from noloco_swarm.train.config import RunConfig
from noloco_swarm.train.layering import build_config
from tests.sim.test_simulator import synthetic

CASES = [("noloco", None), ("noloco", 0.3), ("diloco", None)]


def blocking_run(cfg: RunConfig, steps: int) -> Simulator:
    """The blocking schedule as it was before overlap existed, driven from the simulator's parts:
    forward and backward, every replica's optimizer step, and the outer step right after every
    H-th inner step. (A recorded hash would pin this CPU's float kernels: AVX2 and AVX-512
    machines round differently.)"""
    sim = Simulator(cfg, synthetic(cfg))
    for _ in range(steps):
        lr = sim.replicas[0][0].lr_at(sim.step)
        sim.forward_backward()
        for row in sim.replicas:
            for replica in row:
                replica.optimizer_step(lr)
        sim.step += 1
        if sim.step % cfg.outer.inner_steps == 0:
            sim.outer_step()
    return sim


def config(method: str, k: int, gamma: float | None = None) -> RunConfig:
    outer_ = {"inner_steps": 4, "overlap_steps": k, **({"gamma": gamma} if gamma is not None else {})}
    return RunConfig.create(
        "tiny",
        method,
        model={"seq_len": 32},
        inner={"batch_size": 4, "warmup_steps": 5, "total_steps": 40},
        outer=outer_,  # type: ignore[arg-type]
        num_stages=2,
        num_replicas=4 if method == "diloco" else 2,
        eval_windows=8,
        eval_every=0,
    )


@pytest.mark.parametrize(("method", "gamma"), CASES)
def test_k0_is_the_blocking_run_bit_for_bit(method: str, gamma: float | None) -> None:
    """9 inner steps with H = 4: two outer steps, then one inner step."""
    sim = Simulator(config(method, 0, gamma), synthetic(config(method, 0, gamma)))
    applied = [sim.inner_step().outer_step for _ in range(9)]
    assert [t + 1 for t, a in enumerate(applied) if a] == [4, 8]
    assert sim.pending is None and not sim.finish()
    reference = blocking_run(config(method, 0, gamma), 9)
    assert reference.outer_steps == 2
    assert sim.state_hash() == reference.state_hash()


@pytest.mark.parametrize("method", ["noloco", "diloco"])
def test_overlap_applies_the_boundary_step_k_steps_later_and_carries_progress(method: str) -> None:
    cfg = config(method, 2)
    sim = Simulator(cfg, synthetic(cfg))
    applied = [sim.inner_step().outer_step for _ in range(4)]
    assert not any(applied) and sim.pending is not None and sim.pending[0] == 4
    snapshots = [[t.clone() for t in row] for row in sim.pending[1]]
    # The step as k = 0 would have taken it (no progress to carry), from the same thetas.
    blocking = copy.deepcopy(sim)
    assert blocking.finish()
    # The weights the replicas reach in the k overlapped steps: inner steps read no phi or delta.
    free = copy.deepcopy(sim)
    free.pending = None
    free.inner_step(), free.inner_step()
    assert [sim.inner_step().outer_step for _ in range(2)] == [False, True]
    assert sim.pending is None and sim.outer_steps == 1
    for s, row in enumerate(sim.replicas):
        for d, replica in enumerate(row):
            want_phi = blocking.replicas[s][d].phi
            assert torch.equal(replica.phi, want_phi)
            assert torch.equal(replica.delta, blocking.replicas[s][d].delta)
            now = flat_params(free.replicas[s][d].module)
            assert torch.equal(flat_params(replica.module), outer.carry_over(want_phi, now, snapshots[s][d]))
    # Replicas of a pair share phi after the step but keep their own progress on top of it.
    assert torch.equal(sim.replicas[0][0].phi, sim.replicas[0][1].phi)
    assert sim.replica_hashes()[0][0] != sim.replica_hashes()[0][1]


def test_a_run_that_ends_before_k_steps_are_up_applies_at_its_end() -> None:
    cfg = config("noloco", 3)
    sim = Simulator(cfg, synthetic(cfg))
    for _ in range(9):
        sim.inner_step()
    assert sim.outer_steps == 1 and sim.pending is not None and sim.pending[0] == 8
    assert sim.finish() and sim.outer_steps == 2 and sim.pending is None and not sim.finish()
    k0 = Simulator(config("noloco", 0), synthetic(cfg))
    for _ in range(9):
        k0.inner_step()
    assert sim.state_hash() != k0.state_hash()


def test_overlap_is_a_config_key_with_a_clear_refusal() -> None:
    base = {"outer.inner_steps": "5", "num_stages": "2", "num_replicas": "2"}
    cfg = build_config("tiny", "noloco", assignments={**base, "outer.overlap_steps": "2"}, env={})
    assert cfg.outer.overlap_steps == 2
    with pytest.raises((SystemExit, ValueError)) as e:
        build_config("tiny", "noloco", assignments={**base, "outer.overlap_steps": "5"}, env={})
    assert "below inner_steps" in str(e.value) or e.type is SystemExit
