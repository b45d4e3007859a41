"""Outer-step group draws: who averages with whom after inner step t.

This is the only file that says which replicas form a group. It follows the official code
(gensyn-ai/noloco, `sparse_optimizer_c.py`): after the step counter is incremented to t
(t = H, 2H, ...), `numpy.random.default_rng(t + 1).permutation(D)` orders the replicas and the
order is cut into `k = D // n` strided groups `order[g::k]`. Every stage uses the same draw, so
a replica's partners at stage s sit at the same ranks as its partners at every other stage.

The official code asserts that D is a multiple of n. We keep its draw bit for bit in that case
and extend it without a new rule: when n does not divide D, the strided cut still makes
k = D // n groups and the D % n replicas left over land one each in the first groups, so
groups hold between n and n + ceil((D % n) / k) members. For pairs (n = 2) that is one group
of 3 when D is odd (D = 5: groups of 3 and 2); for larger groups it can be more than one extra
member (D = 8, n = 3: two groups of 4; D = 5, n = 3: one group of 5). With D < n all replicas
form one group.

Every seed of a run sees the same partner sequence, because the draw depends on the step alone
(as in the official code). `seed` (the run seed, when `outer.seeded_groups` is on) replaces it
with `numpy.random.default_rng([GROUP_TAG, seed, t + 1])`, so that seeds also vary the partners;
leave it None to stay bit-compatible with the official code.
"""

from __future__ import annotations

import numpy as np

# Separates seeded group draws from every other use of the run seed.
GROUP_TAG = 0x6A0_5517


def _check(num_replicas: int, step: int, group_size: int) -> None:
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")


def draw_order(num_replicas: int, step: int, seed: int | None = None) -> list[int]:
    """The replica order drawn for the outer step that follows inner step `step`.

    `seed` None: the official code's draw. Otherwise a draw that also depends on `seed` (>= 0).
    """
    _check(num_replicas, step, 1)
    if seed is None:
        rng = np.random.default_rng(step + 1)
    elif seed < 0:
        raise ValueError(f"a group-draw seed must be >= 0, got {seed}")
    else:
        rng = np.random.default_rng([GROUP_TAG, seed, step + 1])
    return [int(x) for x in rng.permutation(num_replicas)]


def make_groups(num_replicas: int, step: int, group_size: int, seed: int | None = None) -> list[list[int]]:
    """Partition replicas 0..num_replicas-1 into outer-step groups for inner step `step`.

    Group g is `order[g::k]` with `k = num_replicas // group_size`; members keep the drawn order
    (the first member is the official code's root). Groups cover every replica exactly once.
    """
    _check(num_replicas, step, group_size)
    order = draw_order(num_replicas, step, seed)
    num_groups = num_replicas // group_size
    if num_groups == 0:
        return [order]
    return [order[g::num_groups] for g in range(num_groups)]


def group_of(
    num_replicas: int, step: int, group_size: int, replica: int, seed: int | None = None
) -> list[int]:
    """The group that `replica` belongs to at inner step `step` (itself included)."""
    if not 0 <= replica < num_replicas:
        raise ValueError(f"replica {replica} is outside 0..{num_replicas - 1}")
    for group in make_groups(num_replicas, step, group_size, seed):
        if replica in group:
            return group
    raise AssertionError("make_groups must cover every replica")  # pragma: no cover


def partners_of(
    num_replicas: int, step: int, group_size: int, replica: int, seed: int | None = None
) -> list[int]:
    """The other members of `replica`'s group, in ascending rank (the order means are reduced in)."""
    return sorted(r for r in group_of(num_replicas, step, group_size, replica, seed) if r != replica)
