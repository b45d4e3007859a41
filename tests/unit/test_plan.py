"""The step plan: every row crosses every stage exactly once, senders and receivers agree, and
with equal replica counts the routes are the official code's draws."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from noloco_swarm.protocol import gossip, routing
from noloco_swarm.protocol.plan import (
    Row,
    ShardLayout,
    StepPlan,
    eval_paths,
    exchange_key,
    join_round,
    outer_plan,
)

counts_st = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)


@settings(max_examples=60, deadline=None)
@given(counts=counts_st, batch=st.integers(1, 5), step=st.integers(0, 1000), fixed=st.booleans())
def test_every_row_crosses_every_stage_once_and_both_sides_agree(
    counts: tuple[int, ...], batch: int, step: int, fixed: bool
) -> None:
    plan = StepPlan.of(counts, batch, random_routing=not fixed)
    every_row = sorted(Row(i, o) for o in range(counts[0]) for i in range(batch))
    for s in range(len(counts)):
        held = [plan.rows(step, s, r) for r in range(counts[s])]
        assert sorted(x.row for rows in held for x in rows) == every_row
        for rows in held:  # each replica runs its rows in (position, origin) order
            assert [x.row for x in rows] == sorted(x.row for x in rows)
        if s + 1 < len(counts):
            for d in range(counts[s]):
                mine = plan.rows(step, s, d)
                for r, indices in plan.sends(step, s, d).items():
                    assert [mine[j].row for j in indices] == plan.expects_from(step, s + 1, r, d)
                sent = sorted(j for indices in plan.sends(step, s, d).values() for j in indices)
                assert sent == list(range(len(mine)))


@given(d=st.integers(1, 6), batch=st.integers(1, 4), step=st.integers(0, 500), stages=st.integers(2, 4))
def test_equal_counts_follow_the_official_permutation(d: int, batch: int, step: int, stages: int) -> None:
    plan = StepPlan.of((d,) * stages, batch)
    for hop in range(stages - 1):
        for sender in range(d):
            for r, indices in plan.sends(step, hop, sender).items():
                for j in indices:
                    i = plan.rows(step, hop, sender)[j].row.position
                    k = routing.sample_index(step, i, batch)
                    assert routing.route_permutation(k, hop, stages, d)[sender] == r
        for r in range(d):  # one row per position: a replica holds exactly B rows
            assert [x.row.position for x in plan.rows(step, hop + 1, r)] == list(range(batch))


def test_fixed_routing_keeps_each_replicas_chain() -> None:
    plan = StepPlan.of((3, 3, 3), 2, random_routing=False)
    assert all({x.row.origin for x in plan.rows(7, 2, r)} == {r} for r in range(3))
    assert plan.sends(7, 0, 1) == {1: [0, 1]}


def test_uneven_receivers_get_fair_shares() -> None:
    plan = StepPlan.of((3, 2), 4)
    loads = [len(plan.rows(5, 1, r)) for r in range(2)]
    assert sum(loads) == 12 and max(loads) - min(loads) <= 4
    fewer = StepPlan.of((2, 3), 4)  # S < R: a receiver may get nothing at one position
    assert sum(len(fewer.rows(5, 1, r)) for r in range(3)) == 8


def test_bad_queries_are_errors() -> None:
    plan = StepPlan.of((2, 2), 2)
    with pytest.raises(ValueError, match="no replica 2"):
        plan.rows(0, 1, 2)
    with pytest.raises(ValueError, match="expects none"):
        plan.expects(0, 0, 0)
    with pytest.raises(ValueError, match="sends nothing"):
        plan.sends(0, 1, 0)
    with pytest.raises(ValueError, match="at least one replica"):
        StepPlan.of((2, 0), 2)


@given(n=st.integers(1, 9), step=st.integers(0, 10_000), size=st.integers(1, 4))
def test_outer_groups_partition_the_stage_and_one_side_calls(n: int, step: int, size: int) -> None:
    plans = [outer_plan("noloco", size, n, step, r) for r in range(n)]
    assert all(p is not None and p.rank in p.group and list(p.group) == sorted(p.group) for p in plans)
    groups = {p.group for p in plans if p is not None}
    assert sorted(r for g in groups for r in g) == list(range(n))
    assert groups == {tuple(sorted(g)) for g in gossip.make_groups(n, step, size)}
    for p in plans:
        assert p is not None
        for m in p.partners:
            other = plans[m]
            assert other is not None and p.calls(m) != other.calls(p.rank)  # exactly one side calls


def test_diloco_takes_the_whole_stage_and_shards_beyond_two() -> None:
    two, three = outer_plan("diloco", 2, 2, 10, 0), outer_plan("diloco", 2, 3, 10, 2)
    assert two is not None and two.group == (0, 1) and not two.sharded
    assert three is not None and three.group == (0, 1, 2) and three.sharded and three.partners == (0, 1)
    assert outer_plan("local", 2, 3, 10, 0) is None and outer_plan("allreduce", 2, 3, 10, 0) is None


def test_keys_shards_join_round_and_eval_paths() -> None:
    assert exchange_key(2, 150) == (2, 150) and exchange_key(2, 150, 1) == (2, 150, 1)
    assert exchange_key(2, 150) < exchange_key(2, 150, 1) < exchange_key(2, 150, 2) < exchange_key(3, 200)
    layout = ShardLayout(10, 3)
    assert (layout.size, layout.padded) == (4, 12)
    assert join_round(0, 50) == 2 and join_round(99, 50) == 3 and join_round(100, 50) == 4
    assert eval_paths((3, 2, 4)) == 2


@st.composite
def microbatch_cuts(draw: st.DrawFn) -> tuple[int, int, tuple[int, ...], list[range]]:
    """A batch, M, the sizes to give the plan (empty: even) and the positions of each microbatch."""
    batch = draw(st.integers(1, 9))
    if draw(st.booleans()):  # an even split
        m_count = draw(st.sampled_from([m for m in range(1, batch + 1) if batch % m == 0]))
        per = batch // m_count
        return batch, m_count, (), [range(m * per, (m + 1) * per) for m in range(m_count)]
    cuts = sorted(draw(st.sets(st.integers(1, batch - 1), max_size=batch - 1))) if batch > 1 else []
    edges = [0, *cuts, batch]
    sizes = tuple(b - a for a, b in itertools.pairwise(edges))
    return batch, len(sizes), sizes, [range(a, b) for a, b in itertools.pairwise(edges)]


@settings(max_examples=60, deadline=None)
@given(counts=counts_st, cut=microbatch_cuts(), step=st.integers(0, 1000))
def test_microbatches_partition_every_replicas_rows_and_sends(
    counts: tuple[int, ...], cut: tuple[int, int, tuple[int, ...], list[range]], step: int
) -> None:
    """Microbatch m holds exactly the rows at positions [m B/M, (m+1) B/M), or the m-th run of
    the sizes given, in batch order, at every stage; what a sender sends per microbatch is what the
    receiver expects of it."""
    batch, m_count, sizes, spans = cut
    whole = StepPlan.of(counts, batch)
    plan = StepPlan.of(counts, batch, microbatches=m_count, sizes=sizes)
    assert [plan.span(m) for m in range(m_count)] == spans
    for s, count in enumerate(counts):
        for r in range(count):
            parts = [plan.rows(step, s, r, m) for m in range(m_count)]
            assert tuple(x for part in parts for x in part) == whole.rows(step, s, r)
            for m, part in enumerate(parts):
                assert all(
                    x.row.position in spans[m] and plan.microbatch_of(x.row.position) == m for x in part
                )
            if s < len(counts) - 1:
                for m, part in enumerate(parts):
                    for receiver, sent in plan.sends(step, s, r, m).items():
                        rows = [part[j].row for j in sent]
                        assert rows == plan.expects_from(step, s + 1, receiver, r, m)


def test_microbatches_must_divide_the_batch() -> None:
    with pytest.raises(ValueError, match="do not divide"):
        StepPlan.of((2, 2), 4, microbatches=3)
    with pytest.raises(ValueError, match="no microbatch 2"):
        StepPlan.of((2, 2), 4, microbatches=2).rows(0, 0, 0, 2)
    with pytest.raises(ValueError, match="no batch position 4"):
        StepPlan.of((2, 2), 4, microbatches=2).microbatch_of(4)


@pytest.mark.parametrize("sizes", [(1, 2), (1, 2, 2), (0, 2, 2), (3, 3, -2)])
def test_microbatch_sizes_must_cut_the_batch_into_m_runs(sizes: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="must be 3 sizes of at least 1 that sum to the batch of 4"):
        StepPlan.of((2, 2), 4, microbatches=3, sizes=sizes)


@st.composite
def plans_around(draw: st.DrawFn) -> tuple[StepPlan, StepPlan]:
    """A plan, and the same plan routing around some replicas of any stage (never a whole stage)."""
    counts = draw(st.lists(st.integers(1, 5), min_size=2, max_size=4).map(tuple))
    batch = draw(st.integers(1, 5))
    around = {
        (s, r)
        for s in range(len(counts))
        for r in draw(st.sets(st.integers(0, counts[s] - 1), max_size=counts[s] - 1))
    }
    plan = StepPlan.of(counts, batch)
    return plan, plan.routing_around(around)


@settings(max_examples=60, deadline=None)
@given(plans=plans_around(), step=st.integers(0, 1000))
def test_routing_around_gives_a_gone_replicas_rows_to_its_stand_in_and_no_row_is_lost(
    plans: tuple[StepPlan, StepPlan], step: int
) -> None:
    base, plan = plans
    counts = plan.counts
    every_row = sorted(Row(i, o) for o in range(counts[0]) for i in range(plan.batch_size))
    for s in range(len(counts)):
        held = [plan.rows(step, s, r) for r in range(counts[s])]
        assert sorted(x.row for rows in held for x in rows) == every_row
        for r in range(counts[s]):
            assert [x.row for x in held[r]] == sorted(x.row for x in held[r])
            if (s, r) in plan.around:  # a gone replica holds nothing; its stand-in holds its rows
                stand_in = plan.stand_in(s, r)
                assert held[r] == () and (s, stand_in) not in plan.around
                assert stand_in == next(
                    (r + k) % counts[s]
                    for k in range(counts[s])
                    if (s, (r + k) % counts[s]) not in plan.around
                )
                mine = {x.row for x in held[stand_in]}
                assert {x.row for x in base.rows(step, s, r)} <= mine
            else:  # a live replica keeps every row the healthy plan gave it
                assert {x.row for x in base.rows(step, s, r)} <= {x.row for x in held[r]}
            if s + 1 < len(counts):  # sending its rows along the plan matches what receivers expect
                rows = [x.row for x in held[r]]
                for receiver, indices in plan.route(step, s, rows).items():
                    assert (s + 1, receiver) not in plan.around
                    assert [rows[j] for j in indices] == plan.expects_from(step, s + 1, receiver, r)
                    assert plan.sends(step, s, r)[receiver] == indices
                others = plan.stands_in_for(step, s, r, rows)
                assert set(others) == {
                    g
                    for g in range(counts[s])
                    if (s, g) in plan.around and plan.stand_in(s, g) == r and base.rows(step, s, g)
                }


def test_a_stage_zero_stand_in_feeds_the_gone_replicas_rows_and_sends_them_along_its_routes() -> None:
    base = StepPlan.of((3, 2), 4)
    plan = base.routing_around([(0, 1)])
    assert plan.rows(5, 0, 1) == ()
    mine = plan.rows(5, 0, 2)
    assert [x.row for x in mine] == sorted(Row(i, o) for i in range(4) for o in (1, 2))
    assert {x.sender for x in mine} == {2}
    assert plan.stands_in_for(5, 0, 2, [x.row for x in mine]) == (1,)
    for receiver in range(2):  # stage 1 gets the same rows as on the healthy plan, rank 1's from 2
        moved = [x for x in base.expects(5, 1, receiver) if x.sender == 1]
        assert [x.row for x in moved] == [x.row for x in plan.expects(5, 1, receiver) if x.row.origin == 1]
        assert all(x.sender == 2 for x in plan.expects(5, 1, receiver) if x.row.origin in (1, 2))


def test_routing_around_refuses_unknown_replicas() -> None:
    with pytest.raises(ValueError, match="cannot route around"):
        StepPlan.of((2, 2), 4, around=[(1, 2)])
    with pytest.raises(ValueError, match="cannot route around"):
        StepPlan.of((2, 2), 4, around=[(2, 0)])
    assert StepPlan.of((2, 2), 4).routing_around([]).around == frozenset()


def test_the_run_plan_names_each_methods_update_and_builds_the_plans_from_the_config() -> None:
    from noloco_swarm.train.config import RunConfig

    for method, variant, update in [
        ("noloco", "heavyball", "noloco"),
        ("diloco", "heavyball", "heavyball"),
        ("diloco", "nesterov", "nesterov"),
        ("allreduce", "heavyball", None),
        ("local", "heavyball", None),
    ]:
        cfg = RunConfig.create(method=method, outer={"diloco_variant": variant, "inner_steps": 5})
        rules = cfg.run_plan()
        assert rules.update == update and rules.allreduces_gradients == (method == "allreduce")
        assert rules.outer_step_due(10) == (update is not None) and not rules.outer_step_due(7)
        plan = rules.outer_plan(10, 1, 2)
        assert (plan.update if plan else None) == update
        assert plan == outer_plan(method, 2, 2, 10, 1, diloco_variant=variant)
    cfg = RunConfig.create(inner={"batch_size": 4, "microbatches": 2, "microbatch_sizes": (1, 3)})
    rules = cfg.run_plan()
    assert (rules.clock.inner_steps, rules.clock.batch_size, rules.clock.total_steps) == (50, 4, 2000)
    assert rules.step_plan((2, 3)) == StepPlan.of((2, 3), 4, True, 2, sizes=(1, 3))
    with pytest.raises(ValueError, match="variant"):
        outer_plan("diloco", 2, 2, 10, 0, diloco_variant="adam")
