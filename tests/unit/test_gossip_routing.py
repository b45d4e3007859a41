"""Group draws and routes: bit-compatible with the official code, and their laws."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from noloco_swarm.protocol import gossip, routing


def official_groups(world_size: int, step: int, group_size: int) -> list[list[int]]:
    """The official code's draw, restated the way it is written there (round-robin appends)."""
    rng = np.random.default_rng(step + 1)
    ranks = [int(x) for x in rng.permutation(world_size)]
    n = len(ranks) // group_size
    out: list[list[int]] = [[] for _ in range(n)]
    for i, x in enumerate(ranks):
        out[i % n].append(x)
    return out


def official_route(sample: int, stage: int, num_stages: int, world: int) -> list[int]:
    rng = np.random.default_rng(sample * num_stages + stage + 1)
    return [int(x) for x in rng.permutation(world)]


@settings(max_examples=300, deadline=None)
@given(
    group_size=st.integers(1, 8),
    groups=st.integers(1, 16),
    step=st.integers(0, 10**7),
)
def test_groups_match_official_draw(group_size: int, groups: int, step: int) -> None:
    world = group_size * groups  # the official code asserts divisibility
    assert gossip.make_groups(world, step, group_size) == official_groups(world, step, group_size)


@settings(max_examples=300, deadline=None)
@given(world=st.integers(1, 40), group_size=st.integers(1, 6), step=st.integers(0, 10**6))
def test_groups_partition_replicas_for_every_count(world: int, group_size: int, step: int) -> None:
    groups = gossip.make_groups(world, step, group_size)
    members = sorted(r for g in groups for r in g)
    assert members == list(range(world))
    if world >= group_size:
        assert len(groups) == world // group_size
        sizes = sorted(len(g) for g in groups)
        assert sizes[0] >= group_size and sizes[-1] - sizes[0] <= 1 + world % group_size
    else:
        assert len(groups) == 1


def test_odd_replica_count_gives_one_larger_group() -> None:
    for step in range(50, 5000, 50):
        sizes = sorted(len(g) for g in gossip.make_groups(5, step, 2))
        assert sizes == [2, 3]
        assert sorted(len(g) for g in gossip.make_groups(7, step, 2)) == [2, 2, 3]


def test_golden_draws() -> None:
    # Frozen values: a change here breaks compatibility with every running swarm.
    assert gossip.make_groups(4, 50, 2) == [[1, 3], [2, 0]]
    assert gossip.make_groups(8, 100, 2) == [[5, 7], [1, 3], [0, 6], [4, 2]]
    assert routing.route_permutation(12345, 1, 4, 8) == [2, 3, 0, 5, 7, 4, 1, 6]


def test_group_of_and_partners_are_symmetric() -> None:
    for step in (50, 100, 150):
        for r in range(6):
            for p in gossip.partners_of(6, step, 2, r):
                assert r in gossip.partners_of(6, step, 2, p)
            assert r in gossip.group_of(6, step, 2, r)


def test_different_steps_draw_different_groups() -> None:
    draws = {tuple(map(tuple, gossip.make_groups(8, t, 2))) for t in range(50, 5050, 50)}
    assert len(draws) > 50


@pytest.mark.parametrize(
    ("args", "message"),
    [((0, 50, 2), "num_replicas"), ((4, -1, 2), "step"), ((4, 50, 0), "group_size")],
)
def test_gossip_rejects_bad_input(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gossip.make_groups(*args)
    with pytest.raises(ValueError, match="replica"):
        gossip.group_of(4, 50, 2, 4)


@settings(max_examples=300, deadline=None)
@given(
    sample=st.integers(0, 10**8),
    num_stages=st.integers(2, 12),
    world=st.integers(1, 33),
    data=st.data(),
)
def test_route_matches_official_and_inverts(
    sample: int, num_stages: int, world: int, data: st.DataObject
) -> None:
    hop = data.draw(st.integers(0, num_stages - 2))
    perm = routing.route_permutation(sample, hop, num_stages, world)
    assert perm == official_route(sample, hop, num_stages, world)
    assert sorted(perm) == list(range(world))
    inverse = routing.inverse_permutation(perm)
    for sender, receiver in enumerate(perm):
        assert inverse[receiver] == sender
        assert routing.sender_of(sample, hop, num_stages, world, receiver) == sender  # official: perm.index


@settings(max_examples=300, deadline=None)
@given(
    sample=st.integers(0, 10**8),
    senders=st.integers(1, 17),
    receivers=st.integers(1, 17),
)
def test_uneven_routes_are_fair_and_consistent(sample: int, senders: int, receivers: int) -> None:
    route = routing.route_uneven(sample, 0, 3, senders, receivers)
    loads = [route.count(r) for r in range(receivers)]
    assert sum(loads) == senders
    assert max(loads) - min(loads) <= 1  # a fair share for every sample index
    for r in range(receivers):
        assert routing.senders_uneven(sample, 0, 3, senders, receivers, r) == [
            d for d in range(senders) if route[d] == r
        ]
    if senders == receivers:
        assert route == routing.route_permutation(sample, 0, 3, senders)


def test_uneven_routes_spread_over_every_receiver() -> None:
    counts = np.zeros(5, dtype=int)
    for k in range(2000):
        for receiver in routing.route_uneven(k, 1, 3, 3, 5):
            counts[receiver] += 1
    assert counts.min() > 0.8 * counts.mean()  # 6000 draws, uniform: each near 1200


def test_full_route_and_sample_index() -> None:
    assert routing.sample_index(3, 2, 8) == 26
    k = routing.sample_index(7, 1, 4)
    path = routing.full_route(k, 2, [4, 4, 4])
    assert path[0] == 2
    assert path[1] == routing.route_permutation(k, 0, 3, 4)[2]
    assert path[2] == routing.route_permutation(k, 1, 3, 4)[path[1]]
    with pytest.raises(ValueError):
        routing.sample_index(0, 8, 8)
    with pytest.raises(ValueError):
        routing.route_permutation(0, 1, 2, 4)  # no hop 1 with 2 stages
    with pytest.raises(ValueError):
        routing.inverse_permutation([0, 0, 1])
