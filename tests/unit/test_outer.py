"""Outer-step laws: one-tensor form, whole-stage groups, groups of one, DiLoCo forms."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from noloco_swarm.protocol import outer


def weights(seed: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


SHAPES = [(3, 4), (5,), (2, 2, 2)]


@settings(max_examples=60, deadline=None)
@given(
    members=st.integers(1, 5),
    seed=st.integers(0, 10**6),
    alpha=st.floats(0.0, 0.95),
    beta=st.floats(0.05, 1.5),
)
def test_one_tensor_form_equals_two_tensor_form(members: int, seed: int, alpha: float, beta: float) -> None:
    phis = {r: weights(seed + 10 * r, SHAPES) for r in range(members)}
    thetas = {r: weights(seed + 10 * r + 1, SHAPES) for r in range(members)}
    delta = weights(seed + 999, SHAPES)
    one = outer.noloco_step(phis[0], delta, thetas, alpha=alpha, beta=beta)
    two = outer.noloco_step_two_tensor(phis[0], delta, thetas, phis, alpha=alpha, beta=beta, gamma=beta)
    assert not all(torch.equal(a, b) for a, b in zip(one.phi, phis[0], strict=True))  # it moved
    for a, b in zip(one.phi, two.phi, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(one.delta, two.delta, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_whole_stage_group_reduces_to_diloco_heavy_ball() -> None:
    # Replicas that always average over the whole stage share phi; NoLoCo then is DiLoCo's outer
    # step in the official heavy-ball form with momentum alpha and lr beta.
    phi = weights(1, SHAPES)
    thetas = {r: weights(100 + r, SHAPES) for r in range(4)}
    delta = weights(7, SHAPES)
    nl = outer.noloco_step(phi, delta, thetas, alpha=0.5, beta=0.7)
    dl = outer.diloco_step(phi, delta, thetas, lr=0.7, momentum_coef=0.5, variant="heavyball")
    for a, b in zip(nl.phi + nl.delta, dl.phi + dl.delta, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_group_of_one_moves_by_own_progress_only() -> None:
    phi, theta = weights(1, SHAPES), weights(2, SHAPES)
    zero = [torch.zeros_like(p) for p in phi]
    res = outer.noloco_step(phi, zero, {0: theta}, alpha=0.5, beta=0.7, gamma=0.3, phis={0: phi})
    for p, t, new in zip(phi, theta, res.phi, strict=True):
        torch.testing.assert_close(new, p + 0.7 * (t - p))
    # beta = 1 and no momentum: the replica simply keeps its fast weights
    res = outer.noloco_step(phi, zero, {0: theta}, alpha=0.0, beta=1.0)
    for t, new in zip(theta, res.phi, strict=True):
        torch.testing.assert_close(new, t)


def test_gamma_pulls_slow_weights_together() -> None:
    phis = {0: [torch.zeros(3)], 1: [torch.full((3,), 2.0)]}
    thetas = {0: [torch.zeros(3)], 1: [torch.full((3,), 2.0)]}  # no progress on either
    res = outer.noloco_step(phis[0], [torch.zeros(3)], thetas, alpha=0.0, beta=0.7, gamma=0.5, phis=phis)
    torch.testing.assert_close(res.phi[0], torch.full((3,), 0.5))  # moved half-way to the mean 1.0


def test_partners_compute_identical_bits() -> None:
    thetas = {3: weights(1, SHAPES), 8: weights(2, SHAPES)}
    swapped = {8: thetas[8], 3: thetas[3]}
    a = outer.group_mean(thetas)
    b = outer.group_mean(swapped)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_single_tensor_inputs_and_momentum_accumulates() -> None:
    phi, theta, delta = torch.zeros(4), torch.ones(4), torch.zeros(4)
    r1 = outer.noloco_step(phi, delta, {0: theta}, alpha=0.5, beta=1.0)
    assert isinstance(r1.phi, torch.Tensor)
    torch.testing.assert_close(r1.delta, torch.ones(4))
    r2 = outer.noloco_step(r1.phi, r1.delta, {0: r1.phi + 1}, alpha=0.5, beta=1.0)
    torch.testing.assert_close(r2.delta, torch.full((4,), 1.5))
    torch.testing.assert_close(r2.phi, torch.full((4,), 2.5))


def test_diloco_nesterov_matches_torch_sgd() -> None:
    # The DiLoCo paper's outer optimiser: SGD(lr 0.7, momentum 0.9, nesterov) on the pseudo-gradient.
    phi = weights(3, SHAPES)
    buf = [torch.zeros_like(p) for p in phi]
    params = [torch.nn.Parameter(p.clone()) for p in phi]
    sgd = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    for round_ in range(3):
        thetas = {r: weights(50 * round_ + r, SHAPES) for r in range(3)}
        res = outer.diloco_step(phi, buf, thetas, lr=0.7, momentum_coef=0.9, variant="nesterov")
        phi, buf = res.phi, res.delta
        mean = outer.group_mean(thetas)
        for p, m in zip(params, mean, strict=True):
            p.grad = p.detach() - m
        sgd.step()
        for p, q in zip(params, phi, strict=True):
            torch.testing.assert_close(p.detach(), q, rtol=1e-12, atol=1e-12)


def test_diloco_heavyball_matches_the_official_update() -> None:
    # The NoLoCo paper's baseline as the official code writes it (sparce_loco_optimizer.py), per
    # parameter: grad = mean_r(gp - p_r); gm += (momentum - 1)*gm - lr*grad; gp += gm; p = gp.
    phi = weights(4, SHAPES)
    gm = [torch.zeros_like(p) for p in phi]
    gp = [p.clone() for p in phi]
    delta = [torch.zeros_like(p) for p in phi]
    momentum, lr = 0.3, 0.7
    for round_ in range(4):
        thetas = {r: weights(70 * round_ + r, SHAPES) for r in range(4)}
        res = outer.diloco_step(phi, delta, thetas, lr=lr, momentum_coef=momentum, variant="heavyball")
        phi, delta = res.phi, res.delta
        for i, (g, m) in enumerate(zip(gp, gm, strict=True)):
            grad = sum(g - thetas[r][i] for r in sorted(thetas)) / len(thetas)
            m.add_((momentum - 1.0) * m - lr * grad)
            g.add_(m)
        for a, b in zip(phi, gp, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        for a, b in zip(res.delta, gm, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_diloco_variants_differ_and_unknown_is_refused() -> None:
    phi, delta = weights(5, SHAPES), weights(6, SHAPES)
    thetas = {r: weights(200 + r, SHAPES) for r in range(2)}
    hb = outer.diloco_step(phi, delta, thetas, lr=0.7, momentum_coef=0.9, variant="heavyball")
    nv = outer.diloco_step(phi, delta, thetas, lr=0.7, momentum_coef=0.9, variant="nesterov")
    assert not all(torch.allclose(a, b) for a, b in zip(hb.phi, nv.phi, strict=True))
    with pytest.raises(ValueError, match="variant"):
        outer.diloco_step(phi, delta, thetas, lr=0.7, momentum_coef=0.9, variant="adam")


def test_bad_inputs_raise() -> None:
    phi = weights(1, SHAPES)
    with pytest.raises(ValueError, match="slow weights"):
        outer.noloco_step(phi, phi, {0: phi}, alpha=0.5, beta=0.7, gamma=0.1)
    with pytest.raises(ValueError, match="shapes"):
        outer.noloco_step(phi, phi, {0: weights(1, [(1,), (5,), (2, 2, 2)])}, alpha=0.5, beta=0.7)
    with pytest.raises(ValueError, match="length"):
        outer.noloco_step(phi, phi, {0: phi[:2]}, alpha=0.5, beta=0.7)
    with pytest.raises(ValueError, match="at least one"):
        outer.group_mean({})


def test_the_flat_step_in_place_is_the_general_form_bit_for_bit() -> None:
    """The peers' and the simulator's step (flat tensors, in place, slice by slice) equals the
    general per-parameter form element for element, across slice edges, and says how far phi moved."""
    g = torch.Generator().manual_seed(3)
    n = 2 * outer.SLICE + 777
    phi, delta = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.01
    thetas = {r: phi + torch.randn(n, generator=g) * 0.02 for r in (4, 1, 2)}
    kept = {r: t.clone() for r, t in thetas.items()}
    general = outer.noloco_step([phi], [delta], {r: [t] for r, t in thetas.items()}, alpha=0.5, beta=0.7)
    flat = outer.noloco_step(phi, delta, thetas, alpha=0.5, beta=0.7)  # new tensors, inputs unchanged
    new_phi, new_delta = phi.clone(), delta.clone()
    moved = outer.noloco_step_flat_(new_phi, new_delta, thetas, alpha=0.5, beta=0.7)
    for got in ((flat.phi, flat.delta), (new_phi, new_delta)):
        assert torch.equal(got[0], general.phi[0]) and torch.equal(got[1], general.delta[0])
    assert all(torch.equal(thetas[r], kept[r]) for r in thetas)
    assert moved == pytest.approx(float((new_phi.double() - phi.double()).norm()), rel=1e-6)
    with pytest.raises(ValueError, match="one shape"):
        outer.noloco_step_flat_(phi.clone(), delta.clone(), {0: phi[:-1]}, alpha=0.5, beta=0.7)
