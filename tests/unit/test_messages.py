"""Message codec: round trips, and every malformed input is a typed MessageError, never a crash."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from noloco_swarm.protocol import messages as m
from noloco_swarm.protocol.config import InnerConfig, OuterConfig

ACT = m.TensorMeta((2, 16, 32), "float32")
TOK = m.TensorMeta((2, 16), "int64")

EXAMPLES: list[m.Message] = [
    m.RunManifest.create("run-1", {"model.preset": "tiny", "outer.inner_steps": 50, "outer.gamma": None}),
    m.PeerAnnouncement("run-1", "12D3KooWabc", 1, 4, ("/ip4/127.0.0.1/tcp/4001",), "cuda"),
    m.ForwardHeader("run-1", 2, 117, 0, 3, (936, 937), ACT, TOK),
    m.BackwardHeader("run-1", 2, 117, 0, 1, (936, 937), ACT, (3.5, 4.25)),
    m.ExchangeHeader("run-1", 2, 150, 1, 0, ("theta",), m.TensorMeta((1000,), "float32"), 1 << 20),
    m.ExchangeHeader("run-1", 2, 150, 1, 0, ("theta_shard",), m.TensorMeta((250,), "float32"), 1 << 20, 1),
    m.StateRequest("run-1", 1),
    m.StateRequest("run-1", 1, 7),
    m.GoneReport("run-1", "12D3KooWabc", "12D3KooWdef", 3),
    m.StateManifest("run-1", 1, 7, 70, (("a", "b"), ("c",)), 70, "f" * 64, 9, 4, ("0" * 64,) * 12),
    m.ChunkRequest("run-1", 1, 7, "a" * 64, 11),
    m.StateChunk("run-1", 1, 7, "a" * 64, 11, m.TensorMeta((1,), "float32")),
    m.StatusRequest("run-1"),
    m.PeerStatus("run-1", "12D3KooWabc", 0, 71, 7, 1, 7, 9088, 4.5),
    m.PeerStatus("run-1", "12D3KooWabc", 0, 0, 0, 0, 0, 0, None),
    m.PeerStatus("run-1", "12D3KooWabc", 1, 71, 7, 1, 7, 9088, 4.5, collected=(71, 1)),
    # a stand-in of stage 1 for replicas 0 and 2, routing around replica 1 of stage 2
    m.ForwardHeader("run-1", 2, 117, 1, 3, (936, 937), ACT, TOK, stands_in_for=(0, 2), routes_around=(1,)),
    # a stage-0 replica feeding the rows of gone replica 0 from its shard
    m.ForwardHeader("run-1", 2, 117, 0, 1, (936, 937), ACT, TOK, stands_in_for=(0,)),
    m.ErrorReply("busy", "try again next round"),
    m.BackwardHeader("run-1", 2, 117, 1, 0, (936, 937), ACT, (3.5, 0.0), lost=(1,)),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda x: x.TAG)
def test_round_trip(message: m.Message) -> None:
    data = m.encode(message)
    assert m.decode(data) == message
    assert m.decode(data, type(message)) == message


def test_expected_type_is_enforced() -> None:
    with pytest.raises(m.MessageError, match="expected a 'forward'"):
        m.decode(m.encode(EXAMPLES[-1]), m.ForwardHeader)


def raw(tag: str, body: object, version: object = m.PROTOCOL_VERSION) -> bytes:
    return msgpack.packb({"v": version, "t": tag, "b": body})


def forward_body(**changes: object) -> dict[str, object]:
    body = msgpack.unpackb(m.encode(EXAMPLES[2]))["b"]
    body.update(changes)
    return body


def status_body() -> dict[str, object]:
    return msgpack.unpackb(m.encode(m.PeerStatus("run-1", "12D3KooWabc", 1, 71, 7, 1, 7, 9088, 4.5)))["b"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not a msgpack"),
        (b"\xc1", "not a msgpack"),
        (msgpack.packb([1, 2, 3]), "exactly the keys"),
        (raw("forward", forward_body(), version=m.PROTOCOL_VERSION + 1), "protocol version"),
        (raw("nope", {}), "unknown message type"),
        (raw("forward", [1]), "body must be a map"),
        (raw("forward", {k: v for k, v in forward_body().items() if k != "hop"}), "missing fields"),
        (raw("forward", forward_body(extra=1)), "unknown fields"),
        (raw("forward", forward_body(step="7")), "expected an int"),
        (raw("forward", forward_body(step=True)), "expected an int"),
        (raw("forward", forward_body(step=-1)), "counters"),
        (raw("forward", forward_body(samples=[])), "non-empty"),
        (raw("forward", forward_body(samples=[5, 4])), "ascending"),
        (raw("forward", forward_body(samples=[1, 2, 3])), "one row per sample"),
        (raw("forward", forward_body(run_id="bad id!")), "run id"),
        (raw("forward", forward_body(activations={"shape": [2, 16, 32], "dtype": "float128"})), "dtype"),
        (raw("forward", forward_body(activations={"shape": [2, -1], "dtype": "float32"})), "shape"),
        (raw("forward", forward_body(tokens={"shape": [2, 16], "dtype": "float32"})), "token ids"),
        (raw("forward", forward_body(tokens={"shape": [2, 8], "dtype": "int64"})), "sequence length"),
        (raw("forward", forward_body(routes_around=[1, 1])), "ascending, distinct"),
        (raw("forward", forward_body(routes_around=[2, 1])), "ascending, distinct"),
        (raw("forward", forward_body(stands_in_for=[-1])), "ascending, distinct"),
        (raw("forward", forward_body(hop=1, stands_in_for=[3])), "stands in only"),  # itself
        (raw("exchange", {**msgpack.unpackb(m.encode(EXAMPLES[4]))["b"], "parts": ["phi"]}), "parts"),
        (raw("exchange", {**msgpack.unpackb(m.encode(EXAMPLES[4]))["b"], "chunk_bytes": 0}), "chunk_bytes"),
        (
            raw("backward", {**msgpack.unpackb(m.encode(EXAMPLES[3]))["b"], "losses": [float("nan"), 1.0]}),
            "finite",
        ),
        (raw("backward", {**msgpack.unpackb(m.encode(EXAMPLES[3]))["b"], "lost": [2]}), "indices into"),
        (raw("backward", {**msgpack.unpackb(m.encode(EXAMPLES[3]))["b"], "lost": [1, 0]}), "ascending"),
        (raw("backward", {**msgpack.unpackb(m.encode(EXAMPLES[3]))["b"], "lost": [-1]}), "indices into"),
        (raw("peer_status", {**status_body(), "collected": [71]}), "pair"),
        (raw("peer_status", {**status_body(), "collected": [71, -1]}), "counters"),
        (b"\x00" * (m.MAX_MESSAGE_BYTES + 1), "exceeds"),
    ],
)
def test_malformed_input_is_a_message_error(data: bytes, message: str) -> None:
    with pytest.raises(m.MessageError, match=message):
        m.decode(data)


def test_manifest_hash_is_checked_and_differences_are_readable() -> None:
    manifest = EXAMPLES[0]
    body = msgpack.unpackb(m.encode(manifest))["b"]
    body["config"][0][1] = "'other'"
    with pytest.raises(m.MessageError, match="config_hash"):
        m.decode(raw("manifest", body))
    other = m.RunManifest.create("run-1", {"model.preset": "small", "outer.inner_steps": 50})
    assert manifest.differences(other) == ["model.preset: 'tiny' != 'small'", "outer.gamma: None != <absent>"]


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=300))
def test_random_bytes_never_crash(data: bytes) -> None:
    with contextlib.suppress(m.MessageError):
        m.decode(data)


@settings(max_examples=400, deadline=None)
@given(
    position=st.integers(0, 10_000),
    value=st.one_of(
        st.none(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=5), st.floats(), st.binary(max_size=4)
    ),
)
def test_corrupted_fields_never_crash(position: int, value: object) -> None:
    body = forward_body()
    key = sorted(body)[position % len(body)]
    body[key] = value
    with contextlib.suppress(m.MessageError):
        assert isinstance(m.decode(raw("forward", body)), m.ForwardHeader)


def test_tensor_payload_checks() -> None:
    t = torch.randn(2, 16, 32)
    meta = m.TensorMeta.of(t)
    assert meta == ACT and meta.nbytes == t.numel() * 4
    assert torch.equal(m.decode_tensor(meta, t.numpy().tobytes()), t)
    with pytest.raises(m.MessageError, match="bytes"):
        m.decode_tensor(meta, t.numpy().tobytes()[:-4])
    bad = t.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(m.MessageError, match="NaN"):
        m.decode_tensor(meta, bad.numpy().tobytes())
    with pytest.raises(m.MessageError, match="expected"):
        m.check_tensor(t.double(), meta)
    with pytest.raises(m.MessageError, match="NaN"):
        m.check_tensor(bad, meta)
    bf = torch.randn(5).to(torch.bfloat16)
    assert torch.equal(m.decode_tensor(m.TensorMeta.of(bf), bf.view(torch.int16).numpy().tobytes()), bf)


def test_configs_validate_with_helpful_errors() -> None:
    assert OuterConfig.for_method("diloco").inner_steps == 100
    assert OuterConfig.for_method("diloco").outer_momentum == 0.3
    assert OuterConfig().effective_gamma == 0.7 and not OuterConfig().sends_phi
    assert OuterConfig(gamma=0.2).sends_phi
    with pytest.raises(ValueError, match="method must be one of"):
        OuterConfig.for_method("gossip")
    with pytest.raises(ValueError, match="alpha"):
        OuterConfig(outer_momentum=1.0)
    with pytest.raises(ValueError, match="min_lr"):
        InnerConfig(lr=1e-4, min_lr=1e-3)
    with pytest.raises(ValueError, match="batch_size"):
        InnerConfig(batch_size=0)


def test_exchange_phases_carry_their_own_parts_and_keys_order_in_time() -> None:
    meta = m.TensorMeta((8,), "float32")
    whole = m.ExchangeHeader("run-1", 2, 150, 1, 0, ("theta",), meta, 1 << 20)
    scatter = m.ExchangeHeader("run-1", 2, 150, 1, 0, ("theta_shard",), meta, 1 << 20, 1)
    gather = m.ExchangeHeader("run-1", 2, 150, 1, 0, ("mean_shard",), meta, 1 << 20, 2)
    later = m.ExchangeHeader("run-1", 3, 200, 1, 0, ("theta",), meta, 1 << 20)
    assert whole.key == (2, 150) and whole.key < scatter.key < gather.key < later.key
    for phase, parts in ((0, ("theta_shard",)), (1, ("theta",)), (2, ("theta_shard",)), (3, ("theta",))):
        with pytest.raises(ValueError, match="cannot carry"):
            m.ExchangeHeader("run-1", 2, 150, 1, 0, parts, meta, 1 << 20, phase)
