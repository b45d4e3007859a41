"""Subspace stage boundaries: U and F from the seed, the constrained stages, the wire format's round
trip, the sender's refusal, the receiver's checks and the bytes per token."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from noloco_swarm.model import build_stages, count_stage_parameters, get_preset, num_flat
from noloco_swarm.model.subspace import SpanEmbedding, SpanLinear, make_basis, make_subspace, make_table
from noloco_swarm.peer.net.limits import Accepts
from noloco_swarm.peer.rows import checked_rows, decode_rows
from noloco_swarm.protocol import codec, rpc, subspace, wire
from noloco_swarm.protocol.config import WireConfig
from noloco_swarm.train.layering import ConfigError, build_config

SEED, K, T = 7, 16, 16


@pytest.fixture(autouse=True, scope="module")
def _few_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cfg():  # tiny (d = 128) at rank 16
    return get_preset("tiny", seq_len=T, subspace_rank=K)


@pytest.fixture(scope="module")
def space(cfg) -> subspace.Subspace:
    return make_subspace(cfg, SEED)


def ids(cfg, rows: int = 2, seed: int = 0) -> torch.Tensor:
    """Token windows (rows, T + 1): the ids that ride along under subspace."""
    return torch.randint(0, cfg.vocab_size, (rows, T + 1), generator=torch.Generator().manual_seed(seed))


def boundary_output(cfg, windows: torch.Tensor) -> torch.Tensor:
    first = build_stages(cfg, 2, SEED)[0]
    with torch.no_grad():
        return first(windows[:, :-1])


def test_u_and_f_come_from_the_seed_on_the_cpu_in_fp32(cfg) -> None:
    u, f = make_basis(cfg, SEED), make_table(cfg, SEED)
    assert u.shape == (128, K) and f.shape == (cfg.vocab_size, 128)
    assert u.dtype == f.dtype == torch.float32 and u.device.type == "cpu"
    assert torch.allclose(u.T @ u, torch.eye(K), atol=1e-6)  # orthonormal columns
    assert torch.equal(make_basis(cfg, SEED), u) and torch.equal(make_table(cfg, SEED), f)  # reproducible
    assert not torch.equal(make_basis(cfg, SEED + 1), u) and not torch.equal(make_table(cfg, SEED + 1), f)
    other = get_preset("tiny", subspace_rank=K, num_layers=2)  # the shape of U depends on d and k alone
    assert torch.equal(make_basis(other, SEED), u)


def test_stages_before_the_last_write_only_into_the_subspace(cfg, space) -> None:
    stages = build_stages(cfg, 2, SEED)
    first, last = stages
    names = [n for n, _ in first.named_parameters()]
    assert names[0] == "embed_tokens.factor.weight"
    assert (
        "layers.0.self_attn.o_proj.factor.weight" in names and "layers.1.mlp.down_proj.factor.weight" in names
    )
    assert not any(isinstance(m, SpanLinear | SpanEmbedding) for m in last.modules())  # last: unconstrained
    for s in stages:  # the parameter count follows the constraint; U and F are buffers, not state
        assert num_flat(s) == count_stage_parameters(cfg, s.layer_range, s.is_first, s.is_last)
        assert not any("basis" in k or "table" in k for k in s.state_dict())
    spans = [m for m in first.modules() if isinstance(m, SpanLinear | SpanEmbedding)]
    assert len(spans) == 1 + 2 * len(first.layer_range)
    for m in spans:
        assert torch.equal(m.basis, space.basis)
        w = m.effective_weight().detach()
        w = w if isinstance(m, SpanLinear) else w.T  # columns in the residual's space
        off = w - space.basis @ (space.basis.T @ w)
        assert float(off.norm() / w.norm()) < 1e-5
    windows = ids(cfg)
    with torch.no_grad():
        x = first(windows[:, :-1])
    assert subspace.outside(space, x, windows[:, :-1]) < 1e-5
    # Under bf16 autocast the writes through U stay fp32: a bf16 product would round them off span(U).
    lowered = build_stages(get_preset("tiny", seq_len=T, subspace_rank=K, autocast_bf16=True), 2, SEED)[0]
    with torch.no_grad():
        x = lowered(windows[:, :-1])
    assert x.dtype == torch.float32 and subspace.outside(space, x, windows[:, :-1]) < 1e-5


def test_the_round_trip_rebuilds_the_residual_and_projects_the_gradient(cfg, space) -> None:
    windows = ids(cfg, rows=3)
    x = boundary_output(cfg, windows)
    b = wire.Boundary("subspace", space)
    (c,) = b.encode_rows(x, windows)
    assert c.dtype == torch.bfloat16 and c.shape == (3, T, K)
    back = b.decode_rows([c], windows)
    assert torch.equal(back, b.rows_round_trip(x, windows))  # the peer decodes the simulator's bits
    # Only the coefficients' bf16 rounding is lost: within 2^-8 of the residual's in-subspace part.
    y = x - space.table[windows[:, :-1]]
    assert float((back - x).norm()) <= 2**-8 * float(y.norm())
    g = torch.randn(3, T, 128, generator=torch.Generator().manual_seed(1))
    (gc,) = b.encode_grads(g)
    assert gc.dtype == torch.bfloat16 and gc.shape == (3, T, K)
    projected = space.basis @ (space.basis.T @ g.unsqueeze(-1))
    assert torch.allclose(b.decode_grads([gc], g.shape), projected.squeeze(-1), atol=1e-2)
    assert torch.equal(b.decode_grads([gc], g.shape), b.grads_round_trip(g))


def test_a_sender_refuses_rows_outside_the_subspace(cfg, space) -> None:
    windows = ids(cfg)
    dense = build_stages(get_preset("tiny", seq_len=T), 2, SEED)[0]  # subspace_rank 0: unconstrained
    with torch.no_grad():
        x = dense(windows[:, :-1])
    b = wire.Boundary("subspace", space)
    with pytest.raises(subspace.OutsideSubspace, match=r"leave the subspace.*model\.subspace_rank"):
        b.encode_rows(x, windows)
    # bf16 rounding of a residual that is in the subspace is caught too (the tolerance is fp32's).
    ok = boundary_output(cfg, windows)
    with pytest.raises(subspace.OutsideSubspace):
        b.encode_rows(ok.to(torch.bfloat16).to(torch.float32), windows)
    nan = ok.clone()
    nan[0, 0, 0] = float("nan")  # not judged: it stays NaN, and the receiver refuses it
    assert not bool(torch.isfinite(b.encode_rows(nan, windows)[0].float()).all())


def receiver(cfg, space) -> SimpleNamespace:
    return SimpleNamespace(
        cfg=SimpleNamespace(model=cfg, wire=WireConfig("subspace")), boundary=wire.Boundary("subspace", space)
    )


def test_a_receiver_refuses_malformed_subspace_rows_as_bad_messages(cfg, space) -> None:
    ctx = receiver(cfg, space)
    windows = ids(cfg)
    (c,) = ctx.boundary.encode_rows(boundary_output(cfg, windows), windows)
    toks = windows.to(torch.int32)
    meta = codec.TensorMeta.of(c)
    acts, got = checked_rows(ctx, decode_rows(ctx, [c, toks], meta))  # type: ignore[arg-type]
    assert acts.shape == (2, T, 128) and torch.equal(got, windows)
    wide = torch.zeros(2, T, K + 1, dtype=torch.bfloat16)
    bad = {
        "k + 1 columns": ([wide, toks], "bfloat16"),
        "float ids": ([c, windows.to(torch.float32)], "int32"),
        "int64 ids": ([c, windows], "int32"),
        "ids beyond the vocabulary": ([c, toks + cfg.vocab_size], "vocab"),
        "negative ids": ([c, toks - cfg.vocab_size], "vocab"),
        "targets only": ([c, toks[:, 1:].contiguous()], "int32"),
        "no ids": ([c], "activations and token ids"),
        "fp32 rows": ([c.float(), toks], "this run sends activations as subspace"),
        "NaN coefficients": ([torch.full_like(c, float("nan")), toks], "NaN"),
    }
    for case, (tensors, why) in bad.items():
        with pytest.raises(codec.MessageError, match=why if why != "vocab" else r"\[0, 4096\)"):
            decode_rows(ctx, tensors, codec.TensorMeta.of(tensors[0]))  # type: ignore[arg-type]
        assert case  # each is an error value, never another exception
    with pytest.raises(codec.MessageError, match="bfloat16"):
        ctx.boundary.decode_grads([wide], (2, T, 128))
    # Finite coefficients near bf16's largest values, aligned with a row of U, overflow U c.
    row = space.basis[space.basis.norm(dim=1).argmax()]
    huge = (torch.sign(row) * 3e38).expand(2, T, K).to(torch.bfloat16)
    with pytest.raises(codec.MessageError, match="overflow"):
        decode_rows(ctx, [huge, toks], meta)  # type: ignore[arg-type]
    with pytest.raises(codec.MessageError, match="overflow"):
        ctx.boundary.decode_grads([huge], (2, T, 128))


def test_headers_carry_subspace_rows_with_int32_windows() -> None:
    c, toks = codec.TensorMeta((2, T, K), "bfloat16"), codec.TensorMeta((2, T + 1), "int32")
    fwd = rpc.ForwardHeader("run-1", 0, 3, 0, 1, (6, 7), c, toks, "v")
    assert codec.decode(codec.encode(fwd)) == fwd and fwd.tensors == (c, toks)
    with pytest.raises(ValueError, match="sequence length"):
        rpc.ForwardHeader("run-1", 0, 3, 0, 1, (6, 7), c, codec.TensorMeta((2, T), "int32"), "v")
    with pytest.raises(ValueError, match="int32 token ids"):
        rpc.ForwardHeader("run-1", 0, 3, 0, 1, (6, 7), codec.TensorMeta((2, T, K), "float32"), toks, "v")
    with pytest.raises(ValueError, match="token ids must be int64"):  # windows ride only with rows
        rpc.EvalHeader("run-1", 3, 0, 0, 0, codec.TensorMeta((2, T, 128), "float32"), toks)
    accepts = Accepts.rows(2, T, K, "subspace")
    accepts.check(fwd.tensors, "rpc_forward")  # an honest request fits exactly
    assert accepts.max_bytes == c.nbytes + toks.nbytes


def test_bytes_per_token_are_two_k_plus_four_against_two_d_for_bf16(space) -> None:
    """Subspace at rank k: 2k bytes of bf16 coefficients and a 4-byte int32 id per token, plus one
    id per sample (the window's first input); bf16 sends 2d (and its int64 targets, 8 more)."""
    rows, seq, d = 8, 1024, 768  # the small preset's batch
    basis = torch.linalg.qr(torch.randn(d, 40, generator=torch.Generator().manual_seed(0)))[0]
    sub = wire.Boundary("subspace", subspace.Subspace(basis, torch.zeros(1, d)))  # bytes need no table
    bf16 = wire.Boundary("bf16")
    tokens = rows * seq
    assert sub.nbytes(rows, seq, d, ids=True) == tokens * (40 * 2 + 4) + rows * 4
    assert sub.nbytes(rows, seq, d, ids=False) == tokens * 40 * 2  # gradients: k bf16 per token
    assert bf16.nbytes(rows, seq, d, ids=False) == tokens * d * 2
    assert bf16.nbytes(rows, seq, d, ids=True) == tokens * (d * 2 + 8)
    per_token = {"subspace": sub.nbytes(rows, seq, d, ids=True) / tokens, "bf16": 2 * d}
    assert per_token == {"subspace": 84.00390625, "bf16": 1536}  # 18.3x fewer bytes forward
    print(
        f"bytes per token forward: subspace k=40 {per_token['subspace']:.3f}, bf16 d=768 {per_token['bf16']}"
    )
    small = wire.Boundary("subspace", space)
    assert small.nbytes(1, T, 128, ids=True) == T * (K * 2 + 4) + 4


def test_subspace_needs_a_rank_within_the_hidden_size() -> None:
    with pytest.raises(ConfigError, match=r"set model\.subspace_rank=k"):
        build_config("tiny", assignments={"wire.activations": "subspace"}, env={})
    with pytest.raises(ConfigError, match=r"within 0\.\.hidden_size"):
        build_config("tiny", assignments={"model.subspace_rank": "129"}, env={})
    cfg = build_config(
        "tiny", assignments={"wire.activations": "subspace", "model.subspace_rank": "16"}, env={}
    )
    assert cfg.manifest()["model.subspace_rank"] == 16 and cfg.manifest()["wire.activations"] == "subspace"
    assert build_config("tiny", env={}).model.subspace_rank == 0  # off by default
    with pytest.raises(ValueError, match="needs the run's basis"):
        wire.Boundary("subspace")


def test_every_first_stage_and_codec_of_a_run_share_one_token_table() -> None:
    # F is V x d floats (1 GB for medium): the simulator's replicas of stage 0 and the wire codec
    # point at the run's one copy, and a different seed draws its own.
    cfg = get_preset("tiny", subspace_rank=4)
    first, second = (build_stages(cfg, 2, 7)[0] for _ in range(2))
    tables = [m.table for s in (first, second) for m in s.modules() if isinstance(m, SpanEmbedding)]
    run = make_subspace(cfg, 7)
    assert len(tables) == 2 and all(t.data_ptr() == run.table.data_ptr() for t in tables)
    assert make_subspace(cfg, 8).table.data_ptr() != run.table.data_ptr()
    assert not torch.equal(make_subspace(cfg, 8).table, run.table)
    # A stage without the embedding draws no F; it shares U all the same.
    from noloco_swarm.model import build_stage
    from noloco_swarm.model.subspace import _shared_table

    _shared_table.cache_clear()
    later = build_stage(cfg, 1, 3, 7)  # a middle stage: constrained, without the embedding
    assert _shared_table.cache_info().currsize == 0
    bases = {m.basis.data_ptr() for m in later.modules() if isinstance(m, SpanLinear)}
    assert bases == {make_subspace(cfg, 7).basis.data_ptr()}
