"""The two named DiLoCo baselines and the seeded group draw: config defaults and plan wiring."""

from __future__ import annotations

import pytest

from noloco_swarm.protocol import gossip
from noloco_swarm.protocol.config import OuterConfig
from noloco_swarm.protocol.plan import outer_plan
from noloco_swarm.train.layering import ConfigError, build_config


def test_each_diloco_variant_brings_its_papers_momentum() -> None:
    heavy = OuterConfig.for_method("diloco")
    assert (heavy.diloco_variant, heavy.outer_momentum, heavy.outer_lr, heavy.inner_steps) == (
        "heavyball",
        0.3,
        0.7,
        100,
    )
    nesterov = OuterConfig.for_method("diloco", diloco_variant="nesterov")
    assert (nesterov.outer_momentum, nesterov.outer_lr, nesterov.inner_steps) == (0.9, 0.7, 100)
    # An explicit momentum still wins over the variant's default.
    assert (
        OuterConfig.for_method("diloco", diloco_variant="nesterov", outer_momentum=0.3).outer_momentum == 0.3
    )
    with pytest.raises(ValueError, match="diloco_variant"):
        OuterConfig.for_method("diloco", diloco_variant="adam")


def test_variant_through_the_layered_config() -> None:
    cfg = build_config("tiny", "diloco", assignments={"outer.diloco_variant": "nesterov"}, env={})
    assert (cfg.outer.diloco_variant, cfg.outer.outer_momentum) == ("nesterov", 0.9)
    cfg = build_config("tiny", "diloco", env={"NOLOCO_SET": "outer.diloco_variant=heavyball"})
    assert cfg.outer.outer_momentum == 0.3
    assert cfg.manifest()["outer.diloco_variant"] == "heavyball"  # peers of a run must agree on it
    with pytest.raises(ConfigError, match="diloco_variant"):
        build_config("tiny", "diloco", assignments={"outer.diloco_variant": "sgd"}, env={})


def test_seeded_groups_are_off_by_default_and_official_then() -> None:
    cfg = build_config("tiny", "noloco", assignments={"seed": "3"}, env={})
    assert cfg.group_draw_seed is None  # the step-only draw: the official code's
    for step in (10, 20, 50):
        plans = [outer_plan("noloco", 2, 8, step, r, cfg.group_draw_seed) for r in range(8)]
        assert {p.group for p in plans} == {tuple(sorted(g)) for g in gossip.make_groups(8, step, 2)}


def test_seeded_groups_vary_with_the_seed_and_still_partition() -> None:
    seqs = {}
    for seed in range(4):
        cfg = build_config(
            "tiny", "noloco", assignments={"seed": str(seed), "outer.seeded_groups": "true"}, env={}
        )
        assert cfg.group_draw_seed == seed
        seq = []
        for step in range(10, 210, 10):
            groups = gossip.make_groups(8, step, 2, cfg.group_draw_seed)
            assert sorted(r for g in groups for r in g) == list(range(8))
            plans = [outer_plan("noloco", 2, 8, step, r, cfg.group_draw_seed) for r in range(8)]
            assert {p.group for p in plans} == {tuple(sorted(g)) for g in groups}
            seq.append(tuple(map(tuple, groups)))
        seqs[seed] = tuple(seq)
    assert len(set(seqs.values())) == 4  # every seed its own partner sequence
    assert seqs[0] != tuple(tuple(map(tuple, gossip.make_groups(8, s, 2))) for s in range(10, 210, 10))
    with pytest.raises(ValueError, match="seed"):
        gossip.draw_order(4, 10, -1)


@pytest.mark.parametrize(
    ("replicas", "size", "sizes"),
    [(5, 2, [3, 2]), (8, 3, [4, 4]), (5, 3, [5]), (7, 3, [4, 3]), (2, 3, [2]), (9, 3, [3, 3, 3])],
)
def test_group_sizes_when_n_does_not_divide_d(replicas: int, size: int, sizes: list[int]) -> None:
    # What the group_size docstring promises: D // n groups, the D % n left over spread over them.
    for step in (10, 20, 30):
        assert [len(g) for g in gossip.make_groups(replicas, step, size)] == sizes
