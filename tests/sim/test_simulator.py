"""Simulator: determinism, equivalences with plain training and DiLoCo, and that loss falls."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from noloco_swarm.model import build_model, build_stage, flat_params, state_hash
from noloco_swarm.protocol.clock import lr_at
from noloco_swarm.sim.engine import Simulator
from noloco_swarm.sim.run import data_batches, run_simulation
from noloco_swarm.train.config import RunConfig
from noloco_swarm.train.replica import StageReplica

SEQ = 32


def config(method: str = "noloco", **top: object) -> RunConfig:
    outer = top.pop("outer", {})
    inner = {"batch_size": 4, "warmup_steps": 5, "total_steps": 40, **top.pop("inner", {})}  # type: ignore[dict-item]
    return RunConfig.create(
        "tiny",
        method,
        model={"seq_len": SEQ},
        inner=inner,
        outer={"inner_steps": 4, **outer},  # type: ignore[dict-item]
        **{"num_stages": 2, "num_replicas": 2, "eval_windows": 8, "eval_every": 0, **top},
    )


def synthetic(cfg: RunConfig, seed: int = 0):
    """Random token windows indexed by (replica, step): fast, and enough for exactness tests."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(
        0, cfg.model.vocab_size, (cfg.num_replicas, 64, cfg.inner.batch_size, SEQ + 1), generator=g
    )
    return lambda d, t: data[d, t]


def train(cfg: RunConfig, steps: int) -> Simulator:
    sim = Simulator(cfg, synthetic(cfg))
    for _ in range(steps):
        sim.inner_step()
    return sim


def test_same_seed_gives_identical_hashes() -> None:
    cfg = config(num_replicas=3)
    a, b = train(cfg, 9), train(cfg, 9)
    assert a.outer_steps == 2
    assert a.replica_hashes() == b.replica_hashes()
    assert a.state_hash() == b.state_hash()
    c = train(cfg.replace(seed=1), 9)
    assert c.state_hash() != a.state_hash()


def test_seeded_groups_change_partners_not_determinism() -> None:
    # Off (the default): groups come from the step alone. On: from (seed, step); still reproducible.
    from noloco_swarm.protocol import gossip

    off = config(num_stages=1, num_replicas=4)
    on = config(num_stages=1, num_replicas=4, outer={"seeded_groups": True})
    assert gossip.make_groups(4, 4, 2) != gossip.make_groups(4, 4, 2, on.group_draw_seed)
    a, b, c = train(on, 5), train(on, 5), train(off, 5)
    assert a.outer_steps == 1 and a.state_hash() == b.state_hash()
    assert a.state_hash() != c.state_hash()


def test_one_replica_without_routing_is_plain_training() -> None:
    # P = 1, D = 1, no outer step: the simulator must be bit-identical to a plain loop.
    cfg = config("local", num_stages=1, num_replicas=1, outer={"random_routing": False})
    assert train(cfg, 7).replica_hashes()[0][0] == plain_loop(cfg, 7, sizes=[4])


def plain_loop(cfg: RunConfig, steps: int, sizes: list[int]) -> str:
    """The state hash of a plain AdamW loop over replica 0's batches, each batch's loss summed
    (scaled by 1/B) over consecutive slices of `sizes` rows, backpropagated slice by slice."""
    model = build_model(cfg.model, cfg.seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.inner.lr, betas=cfg.inner.betas, weight_decay=0.0, foreach=True
    )
    batches, B = synthetic(cfg), cfg.inner.batch_size
    for step in range(steps):
        w = batches(0, step)
        for lo, hi in itertools.pairwise(itertools.accumulate(sizes, initial=0)):
            (model(w[:, :-1][lo:hi], w[:, 1:][lo:hi]).sum() / B).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(
                step, base_lr=cfg.inner.lr, min_lr=cfg.inner.min_lr, warmup_steps=5, total_steps=40
            )
        opt.step()
        opt.zero_grad()
    return state_hash(model)


def test_split_pipeline_of_one_replica_matches_unsplit_training() -> None:
    # P = 2, D = 1: the same model split in two trains like the unsplit one (clipping off, since
    # the official clip is per stage), up to float reassociation.
    cfg = config("local", num_replicas=1, inner={"grad_clip": 0.0})
    sim = train(cfg, 5)
    whole = config("local", num_stages=1, num_replicas=1, inner={"grad_clip": 0.0})
    ref = train(whole, 5)
    split = torch.cat([flat_params(sim.stages[0][0]), flat_params(sim.stages[1][0])])
    torch.testing.assert_close(split, flat_params(ref.stages[0][0]), rtol=1e-4, atol=1e-5)


