"""Every decoder and RPC handler, fuzzed with a fixed, deterministic budget (issue 10).

Each target (tests/fuzz) feeds structured and random inputs and checks its contract: a valid
object or the documented error class, no hang, no allocation beyond the frame limit. The longer
run with the counts per target is bench/fuzz.py (docs/security.md, "Fuzzing").
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from noloco_swarm.peer.net import streams
from noloco_swarm.protocol import codec, rpc
from tests.fuzz import TARGETS, frames
from tests.fuzz.frames import MAX_FRAME, allocations, read_frame, run_fed


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz(name: str) -> None:
    target = TARGETS[name]

    @settings(
        max_examples=target.ci_examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(target.strategy)
    def run(value: object) -> None:
        target.check(value)

    run()


def frame(envelope: rpc.Envelope, payload: bytes = b"") -> bytes:
    encoded = codec.encode(envelope)
    return streams.MAGIC + len(encoded).to_bytes(4, "big") + encoded + payload


def read(data: bytes) -> tuple[rpc.Envelope, codec.Message, list[torch.Tensor]]:
    return run_fed(data, [], lambda reader: read_frame(reader, MAX_FRAME))


@pytest.mark.parametrize(
    "metas",
    [
        (codec.TensorMeta((1 << 34,), "int64"),),  # 128 GiB: TensorMeta's own element limit
        (codec.TensorMeta((MAX_FRAME // 4 + 1,), "float32"),),  # one element over the limit
        (codec.TensorMeta((MAX_FRAME // 8,), "float32"),) * 3,  # under it apiece, over it together
    ],
    ids=["128GiB", "limit+1", "sum"],
)
def test_huge_frame_is_refused_before_any_buffer(metas: tuple[codec.TensorMeta, ...]) -> None:
    data = frame(rpc.Envelope("rpc_forward", codec.encode(rpc.StatusRequest("run-1")), metas), b"\0" * 64)
    with allocations() as sizes, pytest.raises(codec.MessageError, match="over our limit"):
        read(data)
    assert sizes == []


def test_a_frame_at_the_limit_is_read_and_a_short_one_is_truncated() -> None:
    # The reader refuses only what the limit refuses: the test above cannot pass by refusing all.
    meta = codec.TensorMeta((MAX_FRAME // 4,), "float32")
    envelope = rpc.Envelope("rpc_x", codec.encode(rpc.StatusRequest("run-1")), (meta,))
    with allocations() as sizes:
        _, _, (tensor,) = read(frame(envelope, b"\0" * MAX_FRAME))
    assert sizes == [MAX_FRAME] and torch.equal(tensor, torch.zeros(MAX_FRAME // 4))
    with pytest.raises(streams.StreamTruncated):
        read(frame(envelope, b"\0" * 100))


def test_the_frame_check_fails_on_a_reader_that_escapes_its_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    # A target must be able to fail: a reader that lets a KeyError out is caught.
    def broken(*args: object) -> None:
        raise KeyError("bug")

    monkeypatch.setattr(streams, "open_envelope", broken)
    target = TARGETS["streams.read_envelope+open_envelope+read_tensors"]
    with pytest.raises(KeyError):
        target.check((frame(rpc.Envelope("rpc_x", codec.encode(rpc.StatusRequest("run-1")))), []))


def _answers(
    peer: str, header: codec.Message, payload: bytes = b"", addr: str = "/ip4/127.0.0.1/tcp/4001"
) -> list[codec.Message]:
    """What the fuzzed server answers one well-formed request with, from a rig of its own: the
    fuzz targets share the cached one, and an exchange their examples already served would be
    refused here as a duplicate (run alone, this file failed that way)."""
    transport, _ = frames.rig.__wrapped__()
    envelope = rpc.Envelope(
        frames.VERB_OF[header.TAG], codec.encode(header), streams.declared_tensors(header) or ()
    )
    writer = frames._Writer()
    frames.run_fed(
        frame(envelope, payload),
        [],
        lambda r: transport._server.on_stream(frames._peer(peer, addr), r, writer),
    )
    return [h for _, h in frames.run_fed(bytes(writer.data), [], frames._frames)]


def test_the_handler_rig_serves_valid_requests() -> None:
    # The handler target is only worth its inputs if valid ones get past the checks to an answer.
    requests = {type(r).__name__ + str(getattr(r, "step", "")): r for r in frames._requests()}
    status = _answers(frames.CALLER, requests["StatusRequest"])
    assert [type(a) for a in status] == [rpc.PeerStatus]
    (manifest,) = _answers(frames.JOINER, requests["StateRequest"])
    assert isinstance(manifest, rpc.StateManifest)
    chunk = rpc.ChunkRequest("run-1", 1, 0, manifest.snapshot, 1)
    assert [type(a) for a in _answers(frames.JOINER, chunk)] == [rpc.StateChunk]
    exchange = requests["ExchangeHeader4"]
    assert _answers(frames.JOINER, exchange, b"\0" * 32) == [rpc.Ack(), rpc.Ack("received")]
    (late,) = _answers(frames.CALLER, requests["ForwardHeader4"], b"\0" * 4096 + b"\0" * 64)
    assert isinstance(late, rpc.ErrorReply) and late.code in ("timeout", "bad_request")


def test_bulk_verbs_are_refused_on_a_stream_that_came_through_a_relay() -> None:
    # An outer exchange and a state chunk never cross a circuit relay (a third volunteer's link);
    # a status request, signalling, does. Served as in the test above, but from a relayed address.
    relay = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWBURgXPuRfFiNWgL8Uw6Gkqu5p2GUhtxtT1H2HjTpES9o/p2p-circuit"
    requests = {type(r).__name__ + str(getattr(r, "step", "")): r for r in frames._requests()}
    (manifest,) = _answers(frames.JOINER, requests["StateRequest"], addr=relay)
    assert isinstance(manifest, rpc.StateManifest)  # small: served
    chunk = rpc.ChunkRequest("run-1", 1, 0, manifest.snapshot, 1)
    exchange = (requests["ExchangeHeader4"], b"\0" * 32)
    for header, payload in ((chunk, b""), exchange):
        (refusal,) = _answers(frames.JOINER, header, payload, addr=relay)
        assert isinstance(refusal, rpc.ErrorReply) and refusal.code == "relayed", refusal
    assert [type(a) for a in _answers(frames.CALLER, requests["StatusRequest"], addr=relay)] == [
        rpc.PeerStatus
    ]


def test_the_handler_check_fails_on_a_handler_that_crashes(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*args: object) -> None:
        raise KeyError("bug")

    transport, _ = frames.rig()
    monkeypatch.setitem(transport._server.handlers, "rpc_status", broken)
    status = frame(rpc.Envelope("rpc_status", codec.encode(rpc.StatusRequest("run-1"))))
    with pytest.raises(KeyError):
        frames.check_inbound((frames.CALLER, status, []))
