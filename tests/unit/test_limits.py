"""What each verb's request may carry, and the per-caller caps (peer/net/limits.py): pure checks."""

from __future__ import annotations

import pytest
import torch

from noloco_swarm.peer.net.limits import NONE, Accepts, Admission, caps_for
from noloco_swarm.peer.net.streams import Refused, TransportConfig
from noloco_swarm.protocol import wire
from noloco_swarm.protocol.codec import TensorMeta
from noloco_swarm.protocol.rpc import ForwardHeader


def refusal(accepts: Accepts, *metas: TensorMeta) -> str | None:
    try:
        accepts.check(metas, "rpc_x")
    except Refused as e:
        return e.code
    return None


def test_a_verb_that_declares_no_tensors_refuses_any() -> None:
    assert refusal(NONE) is None
    assert refusal(NONE, TensorMeta((0,), "float32")) == "undeclared_tensors"
    # The attack this closes: a status request announcing 512 MiB of tensors.
    assert refusal(NONE, TensorMeta((128 << 20,), "float32")) == "undeclared_tensors"


def test_count_dtype_and_bytes_are_each_checked() -> None:
    accepts = Accepts(2, 1000, frozenset({"float32"}))
    assert refusal(accepts, TensorMeta((250,), "float32")) is None
    assert refusal(accepts, TensorMeta((125,), "float32"), TensorMeta((125,), "float32")) is None
    assert refusal(accepts, *[TensorMeta((1,), "float32")] * 3) == "undeclared_tensors"
    assert refusal(accepts, TensorMeta((10,), "int64")) == "undeclared_tensors"
    assert refusal(accepts, TensorMeta((251,), "float32")) == "too_large"
    assert refusal(Accepts(1, 8), TensorMeta((1,), "int64")) is None  # no dtypes named: any


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_an_honest_forward_fits_its_rows_and_a_bigger_one_does_not(fmt: str) -> None:
    """Exactly `rows` rows of the run's shape, in its wire format, with token ids, are accepted;
    one row more is too large; rows in another format are undeclared."""
    rows, seq, hidden = 8, 16, 32
    accepts = Accepts.rows(rows, seq, hidden, fmt)
    for n, code in ((rows, None), (rows + 1, "too_large")):
        parts = wire.encode(torch.randn(n, seq, hidden), fmt)
        tokens = torch.zeros(n, seq, dtype=torch.int64)
        header = ForwardHeader(
            "run",
            0,
            0,
            0,
            0,
            tuple(range(n)),
            TensorMeta.of(parts[0]),
            TensorMeta.of(tokens),
            scale=TensorMeta.of(parts[1]) if len(parts) > 1 else None,
        )
        assert refusal(accepts, *header.tensors) == code
    other = "bf16" if fmt != "bf16" else "fp32"
    wrong = wire.encode(torch.randn(1, seq, hidden), other)
    assert refusal(accepts, TensorMeta.of(wrong[0]), TensorMeta((1, seq), "int64")) == "undeclared_tensors"


def test_an_exchange_carries_at_most_the_stages_theta_and_phi() -> None:
    accepts = Accepts.weights(1000)
    theta = TensorMeta((1000,), "float32")
    assert refusal(accepts, theta) is None
    assert refusal(accepts, theta, theta) is None
    assert refusal(accepts, theta, theta, theta) == "undeclared_tensors"
    assert refusal(accepts, TensorMeta((2001,), "float32")) == "too_large"
    assert refusal(accepts, TensorMeta((1000,), "bfloat16")) == "undeclared_tensors"


def test_accepts_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match="max_tensors"):
        Accepts(65, 1)
    with pytest.raises(ValueError, match="max_bytes"):
        Accepts(0, 10)


def busy(action) -> bool:
    try:
        with action:
            pass
    except Refused as e:
        assert e.code == "busy"
        return True
    return False


def test_stream_slots_are_capped_per_caller_and_in_all_and_given_back() -> None:
    admission = Admission(TransportConfig(max_peer_streams=2, max_streams=3))
    a1, a2, b1 = admission.stream("a"), admission.stream("a"), admission.stream("b")
    a1.__enter__(), a2.__enter__()
    assert busy(admission.stream("a"))  # a's own cap
    b1.__enter__()
    assert busy(admission.stream("c"))  # everyone's cap: c has none open, yet must wait
    a1.__exit__(None, None, None)
    assert not busy(admission.stream("c"))
    assert not busy(admission.stream("a"))
    a2.__exit__(None, None, None)
    b1.__exit__(None, None, None)
    assert admission.streams == {} and admission.total_streams == 0


def test_kept_streams_are_capped_per_caller_and_in_all_apart_from_stream_slots() -> None:
    admission = Admission(TransportConfig(max_peer_streams=1, max_streams=3, max_peer_kept_streams=2))
    # A caller's slots and its kept streams are counted apart: a holds its one slot here.
    with (
        admission.stream("a"),
        admission.keep("a") as a1,
        admission.keep("a") as a2,
        admission.keep("a") as a3,
    ):
        assert (a1, a2, a3) == (True, True, False)  # a's own cap: its third stream closes
        with admission.keep("b") as b1, admission.keep("c") as c1:
            assert b1 and not c1  # everyone's cap (max_streams): c's closes too
        assert admission.kept == {"a": 2} and admission.total_kept == 2
    assert admission.kept == {} and admission.total_kept == 0 and admission.streams == {}
    with admission.keep("a") as again:
        assert again
    with pytest.raises(ValueError, match="max_peer_kept_streams"):
        TransportConfig(max_peer_kept_streams=-1)


def test_bytes_are_capped_per_caller_and_in_all_and_given_back_on_error() -> None:
    cfg = TransportConfig(max_frame_bytes=100, max_peer_inflight_bytes=100, max_inflight_bytes=150)
    admission = Admission(cfg)
    with admission.reserve("a", 80):
        assert busy(admission.reserve("a", 30))  # a would hold 110 > 100
        assert not busy(admission.reserve("a", 20))
        assert busy(admission.reserve("b", 80))  # 160 in all > 150
        assert not busy(admission.reserve("b", 70))
    with pytest.raises(RuntimeError), admission.reserve("a", 100):
        raise RuntimeError("a handler failed")
    assert admission.held == {} and admission.total_bytes == 0


def test_caps_are_checked_and_grow_with_microbatches() -> None:
    with pytest.raises(ValueError, match="max_peer_inflight_bytes"):
        TransportConfig(max_frame_bytes=2 << 30, max_inflight_bytes=4 << 30)  # the per-caller cap is 1 GiB
    with pytest.raises(ValueError, match="max_peer_streams"):
        TransportConfig(max_peer_streams=10, max_streams=5)
    with pytest.raises(ValueError, match="header_timeout"):
        TransportConfig(header_timeout=0)
    assert caps_for(1) == TransportConfig()
    many = caps_for(64)
    assert many.max_peer_streams >= 3 * 64 and many.max_streams >= many.max_peer_streams