def test_noloco_with_whole_stage_groups_equals_diloco_averaging() -> None:
    alpha, beta = 0.5, 0.7
    noloco = train(config("noloco", num_replicas=3, outer={"group_size": 3, "outer_momentum": alpha}), 8)
    diloco = train(
        config(
            "diloco",
            num_replicas=3,
            outer={
                "inner_steps": 4,
                "outer_momentum": alpha,
                "outer_lr": beta,
                "diloco_variant": "heavyball",
            },
        ),
        8,
    )
    assert noloco.outer_steps == diloco.outer_steps == 2
    for s in range(2):
        for d in range(3):
            torch.testing.assert_close(
                flat_params(noloco.stages[s][d]), flat_params(diloco.stages[s][d]), rtol=0, atol=1e-6
            )
    assert noloco.weight_spread() < 1e-6  # full averaging leaves every replica equal


def test_methods_differ_as_expected() -> None:
    allreduce = train(config("allreduce", num_replicas=2), 6)
    assert allreduce.weight_spread() == 0.0  # data parallel: replicas never diverge
    local = train(config("local", num_replicas=2), 6)
    assert local.outer_steps == 0 and local.weight_spread() > 0
    noloco = train(config("noloco", num_replicas=4), 8)
    assert 0 < noloco.weight_spread() < local.weight_spread() * 10
    assert noloco.outer_steps == 2


def test_routing_moves_samples_between_replicas() -> None:
    sim = Simulator(config(num_replicas=4), synthetic(config(num_replicas=4)))
    senders = [[x.sender for x in sim.plan.rows(0, 1, r)] for r in range(4)]
    assert all(sorted(col) == [0, 1, 2, 3] for col in zip(*senders, strict=True))  # a bijection per position
    assert any(senders[r][i] != r for r in range(4) for i in range(4))
    fixed = Simulator(
        config(num_replicas=4, outer={"random_routing": False}), synthetic(config(num_replicas=4))
    )
    assert [[x.sender for x in fixed.plan.rows(0, 1, r)] for r in range(4)] == [[r] * 4 for r in range(4)]


def test_uneven_stages_train_every_replica_and_stay_deterministic() -> None:
    """3 replicas of stage 0, 2 of stage 1 (and 3 stages 2-3-1): every replica trains, the run is
    deterministic, and the per-stage outer groups come from each stage's own count."""
    for counts in ((3, 2), (2, 3, 1)):
        cfg = config(num_stages=len(counts), num_replicas=max(counts), stage_replicas=counts)
        first, again = train(cfg, 9), train(cfg, 9)
        assert [len(row) for row in first.replicas] == list(counts)
        assert first.replica_hashes() == again.replica_hashes()
        assert first.outer_steps == 2 and first.tokens == 9 * counts[0] * 4 * SEQ
        initial = [state_hash(build_stage(cfg.model, s, len(counts), cfg.seed)) for s in range(len(counts))]
        assert all(h != initial[s] for s, row in enumerate(first.replica_hashes()) for h in row)


