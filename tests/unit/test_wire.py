"""Activation wire formats (protocol/wire.py): error bounds, shapes, edge rows, and bad input refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from noloco_swarm.model.presets import get_preset
from noloco_swarm.peer.rows import checked_rows, decode_rows
from noloco_swarm.protocol import codec, rpc, wire
from noloco_swarm.protocol.config import WireConfig
from noloco_swarm.train.layering import ConfigError, build_config

F32_MAX = torch.finfo(torch.float32).max
BF16_MAX = torch.finfo(torch.bfloat16).max


def rows(draw_shape: tuple[int, ...], seed: int, spread: float) -> torch.Tensor:
    """Random rows whose magnitudes differ by up to 10**spread from row to row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(draw_shape, generator=g)
    return x * torch.pow(10.0, spread * (torch.rand(draw_shape[:-1], generator=g) - 0.5)).unsqueeze(-1)


shapes = st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(1, 40))


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), spread=st.floats(0, 30))
def test_round_trip_error_bounds(shape: tuple[int, ...], seed: int, spread: float) -> None:
    x = rows(shape, seed, spread)
    assert torch.equal(wire.round_trip(x, "fp32"), x)
    bf = wire.round_trip(x, "bf16")
    # bf16 keeps 8 significant bits: round to nearest is within half a unit, 2**-8 relative.
    assert bool((bf - x).abs().le(x.abs() * 2**-8).all())
    q = wire.round_trip(x, "int8")
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    assert bool((q - x).abs().le(scale * 0.5 * (1 + 1e-6)).all()), "int8 is within half a step of its row"


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), fmt=st.sampled_from(wire.FORMATS))
def test_decode_of_encode_is_the_round_trip_and_each_row_travels_alone(
    shape: tuple[int, ...], seed: int, fmt: str
) -> None:
    """The property swarm == simulator rests on: a peer decodes exactly what the simulator's round
    trip gives, and a row's round trip does not depend on which rows travel with it."""
    x = rows(shape, seed, 10)
    parts = wire.encode(x, fmt)
    assert tuple(codec.TensorMeta.of(p) for p in parts) == wire.metas(x.shape, fmt)
    assert sum(p.numel() * p.element_size() for p in parts) == wire.nbytes(x.shape, fmt)
    whole = wire.round_trip(x, fmt)
    assert torch.equal(wire.decode(parts, fmt, x.shape), whole)
    one_by_one = torch.cat([wire.round_trip(x[i : i + 1], fmt) for i in range(len(x))])
    assert torch.equal(one_by_one, whole)
    assert torch.equal(wire.round_trip(x.flip(0), fmt), whole.flip(0))


def test_bytes_halve_and_quarter() -> None:
    shape = (8, 1024, 768)  # the small preset's activations of one replica's batch
    fp32, bf16, int8 = (wire.nbytes(shape, f) for f in wire.FORMATS)
    assert fp32 == 8 * 1024 * 768 * 4
    assert bf16 * 2 == fp32
    assert int8 == fp32 // 4 + 8 * 1024 * 4  # one float32 scale per sample and position


def test_zero_rows_tiny_rows_and_huge_rows() -> None:
    x = torch.zeros(2, 3, 8)
    x[1, 1] = torch.linspace(-1, 1, 8) * F32_MAX  # the largest finite values
    x[1, 2] = torch.linspace(-1, 1, 8) * 1e-40  # subnormal
    q, scale = wire.encode(x, "int8")
    assert float(scale[0, 0]) == 0.0 and not q[0].any()
    out = wire.round_trip(x, "int8")
    assert bool(torch.isfinite(out).all())
    assert torch.equal(out[0], x[0])
    assert float(out[1, 1].abs().max()) <= F32_MAX and float(out[1, 1, -1]) > 0.99 * F32_MAX
    assert bool((out[1, 2] - x[1, 2]).abs().le(1e-40).all())
    # bf16: a value beyond its range (which only a diverged run reaches) becomes inf: refused.
    bf = wire.round_trip(x, "bf16")
    assert torch.equal(bf[0], x[0]) and bool(torch.isinf(bf[1, 1, [0, -1]]).all())
    assert bool(torch.isfinite(wire.round_trip(x.clamp(-BF16_MAX, BF16_MAX), "bf16")).all())
    with pytest.raises(codec.MessageError, match="NaN or infinite"):
        wire.decode(wire.encode(x, "bf16"), "bf16")
    empty = torch.zeros(2, 0)
    for fmt in wire.FORMATS:
        assert wire.decode(wire.encode(empty, fmt), fmt, (2, 0)).shape == (2, 0)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_non_finite_rows_stay_non_finite(fmt: str) -> None:
    """A broken replica's NaN or inf must not turn finite on the wire: receivers refuse it."""
    for bad in (float("nan"), float("inf")):
        x = torch.ones(2, 4)
        x[1, 2] = bad
        out = wire.round_trip(x, fmt)
        assert torch.equal(out[0], x[0]) and not bool(torch.isfinite(out[1]).all())
        with pytest.raises(codec.MessageError):
            wire.decode(wire.encode(x, fmt), fmt)


