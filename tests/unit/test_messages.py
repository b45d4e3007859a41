"""Message codec: round trips, and every malformed input is a typed MessageError, never a crash."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from noloco_swarm.protocol import codec, records, rpc
from noloco_swarm.protocol.config import InnerConfig, OuterConfig

ACT = codec.TensorMeta((2, 16, 32), "float32")
TOK = codec.TensorMeta((2, 16), "int64")

EXAMPLES: list[codec.Message] = [
    records.RunManifest.create(
        "run-1", {"model.preset": "tiny", "outer.inner_steps": 50, "outer.gamma": None}
    ),
    records.PeerAnnouncement("run-1", "12D3KooWabc", 1, 4, ("/ip4/127.0.0.1/tcp/4001",), "cuda"),
    rpc.ForwardHeader("run-1", 2, 117, 0, 3, (936, 937), ACT, TOK),
    rpc.BackwardHeader("run-1", 2, 117, 0, 1, (936, 937), ACT, (3.5, 4.25)),
    rpc.ExchangeHeader("run-1", 2, 150, 1, 0, ("theta",), codec.TensorMeta((1000,), "float32"), 1 << 20),
    rpc.ExchangeHeader(
        "run-1", 2, 150, 1, 0, ("theta_shard",), codec.TensorMeta((250,), "float32"), 1 << 20, 1
    ),
    rpc.StateRequest("run-1", 1),
    rpc.StateRequest("run-1", 1, 7),
    rpc.StateRequest("run-1", 1, 7, True),
    records.GoneReport("run-1", "12D3KooWabc", "12D3KooWdef", 3),
    records.RunListing("run-1", "e" * 64),
    rpc.StateManifest("run-1", 1, 7, 70, (("a", "b"), ("c",)), 70, "f" * 64, 9, 4, ("0" * 64,) * 12),
    rpc.ChunkRequest("run-1", 1, 7, "a" * 64, 11),
    rpc.StateChunk("run-1", 1, 7, "a" * 64, 11, codec.TensorMeta((1,), "float32")),
    rpc.StatusRequest("run-1"),
    rpc.Decline("run-1", 2, 150, 1),
    rpc.Decline("run-1", 2, 150, 1, 2),
    rpc.PeerStatus("run-1", "12D3KooWabc", 0, 71, 7, 1, 7, 9088, 4.5),
    rpc.PeerStatus("run-1", "12D3KooWabc", 0, 0, 0, 0, 0, 0, None),
    rpc.PeerStatus("run-1", "12D3KooWabc", 1, 71, 7, 1, 7, 9088, 4.5, collected=(71, 1)),
    # a stand-in of stage 1 for replicas 0 and 2, routing around replica 1 of stage 2
    rpc.ForwardHeader("run-1", 2, 117, 1, 3, (936, 937), ACT, TOK, stands_in_for=(0, 2), routes_around=(1,)),
    # a stage-0 replica feeding the rows of gone replica 0 from its shard
    rpc.ForwardHeader("run-1", 2, 117, 0, 1, (936, 937), ACT, TOK, stands_in_for=(0,)),
    rpc.ErrorReply("busy", "try again next round"),
    rpc.BackwardHeader("run-1", 2, 117, 1, 0, (936, 937), ACT, (3.5, 0.0), lost=(1,)),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda x: x.TAG)
def test_round_trip(message: codec.Message) -> None:
    data = codec.encode(message)
    assert codec.decode(data) == message
    assert codec.decode(data, type(message)) == message


def test_expected_type_is_enforced() -> None:
    with pytest.raises(codec.MessageError, match="expected a 'forward'"):
        codec.decode(codec.encode(EXAMPLES[-1]), rpc.ForwardHeader)


def raw(tag: str, body: object, version: object = codec.PROTOCOL_VERSION) -> bytes:
    return msgpack.packb({"v": version, "t": tag, "b": body})


def forward_body(**changes: object) -> dict[str, object]:
    body = msgpack.unpackb(codec.encode(EXAMPLES[2]))["b"]
    body.update(changes)
    return body


def status_body() -> dict[str, object]:
    return msgpack.unpackb(codec.encode(rpc.PeerStatus("run-1", "12D3KooWabc", 1, 71, 7, 1, 7, 9088, 4.5)))[
        "b"
    ]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not a msgpack"),
        (b"\xc1", "not a msgpack"),
        (msgpack.packb([1, 2, 3]), "exactly the keys"),
        (raw("forward", forward_body(), version=codec.PROTOCOL_VERSION + 1), "protocol version"),
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
        (raw("exchange", {**msgpack.unpackb(codec.encode(EXAMPLES[4]))["b"], "parts": ["phi"]}), "parts"),
        (
            raw("exchange", {**msgpack.unpackb(codec.encode(EXAMPLES[4]))["b"], "chunk_bytes": 0}),
            "chunk_bytes",
        ),
        (
            raw(
                "backward", {**msgpack.unpackb(codec.encode(EXAMPLES[3]))["b"], "losses": [float("nan"), 1.0]}
            ),
            "finite",
        ),
        (raw("backward", {**msgpack.unpackb(codec.encode(EXAMPLES[3]))["b"], "lost": [2]}), "indices into"),
        (raw("backward", {**msgpack.unpackb(codec.encode(EXAMPLES[3]))["b"], "lost": [1, 0]}), "ascending"),
        (raw("backward", {**msgpack.unpackb(codec.encode(EXAMPLES[3]))["b"], "lost": [-1]}), "indices into"),
        (raw("peer_status", {**status_body(), "collected": [71]}), "pair"),
        (raw("peer_status", {**status_body(), "collected": [71, -1]}), "counters"),
        (b"\x00" * (codec.MAX_MESSAGE_BYTES + 1), "exceeds"),
    ],
)
def test_malformed_input_is_a_message_error(data: bytes, message: str) -> None:
    with pytest.raises(codec.MessageError, match=message):
        codec.decode(data)


def test_manifest_hash_is_checked_and_differences_are_readable() -> None:
    manifest = EXAMPLES[0]
    body = msgpack.unpackb(codec.encode(manifest))["b"]
    body["config"][0][1] = "'other'"
    with pytest.raises(codec.MessageError, match="config_hash"):
        codec.decode(raw("manifest", body))
    other = records.RunManifest.create("run-1", {"model.preset": "small", "outer.inner_steps": 50})
    assert manifest.differences(other) == ["model.preset: 'tiny' != 'small'", "outer.gamma: None != <absent>"]


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=300))
def test_random_bytes_never_crash(data: bytes) -> None:
    with contextlib.suppress(codec.MessageError):
        codec.decode(data)


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
    with contextlib.suppress(codec.MessageError):
        assert isinstance(codec.decode(raw("forward", body)), rpc.ForwardHeader)


def test_tensor_payload_checks() -> None:
    t = torch.randn(2, 16, 32)
    meta = codec.TensorMeta.of(t)
    assert meta == ACT and meta.nbytes == t.numel() * 4
    assert torch.equal(codec.decode_tensor(meta, t.numpy().tobytes()), t)
    with pytest.raises(codec.MessageError, match="bytes"):
        codec.decode_tensor(meta, t.numpy().tobytes()[:-4])
    bad = t.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(codec.MessageError, match="NaN"):
        codec.decode_tensor(meta, bad.numpy().tobytes())
    with pytest.raises(codec.MessageError, match="expected"):
        codec.check_tensor(t.double(), meta)
    with pytest.raises(codec.MessageError, match="NaN"):
        codec.check_tensor(bad, meta)
    bf = torch.randn(5).to(torch.bfloat16)
    assert torch.equal(
        codec.decode_tensor(codec.TensorMeta.of(bf), bf.view(torch.int16).numpy().tobytes()), bf
    )


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
    meta = codec.TensorMeta((8,), "float32")
    whole = rpc.ExchangeHeader("run-1", 2, 150, 1, 0, ("theta",), meta, 1 << 20)
    scatter = rpc.ExchangeHeader("run-1", 2, 150, 1, 0, ("theta_shard",), meta, 1 << 20, 1)
    gather = rpc.ExchangeHeader("run-1", 2, 150, 1, 0, ("mean_shard",), meta, 1 << 20, 2)
    later = rpc.ExchangeHeader("run-1", 3, 200, 1, 0, ("theta",), meta, 1 << 20)
    assert whole.key == (2, 150) and whole.key < scatter.key < gather.key < later.key
    for phase, parts in ((0, ("theta_shard",)), (1, ("theta",)), (2, ("theta_shard",)), (3, ("theta",))):
        with pytest.raises(ValueError, match="cannot carry"):
            rpc.ExchangeHeader("run-1", 2, 150, 1, 0, parts, meta, 1 << 20, phase)