def test_bad_batch_shape_is_a_clear_error() -> None:
    cfg = config()
    sim = Simulator(cfg, lambda d, t: torch.zeros(3, SEQ + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="expected"):
        sim.inner_step()


def test_loss_falls_on_the_embedded_corpus(cache: Path) -> None:
    cfg = config(
        num_replicas=2,
        inner={"batch_size": 8, "total_steps": 60, "warmup_steps": 10},
        outer={"inner_steps": 10},
    )
    cfg = cfg.replace(eval_every=30)
    result = run_simulation(cfg, 60)
    first, last = result.evals[0], result.evals[-1]
    assert [row["step"] for row in result.evals] == [30, 60]
    start_loss = sum(result.train_losses[:5]) / 5
    end_loss = sum(result.train_losses[-5:]) / 5
    assert end_loss < start_loss - 1.0, (start_loss, end_loss)
    # At init the model is near uniform: loss ln(4096) = 8.32. Sixty steps reach the unigram
    # plateau (about 7); the validation loss after it must be well below uniform.
    assert first["val_loss"] < math.log(cfg.model.vocab_size) - 0.7
    assert last["val_loss"] < math.log(cfg.model.vocab_size) - 0.7
    assert len(result.replica_hashes) == 2 and len(result.replica_hashes[0]) == 2
    # Every perplexity comes with the tokens it is over and the evaluation's own standard error.
    assert last["val_tokens"] == cfg.eval_windows * cfg.model.seq_len
    assert 0 < last["val_loss_se"] < 0.5


def test_embedded_data_shards_are_disjoint_per_replica(cache: Path) -> None:
    cfg = config(num_replicas=3)
    batches = data_batches(cfg)
    rows = [tuple(batches(d, 0)[i].tolist()) for d in range(3) for i in range(cfg.inner.batch_size)]
    assert len(set(rows)) == len(rows)
    assert torch.equal(batches(1, 5), data_batches(cfg)(1, 5))


def test_a_replica_loaded_from_state_parts_continues_exactly_like_its_source() -> None:
    """What a joining peer downloads (phi, delta, AdamW moments and step) is the whole replica:
    after the same next steps, the copy and its source hold bit-identical weights."""
    cfg = config()
    sim = train(cfg, 8)  # two outer steps: phi, delta and the moments are all non-trivial
    source = sim.replicas[1][0]  # stage 1, replica 0
    parts, adam_step = source.state_parts()
    assert adam_step == 8 and float(parts["delta"].abs().sum()) > 0
    copy = StageReplica(cfg, 1)
    assert copy.state_hash() != source.state_hash()
    copy.load_state_parts({k: v.clone() for k, v in parts.items()}, adam_step)
    assert copy.state_hash() == source.state_hash()
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(p.shape, generator=g) for p in source.module.parameters()]
    for replica in (source, copy):
        for _ in range(3):
            for p, grad in zip(replica.module.parameters(), grads, strict=True):
                p.grad = grad.clone()
            replica.optimizer_step(1e-3)
        replica.apply_noloco({0: replica.theta()})
    assert copy.state_hash() == source.state_hash()
    assert torch.equal(copy.delta, source.delta)
    with pytest.raises(ValueError, match="state parts"):
        copy.load_state_parts({"phi": parts["phi"]}, 1)


def test_microbatches_accumulate_the_whole_batch_gradient() -> None:
    """M microbatches of one replica, one stage: bit-identical to a plain loop that accumulates
    the same microbatches' losses (each scaled by 1/B) before one AdamW step; and within float
    reassociation of the whole-batch run for any M."""
    cfg = config(
        "local", num_stages=1, num_replicas=1, outer={"random_routing": False}, inner={"microbatches": 2}
    )
    assert train(cfg, 5).replica_hashes()[0][0] == plain_loop(cfg, 5, sizes=[2, 2])
    # Uneven microbatches: the same loop over slices of those sizes, and not the even split's bits.
    uneven_cfg = config(
        "local",
        num_stages=1,
        num_replicas=1,
        outer={"random_routing": False},
        inner={"microbatches": 3, "microbatch_sizes": (1, 2, 1)},
    )
    uneven = train(uneven_cfg, 5).replica_hashes()[0][0]
    assert uneven == plain_loop(uneven_cfg, 5, sizes=[1, 2, 1])
    assert uneven != plain_loop(uneven_cfg, 5, sizes=[2, 2])
    # A pipeline of uneven replicas with random routes (some replicas get no row of a microbatch):
    # every M accumulates the whole batch's gradient, up to float reassociation.
    uneven = {"stage_replicas": (3, 2), "num_replicas": 3}
    ref = train(config("noloco", **uneven), 3)
    ref_loss = ref.forward_backward()
    for inner in (
        {"microbatches": 2},
        {"microbatches": 4},
        {"microbatches": 3, "microbatch_sizes": (1, 2, 1)},
    ):
        sim = train(config("noloco", inner=inner, **uneven), 3)
        assert math.isclose(sim.forward_backward(), ref_loss, rel_tol=1e-5)
        for got, want in zip(sim.stages, ref.stages, strict=True):
            for a, b in zip(got, want, strict=True):
                for p, q in zip(a.parameters(), b.parameters(), strict=True):
                    assert p.grad is not None and q.grad is not None
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_microbatches_that_do_not_divide_the_batch_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="microbatches must divide"):
        config(inner={"microbatches": 3})
    with pytest.raises(ValueError, match=r"inner\.microbatch_sizes: .* must be 3 sizes"):
        config(inner={"microbatches": 3, "microbatch_sizes": (2, 2)})
    # Sizes need not divide anything; only M of them, at least 1 each, summing to B.
    cut = config(inner={"microbatches": 3, "microbatch_sizes": (1, 2, 1)})
    assert cut.inner.microbatch_sizes == (1, 2, 1)
