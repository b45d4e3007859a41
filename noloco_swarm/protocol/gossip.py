"""Outer-step group draws: who averages with whom after inner step t.

This is the only file that says which replicas form a group. It follows the official code
(gensyn-ai/noloco, `sparse_optimizer_c.py`): after the step counter is incremented to t
(t = H, 2H, ...), `numpy.random.default_rng(t + 1).permutation(D)` orders the replicas and the
order is cut into `k = D // n` strided groups `order[g::k]`. Every stage uses the same draw, so
a replica's partners at stage s sit at the same ranks as its partners at every other stage.

The official code asserts that D is a multiple of n. We keep its draw bit for bit in that case
and extend it without a new rule: with odd D the strided cut gives one larger group (D = 5,
n = 2: groups of 3 and 2), and with D < n all replicas form one group.
"""

from __future__ import annotations

import numpy as np


def _check(num_replicas: int, step: int, group_size: int) -> None:
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")


def draw_order(num_replicas: int, step: int) -> list[int]:
    """The replica order drawn for the outer step that follows inner step `step`."""
    _check(num_replicas, step, 1)
    return [int(x) for x in np.random.default_rng(step + 1).permutation(num_replicas)]


def make_groups(num_replicas: int, step: int, group_size: int) -> list[list[int]]:
    """Partition replicas 0..num_replicas-1 into outer-step groups for inner step `step`.

    Group g is `order[g::k]` with `k = num_replicas // group_size`; members keep the drawn order
    (the first member is the official code's root). Groups cover every replica exactly once.
    """
    _check(num_replicas, step, group_size)
    order = draw_order(num_replicas, step)
    num_groups = num_replicas // group_size
    if num_groups == 0:
        return [order]
    return [order[g::num_groups] for g in range(num_groups)]


def group_of(num_replicas: int, step: int, group_size: int, replica: int) -> list[int]:
    """The group that `replica` belongs to at inner step `step` (itself included)."""
    if not 0 <= replica < num_replicas:
        raise ValueError(f"replica {replica} is outside 0..{num_replicas - 1}")
    for group in make_groups(num_replicas, step, group_size):
        if replica in group:
            return group
    raise AssertionError("make_groups must cover every replica")  # pragma: no cover


def partners_of(num_replicas: int, step: int, group_size: int, replica: int) -> list[int]:
    """The other members of `replica`'s group, in ascending rank (the order means are reduced in)."""
    return sorted(r for r in group_of(num_replicas, step, group_size, replica) if r != replica)
