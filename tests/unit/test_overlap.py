"""Overlapped outer step (`outer.overlap_steps`): the carry-over arithmetic, StageReplica's use of
it, the state a checkpoint keeps while an exchange is due, and the config's checks."""

from __future__ import annotations

import copy

import pytest
import torch

from noloco_swarm.model import flat_params, load_flat_params_
from noloco_swarm.peer.checkpoint import Checkpoint
from noloco_swarm.protocol import outer
from noloco_swarm.protocol.config import OuterConfig
from noloco_swarm.train.config import RunConfig
from noloco_swarm.train.replica import StageReplica


def test_carry_over_is_new_phi_plus_the_progress_since_the_snapshot() -> None:
    g = torch.Generator().manual_seed(0)
    phi, snap, now = (torch.randn(50, generator=g) for _ in range(3))
    got = outer.carry_over(phi, now, snap)
    assert torch.equal(got, phi + (now - snap))  # this order of operations, bit for bit
    assert torch.equal(outer.carry_over(phi, snap, snap), phi)  # no progress: the new phi
    lists = outer.carry_over([phi, phi[:3]], [now, now[:3]], [snap, snap[:3]])
    assert torch.equal(lists[0], got) and torch.equal(lists[1], got[:3])
    with pytest.raises(ValueError):
        outer.carry_over(phi, now[:10], snap)


def cfg(method: str = "noloco", k: int = 2, **outer_: object) -> RunConfig:
    return RunConfig.create(
        "tiny",
        method,
        model={"seq_len": 16},
        outer={"inner_steps": 4, "overlap_steps": k, **outer_},  # type: ignore[dict-item]
        num_stages=2,
        num_replicas=2,
    )


def nudged(replica: StageReplica, seed: int) -> torch.Tensor:
    """Move a replica's fast weights as training would; returns them."""
    g = torch.Generator().manual_seed(seed)
    theta = replica.theta() + 0.01 * torch.randn(replica.phi.numel(), generator=g)
    load_flat_params_(replica.module, theta)
    return theta


@pytest.mark.parametrize("method", ["noloco", "diloco"])
def test_replica_applies_the_step_to_the_snapshot_and_keeps_its_progress(method: str) -> None:
    c = cfg(method)
    mine, partner = StageReplica(c, 0), StageReplica(c, 0)
    snapshot, theirs = nudged(mine, 1), nudged(partner, 2)
    blocking = copy.deepcopy(mine)
    apply = "apply_diloco" if method == "diloco" else "apply_noloco"
    getattr(blocking, apply)({0: snapshot, 1: theirs})  # the step as k = 0 takes it
    now = nudged(mine, 3)  # k inner steps of progress since the boundary
    getattr(mine, apply)({0: snapshot, 1: theirs}, snapshot=snapshot)
    assert torch.equal(mine.phi, blocking.phi) and torch.equal(mine.delta, blocking.delta)
    assert torch.equal(flat_params(mine.module), blocking.phi + (now - snapshot))
    assert not torch.equal(flat_params(mine.module), blocking.phi)


def test_state_parts_keep_theta_where_it_differs_from_phi() -> None:
    c = cfg()
    replica = StageReplica(c, 1)
    theta = nudged(replica, 4)
    parts, step = replica.state_parts(with_theta=True)
    assert set(parts) == {"phi", "delta", "exp_avg", "exp_avg_sq", "theta"}
    assert torch.equal(parts["theta"], theta) and not torch.equal(parts["phi"], theta)
    other = StageReplica(c, 1)
    other.load_state_parts(parts, step)
    assert other.state_hash() == replica.state_hash() and torch.equal(other.phi, replica.phi)
    plain, _ = replica.state_parts()
    assert "theta" not in plain
    other.load_state_parts(plain, step)  # without theta the weights are phi
    assert torch.equal(flat_params(other.module), replica.phi)
    ckpt = Checkpoint("run", "h", 1, "peer", 4, 1, (("a",), ("peer",)), 0, 1, 0, step, "x", parts)
    assert Checkpoint.from_dict(ckpt.to_dict()).parts.keys() == parts.keys()
    with pytest.raises(ValueError, match="parts"):
        Checkpoint.from_dict({**ckpt.to_dict(), "parts": {**parts, "extra": theta}})


def test_config_needs_k_below_h_and_an_outer_exchange() -> None:
    assert OuterConfig(inner_steps=4, overlap_steps=3).overlap_steps == 3
    assert OuterConfig.for_method("diloco", overlap_steps=99).overlap_steps == 99  # H = 100
    with pytest.raises(ValueError, match="below inner_steps"):
        OuterConfig(inner_steps=4, overlap_steps=4)
    with pytest.raises(ValueError, match=">= 0"):
        OuterConfig(overlap_steps=-1)
    for method in ("allreduce", "local"):
        with pytest.raises(ValueError, match="does not have"):
            OuterConfig.for_method(method, overlap_steps=1)
    with pytest.raises(ValueError, match="below inner_steps"):
        cfg(k=4)