def int8_parts(**change: torch.Tensor) -> list[torch.Tensor]:
    q, scale = wire.encode(rows((2, 3, 8), 0, 2), "int8")
    return [change.get("q", q), change.get("scale", scale)]


BAD = {
    "int8 q of -128": ("int8", int8_parts(q=torch.full((2, 3, 8), -128, dtype=torch.int8))),
    "negative scale": ("int8", int8_parts(scale=-torch.ones(2, 3))),
    "NaN scale": ("int8", int8_parts(scale=torch.full((2, 3), float("nan")))),
    "scale that overflows": ("int8", int8_parts(scale=torch.full((2, 3), wire.MAX_SCALE * 1.001))),
    "scale of the wrong shape": ("int8", int8_parts(scale=torch.ones(2, 8))),
    "scale of the wrong dtype": ("int8", int8_parts(scale=torch.ones(2, 3, dtype=torch.float64))),
    "int8 without a scale": ("int8", int8_parts()[:1]),
    "int8 payload as int64": ("int8", [torch.zeros(2, 3, 8, dtype=torch.int64), torch.ones(2, 3)]),
    "fp32 with an extra tensor": ("fp32", [torch.zeros(2, 3, 8), torch.ones(2, 3)]),
    "bf16 sent as fp32": ("bf16", [torch.zeros(2, 3, 8)]),
    "inf in bf16": ("bf16", [torch.full((2, 3, 8), float("inf")).to(torch.bfloat16)]),
    "nothing at all": ("fp32", []),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_wire_tensors_are_message_errors(case: str) -> None:
    fmt, parts = BAD[case]
    with pytest.raises(codec.MessageError):
        wire.decode(parts, fmt)
    if case != "inf in bf16":  # a peer's transport checks floats for NaN/inf before decode does
        with pytest.raises(codec.MessageError):
            wire.decode(parts, fmt, check_finite=False)


def test_decode_checks_the_expected_shape_and_encode_refuses_what_it_cannot_carry() -> None:
    parts = wire.encode(torch.ones(2, 3, 8), "int8")
    with pytest.raises(codec.MessageError, match="must travel as"):
        wire.decode(parts, "int8", (2, 3, 9))
    with pytest.raises(ValueError, match="float32"):
        wire.encode(torch.ones(2, 3, dtype=torch.float64), "bf16")
    with pytest.raises(ValueError, match="one of"):
        wire.encode(torch.ones(2, 3), "fp8")
    with pytest.raises(ValueError, match="at least one dimension"):
        wire.encode(torch.tensor(1.0), "int8")


# ---------------------------------------------------------------------------------------------
# Headers: the metas say which format follows, and only coherent combinations decode

ACT, TOK = (2, 16, 32), codec.TensorMeta((2, 16), "int64")


@pytest.mark.parametrize("fmt", wire.FORMATS)
def test_headers_declare_the_wire_tensors(fmt: str) -> None:
    payload, *scale = wire.metas(ACT, fmt)
    fwd = rpc.ForwardHeader("run-1", 2, 117, 0, 3, (936, 937), payload, TOK, "v", *scale)
    bwd = rpc.BackwardHeader("run-1", 2, 117, 0, 1, (936, 937), payload, (3.5, 4.25), *scale)
    assert codec.decode(codec.encode(fwd)) == fwd and codec.decode(codec.encode(bwd)) == bwd
    assert fwd.tensors == (*wire.metas(ACT, fmt), TOK)
    assert bwd.tensors == wire.metas(ACT, fmt)
    assert codec.wire_format(payload, scale[0] if scale else None) == fmt


@pytest.mark.parametrize(
    ("payload", "scale"),
    [
        (codec.TensorMeta(ACT, "int8"), None),
        (codec.TensorMeta(ACT, "float32"), codec.TensorMeta(ACT[:-1], "float32")),
        (codec.TensorMeta(ACT, "int8"), codec.TensorMeta(ACT, "float32")),
        (codec.TensorMeta(ACT, "int8"), codec.TensorMeta(ACT[:-1], "bfloat16")),
        (codec.TensorMeta(ACT, "int64"), None),
        (codec.TensorMeta(ACT, "float16"), None),
    ],
)
def test_incoherent_wire_metas_are_refused_on_decode(
    payload: codec.TensorMeta, scale: codec.TensorMeta | None
) -> None:
    good = rpc.ForwardHeader("run-1", 2, 117, 0, 3, (936, 937), codec.TensorMeta(ACT, "float32"), TOK)
    body = codec.msgpack.unpackb(codec.encode(good))["b"]
    body["activations"] = codec._to_wire(payload)
    body["scale"] = None if scale is None else codec._to_wire(scale)
    data = codec.msgpack.packb({"v": codec.PROTOCOL_VERSION, "t": "forward", "b": body})
    with pytest.raises(codec.MessageError):
        codec.decode(data)


# ---------------------------------------------------------------------------------------------
# A receiving peer: rows in the run's format only, decoded and checked against its model


def peer(fmt: str) -> SimpleNamespace:
    model = get_preset("tiny", seq_len=16)
    return SimpleNamespace(
        cfg=SimpleNamespace(model=model, wire=WireConfig(fmt)), boundary=wire.Boundary(fmt)
    )


@pytest.mark.parametrize("fmt", wire.FORMATS)
def test_a_receiver_decodes_its_runs_format_and_refuses_others(fmt: str) -> None:
    ctx = peer(fmt)
    x = rows((2, 16, ctx.cfg.model.hidden_size), 3, 4)
    toks = torch.zeros(2, 16, dtype=torch.int64)
    parts = wire.encode(x, fmt)
    acts, _ = checked_rows(ctx, decode_rows(ctx, [*parts, toks], codec.TensorMeta.of(parts[0])))  # type: ignore[arg-type]
    assert acts.dtype == torch.float32 and torch.equal(acts, wire.round_trip(x, fmt))
    for other in wire.FORMATS:
        if other != fmt:
            theirs = wire.encode(x, other)
            with pytest.raises(codec.MessageError, match=f"this run sends activations as {fmt}"):
                decode_rows(ctx, [*theirs, toks], codec.TensorMeta.of(theirs[0]))  # type: ignore[arg-type]
    with pytest.raises(codec.MessageError, match="do not fit this model"):
        narrow = wire.encode(x[..., :-1].contiguous(), fmt)
        checked_rows(ctx, decode_rows(ctx, [*narrow, toks], codec.TensorMeta.of(narrow[0])))  # type: ignore[arg-type]
    with pytest.raises(codec.MessageError, match="token ids must be int64"):
        decode_rows(ctx, [*parts, toks.to(torch.int32)], codec.TensorMeta.of(parts[0]))  # type: ignore[arg-type]


def test_the_wire_format_is_a_run_setting() -> None:
    cfg = build_config("tiny", assignments={"wire.activations": "int8"}, env={})
    assert cfg.wire.activations == "int8" and cfg.manifest()["wire.activations"] == "int8"
    assert build_config("tiny", env={"NOLOCO_SET": "wire.activations=bf16"}).wire.activations == "bf16"
    assert build_config("tiny", env={}).wire.activations == "fp32"  # exact unless asked
    with pytest.raises(ConfigError, match=r"wire\.activations must be one of fp32, bf16, int8"):
        build_config("tiny", assignments={"wire.activations": "fp8"}, env={})
