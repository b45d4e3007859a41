"""Outer-step math for NoLoCo and DiLoCo: tensors in, tensors out, no I/O.

Notation (the paper's section 2): theta = fast weights after H inner steps, phi = slow weights
(the weights at the start of the round), delta = outer momentum, alpha = outer momentum
coefficient, beta = outer learning rate, gamma = local-averaging coefficient.

NoLoCo (official `sparse_optimizer_c.py`; paper eq. 2 prints a minus on the first term, the code's
plus is the one that trains):

    delta = alpha*delta + beta*mean_g(theta - phi) + gamma*(mean_g(phi) - phi)
    phi   = phi + delta;  theta = phi

With gamma == beta the two means fold into one, `delta = alpha*delta + beta*(mean_g(theta) - phi)`,
so partners need to exchange only theta (half of what the official code sends).

DiLoCo: the outer gradient `g = phi - mean_all(theta)` is all-reduced over every replica of the
stage, then one of two named steps (`DILOCO_VARIANTS`):

    heavyball (the NoLoCo paper's baseline, official `sparce_loco_optimizer.py`, written there as
               "Nesterov" but heavy-ball):  delta = alpha*delta - beta*g;  phi = phi + delta
    nesterov  (the DiLoCo paper: torch.optim.SGD(nesterov=True), dampening 0):
               buf = alpha*buf + g;  phi = phi - beta*(g + alpha*buf)

Heavy-ball DiLoCo is NoLoCo's one-tensor step with the whole stage as the group.

Overlapped outer step (`outer.overlap_steps = k`, as overlapping DiLoCo variants do): the step is
computed from the thetas of boundary t (the snapshot) and applied after inner step t + k; the k
steps of local progress made meanwhile are carried over onto the new slow weights:

    fast = phi_new + (theta_now - theta_snapshot)        (`carry_over`)

Every function takes a tensor or a sequence of tensors (one per parameter) and returns the same
shape of thing. Group members are passed as a mapping from replica rank to weights and reduced in
ascending rank, so every member of a group computes bit-identical means.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from noloco_swarm.protocol.plausible import SLICE  # 0.5-1 MiB temporaries, reused from the heap

Params = TypeVar("Params", torch.Tensor, Sequence[torch.Tensor])


def _as_list(params: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _like(template: torch.Tensor | Sequence[torch.Tensor], tensors: list[torch.Tensor]):
    return tensors[0] if isinstance(template, torch.Tensor) else tensors


def _zip_map(fn: Callable[..., torch.Tensor], *groups: list[torch.Tensor]) -> list[torch.Tensor]:
    lengths = {len(g) for g in groups}
    if len(lengths) != 1:
        raise ValueError(f"parameter lists differ in length: {sorted(lengths)}")
    out = []
    for tensors in zip(*groups, strict=False):
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1:
            raise ValueError(f"tensor shapes differ: {sorted(shapes)}")
        out.append(fn(*tensors))
    return out


def group_mean(members: Mapping[int, torch.Tensor | Sequence[torch.Tensor]]):
    """Mean over group members, summed in ascending rank so every member gets identical bits."""
    if not members:
        raise ValueError("a group mean needs at least one member")
    ranks = sorted(members)
    lists = [_as_list(members[r]) for r in ranks]

    def mean(*tensors: torch.Tensor) -> torch.Tensor:
        total = tensors[0].clone()
        for t in tensors[1:]:
            total.add_(t)
        return total.div_(len(tensors))

    return _like(members[ranks[0]], _zip_map(mean, *lists))


@dataclass(frozen=True)
class OuterResult:
    """New slow weights (also the new fast weights) and new outer momentum."""

    phi: torch.Tensor | list[torch.Tensor]
    delta: torch.Tensor | list[torch.Tensor]


def noloco_step(
    phi: Params,
    delta: Params,
    thetas: Mapping[int, Params],
    *,
    alpha: float,
    beta: float,
    gamma: float | None = None,
    phis: Mapping[int, Params] | None = None,
) -> OuterResult:
    """NoLoCo outer step for one replica, given the fast weights of every group member.

    `thetas` maps each group member's rank (this replica included) to its fast weights. When
    gamma is None or equal to beta this is the one-tensor form and only thetas are used;
    otherwise `phis` must map the same ranks to their slow weights (the two-tensor form).
    """
    if gamma is None or gamma == beta:
        return noloco_step_theta_only(phi, delta, thetas, alpha=alpha, beta=beta)
    if phis is None:
        raise ValueError("gamma != beta needs the slow weights (phis) of the same group members")
    return noloco_step_two_tensor(phi, delta, thetas, phis, alpha=alpha, beta=beta, gamma=gamma)


def noloco_step_theta_only(
    phi: Params, delta: Params, thetas: Mapping[int, Params], *, alpha: float, beta: float
) -> OuterResult:
    """`delta = alpha*delta + beta*(mean_g(theta) - phi)`: exact when gamma == beta."""
    if isinstance(phi, torch.Tensor) and isinstance(delta, torch.Tensor):
        return _theta_only_flat(phi, delta, thetas, alpha=alpha, beta=beta)
    theta_mean = _as_list(group_mean(thetas))
    new_delta = _zip_map(
        lambda d, m, p: d * alpha + (m - p) * beta, _as_list(delta), theta_mean, _as_list(phi)
    )
    new_phi = _zip_map(torch.add, _as_list(phi), new_delta)
    return OuterResult(phi=_like(phi, new_phi), delta=_like(delta, new_delta))


def _theta_only_flat(
    phi: torch.Tensor, delta: torch.Tensor, thetas: Mapping[int, torch.Tensor], *, alpha: float, beta: float
) -> OuterResult:
    """The one-tensor step on flat tensors into two new tensors (inputs unchanged); see
    `noloco_step_flat_`, which this runs on copies."""
    new_phi, new_delta = phi.clone(), delta.clone()
    noloco_step_flat_(new_phi, new_delta, thetas, alpha=alpha, beta=beta)
    return OuterResult(phi=new_phi, delta=new_delta)


def noloco_step_flat_(
    phi: torch.Tensor, delta: torch.Tensor, thetas: Mapping[int, torch.Tensor], *, alpha: float, beta: float
) -> float:
    """The one-tensor NoLoCo step on flat tensors, in place, slice by slice: element for element
    the same operations in the same order as the general form (so the same bits), without its
    whole-stage temporaries (the mean and three terms of the update: 4x the stage's weights).

    `thetas` must not share memory with `phi` or `delta`. Returns how far phi moved, ||new delta||
    summed in float64 (phi moves by exactly that vector up to one rounding per element)."""
    ranks = sorted(thetas)
    if not ranks:
        raise ValueError("a group mean needs at least one member")
    shapes = {tuple(t.shape) for t in (phi, delta, *thetas.values())}
    if len(shapes) != 1 or phi.dim() != 1:
        raise ValueError(f"flat tensors of one shape expected, got shapes {sorted(shapes)}")
    moved = 0.0
    for lo in range(0, phi.numel(), SLICE):
        part = slice(lo, lo + SLICE)
        mean = thetas[ranks[0]][part].clone()
        for r in ranks[1:]:
            mean.add_(thetas[r][part])
        mean.div_(len(ranks))
        step = delta[part] * alpha + (mean - phi[part]) * beta
        delta[part] = step
        phi[part].add_(step)
        moved += float(step.double().square().sum())
    return math.sqrt(moved)


def noloco_step_two_tensor(
    phi: Params,
    delta: Params,
    thetas: Mapping[int, Params],
    phis: Mapping[int, Params],
    *,
    alpha: float,
    beta: float,
    gamma: float,
) -> OuterResult:
    """`delta = alpha*delta + beta*mean_g(theta - phi) + gamma*(mean_g(phi) - phi)` (the paper's form)."""
    if sorted(phis) != sorted(thetas):
        raise ValueError("gamma != beta needs the slow weights (phis) of the same group members")
    progress = {r: _zip_map(torch.sub, _as_list(thetas[r]), _as_list(phis[r])) for r in thetas}
    progress_mean = _as_list(group_mean(progress))
    phi_mean = _as_list(group_mean(phis))
    new_delta = _zip_map(
        lambda d, g, m, p: d * alpha + g * beta + (m - p) * gamma,
        _as_list(delta),
        progress_mean,
        phi_mean,
        _as_list(phi),
    )
    new_phi = _zip_map(torch.add, _as_list(phi), new_delta)
    return OuterResult(phi=_like(phi, new_phi), delta=_like(delta, new_delta))


DILOCO_VARIANTS = ("heavyball", "nesterov")


def diloco_step(
    phi: Params,
    momentum: Params,
    thetas: Mapping[int, Params],
    *,
    lr: float,
    momentum_coef: float,
    variant: str,
) -> OuterResult:
    """DiLoCo outer step: all-replica average of the outer gradient, then the named momentum step.

    `thetas` maps every replica rank of the stage to its fast weights. `variant` "heavyball" is
    the official code's form, in which `momentum` holds the already-scaled step (the NoLoCo
    paper's baseline); "nesterov" follows torch.optim.SGD(nesterov=True) with dampening 0, in
    which `momentum` is SGD's buffer (the DiLoCo paper).
    """
    if variant not in DILOCO_VARIANTS:
        raise ValueError(f"DiLoCo variant must be one of {DILOCO_VARIANTS}, got {variant!r}")
    grad = _zip_map(torch.sub, _as_list(phi), _as_list(group_mean(thetas)))
    if variant == "nesterov":
        buf = _zip_map(lambda b, g: b * momentum_coef + g, _as_list(momentum), grad)
        new_phi = _zip_map(lambda p, g, b: p - (g + b * momentum_coef) * lr, _as_list(phi), grad, buf)
    else:
        buf = _zip_map(lambda b, g: b * momentum_coef - g * lr, _as_list(momentum), grad)
        new_phi = _zip_map(torch.add, _as_list(phi), buf)
    return OuterResult(phi=_like(phi, new_phi), delta=_like(momentum, buf))


def carry_over(phi: Params, theta: Params, snapshot: Params) -> Params:
    """New fast weights of an overlapped outer step: `phi + (theta - snapshot)`, in that order.

    `phi` is the outer step's new slow weights, `theta` the fast weights now, `snapshot` the fast
    weights at the boundary the step was computed from. The local progress is taken first, so
    with no progress (theta == snapshot) the result is phi (up to the sign of zeros)."""
    return _like(
        phi, _zip_map(lambda p, t, s: p + (t - s), _as_list(phi), _as_list(theta), _as_list(snapshot))
    )


def allreduce_mean(replicas: Mapping[int, Params]):
    """Average (e.g. gradients) over all replicas in ascending rank: the all-reduce baseline."""
    return group_mean(replicas)
