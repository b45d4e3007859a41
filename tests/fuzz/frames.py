"""Fuzz targets where bytes come in from the network: the frame reader (preamble, envelope,
announced tensors) and every RPC handler behind `Server.on_stream` (peer/net/serving.py), fed from an
asyncio.StreamReader in-process, with no daemon."""

from __future__ import annotations

import asyncio
import functools
import itertools
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, TypeVar
from unittest import mock

import torch
from hypothesis import strategies as st

from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.donors import Snapshot
from noloco_swarm.peer.evaluation import Evaluation
from noloco_swarm.peer.events import Events
from noloco_swarm.peer.exchange.board import ExchangeBoard
from noloco_swarm.peer.exchange.ledger import ByteLedger
from noloco_swarm.peer.inner import InnerSteps
from noloco_swarm.peer.joining import Joining
from noloco_swarm.peer.neighbourhood import NeighbourhoodServer
from noloco_swarm.peer.net import streams
from noloco_swarm.peer.net.identity import fresh
from noloco_swarm.peer.net.transport import Transport
from noloco_swarm.peer.passing import seal
from noloco_swarm.peer.runtime import Peer
from noloco_swarm.peer.views import Rounds
from noloco_swarm.protocol import codec, records, rpc
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.train.layering import build_config
from tests.fuzz.decoders import EXAMPLES, HASH, message_bytes
from tests.fuzz.target import INTS, Target, mutated_bytes

MAX_FRAME = 1 << 20  # the fuzzed reader's limit: frames announcing more must be refused unread
PART = 64 << 10
DEADLINE = 10.0  # seconds; every read here ends long before (all input is fed, then EOF)
_LOOP = asyncio.new_event_loop()
T = TypeVar("T")

# Metas a frame may announce: small ones, and huge ones no payload follows (2**34 elements is
# TensorMeta's own limit: 128 GiB of int64).
METAS = st.one_of(
    st.builds(
        codec.TensorMeta,
        st.lists(st.integers(0, 40), max_size=3).map(tuple),
        st.sampled_from(sorted(codec._DTYPES)),
    ),
    st.sampled_from(
        [
            codec.TensorMeta((1 << 34,), "int64"),
            codec.TensorMeta((1 << 17, 1 << 17), "float32"),
            codec.TensorMeta((MAX_FRAME // 4 + 1,), "float32"),
            codec.TensorMeta((MAX_FRAME // 4,), "float32"),
        ]
    ),
)


def _sealed() -> bytes:
    """A founder's announcement, validly sealed: checked in full, and held by nobody (founders'
    records change no view), so the handler passes nothing on."""
    writer = fresh()
    return seal(writer, records.PeerAnnouncement("run-1", writer.peer_id, 0, 0)).sealed


SEALED = _sealed()
VERB_OF = {
    "forward": "rpc_forward",
    "eval": "rpc_eval",
    "fetch_state": "rpc_fetch_state",
    "fetch_chunk": "rpc_fetch_chunk",
    "status": "rpc_status",
    "exchange": "rpc_exchange",
    "decline": "rpc_decline",
    "records": "rpc_records",
    "neighbourhood": "rpc_neighbourhood",
}


def _often(draw: st.DrawFn, percent: int) -> bool:
    return draw(st.integers(0, 99)) < percent


@st.composite
def frame_bytes(draw: st.DrawFn, verbs: tuple[str, ...], headers: list[codec.Message]) -> bytes:
    """One frame: magic, length, envelope (a header as its verb's handler expects it, or another
    verb's, or a mutated one; its declared tensors or others, huge ones included), payload (valid
    values, NaN, garbage; short or long); or its bytes edited. Mostly valid, so that the handlers
    behind the reader see requests that pass the frame's checks."""
    header = draw(st.sampled_from(headers))
    verb = VERB_OF.get(header.TAG, "reply") if _often(draw, 70) else draw(st.sampled_from(verbs))
    encoded_header = codec.encode(header) if _often(draw, 75) else draw(message_bytes(header.TAG))
    declared = streams.declared_tensors(header) or ()
    metas = declared if _often(draw, 75) else tuple(draw(st.lists(METAS, max_size=3)))
    envelope = codec.encode(rpc.Envelope(verb, encoded_header, metas))
    length = len(envelope) if _often(draw, 85) else draw(INTS) % 2**32
    wanted = min(sum(meta.nbytes for meta in metas), 1 << 16)
    size = wanted if _often(draw, 75) else draw(st.integers(0, wanted + 64))
    if _often(draw, 75):
        filler = draw(st.sampled_from([b"\x00", b"\x00\x00\x80\x3f", b"\x00\x00\xc0\x7f", b"\xff"]))
        payload = (filler * size)[:size]
    else:
        payload = draw(st.binary(min_size=min(size, 256), max_size=min(size, 256)))
    data = streams.MAGIC + length.to_bytes(4, "big") + envelope + payload
    return draw(mutated_bytes(data)) if _often(draw, 15) else data


FRAMES = st.one_of(
    frame_bytes(("rpc_forward", "rpc_exchange", "reply", "rpc_fetch_chunk"), EXAMPLES),
    st.binary(max_size=64),
    st.binary(max_size=16).map(lambda b: streams.MAGIC + b),
)


@contextmanager
def allocations() -> Iterator[list[int]]:
    """Bytes of every tensor torch.empty allocates meanwhile (the reader's receive buffers)."""
    sizes: list[int] = []
    empty = torch.empty

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = empty(*args, **kwargs)
        sizes.append(tensor.numel() * tensor.element_size())
        return tensor

    with mock.patch.object(torch, "empty", recording):
        yield sizes


def run_fed(data: bytes, cuts: list[int], consume: Callable[[asyncio.StreamReader], Awaitable[T]]) -> T:
    """`consume` a reader that receives `data` in pieces (cut at `cuts`) and then EOF, within
    DEADLINE: a read that waits for more is a hang, and its TimeoutError a failure."""
    bounds = sorted({0, len(data), *(c for c in cuts if 0 < c < len(data))})

    async def feed(reader: asyncio.StreamReader) -> None:
        for start, stop in itertools.pairwise(bounds):
            reader.feed_data(data[start:stop])
            await asyncio.sleep(0)
        reader.feed_eof()

    async def main() -> T:
        reader = asyncio.StreamReader(limit=1 << 22)
        feeder = asyncio.create_task(feed(reader))
        try:
            async with asyncio.timeout(DEADLINE):
                return await consume(reader)
        finally:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)

    return _LOOP.run_until_complete(main())


async def read_frame(
    reader: asyncio.StreamReader, max_bytes: int
) -> tuple[rpc.Envelope, codec.Message, list[torch.Tensor]]:
    counts = streams.ByteCounts()
    envelope = await streams.read_envelope(reader, counts)
    header = streams.open_envelope(envelope, max_bytes)
    return envelope, header, await streams.read_tensors(reader, envelope.tensors, counts, PART)


def check_frame(args: tuple[bytes, list[int]]) -> None:
    """The inbound frame reader: a checked (envelope, header, tensors) or MessageError (including
    StreamTruncated) or StreamClosed; within the deadline; no receive buffer beyond the frame limit
    and no Python allocation beyond a small multiple of the input."""
    data, cuts = args
    tracemalloc.start()
    try:
        with allocations() as sizes:
            try:
                envelope, header, tensors = run_fed(data, cuts, lambda r: read_frame(r, MAX_FRAME))
            except (codec.MessageError, streams.StreamClosed):
                return
            finally:
                peak = tracemalloc.get_traced_memory()[1]
                assert sum(sizes) <= MAX_FRAME, f"allocated {sum(sizes)} bytes for a frame"
                assert peak <= (1 << 20) + 8 * len(data), f"peak Python allocation {peak} bytes"
    finally:
        tracemalloc.stop()
    assert tuple(codec.TensorMeta.of(t) for t in tensors) == envelope.tensors
    declared = streams.declared_tensors(header)
    assert declared is None or declared == envelope.tensors
    assert all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


# -- every RPC handler, behind the transport's inbound stream ------------------------------------

ME, CALLER, JOINER = "me", "caller", "joiner"  # peer ids: only compared, never dialled
VIEW = MembershipView(0, ((CALLER,), (JOINER, ME)))
SERVE_TIMEOUT = 0.3  # a valid request waits for rows or weights that never come: bounded here
EXCHANGE_KEY = (0, 4)


class _Writer:
    """The stream's write side: keeps what the server answers."""

    transport = None

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes | memoryview) -> None:
        self.data += data

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        pass


def _peer(peer_id: str, addr: str = "/ip4/127.0.0.1/tcp/4001") -> SimpleNamespace:
    """The StreamInfo p2pd gives a stream handler: who opened it, from which address."""
    return SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: peer_id), addr=addr)


@functools.cache
def rig() -> tuple[Transport, PeerContext]:
    """A stage-1 peer (of 2) at step 4 of round 0, serving every verb a peer serves, with the
    caller at stage 0, a joiner admitted at round 0, and weights on offer for exchange (0, 4)."""
    cfg = build_config(
        assignments={
            "model.seq_len": "4",
            "inner.batch_size": "2",
            "num_replicas": "1",
            "peer.run_id": "run-1",
        }
    )
    config = streams.TransportConfig(
        max_frame_bytes=MAX_FRAME,
        max_peer_inflight_bytes=MAX_FRAME,
        max_inflight_bytes=2 * MAX_FRAME,
        serve_timeout=SERVE_TIMEOUT,
        header_timeout=SERVE_TIMEOUT,
    )
    transport = Transport(_peer(ME), config)  # type: ignore[arg-type]  # serving never touches p2p
    sink = Events()
    reads_nothing = SimpleNamespace(identity=None, run_id=cfg.peer.run_id)  # no directory read
    rounds = Rounds(ME, 1, 2, transport, reads_nothing, sink)  # type: ignore[arg-type]
    rounds.set(VIEW)
    replica = SimpleNamespace(module=lambda x, targets: torch.zeros(len(x)), device=torch.device("cpu"))
    ctx = PeerContext(cfg, 1, transport, rounds, replica, sink, step=4)  # type: ignore[arg-type]
    inner = InnerSteps(ctx)
    evaluation = Evaluation(ctx, inner)
    evaluation.trained.set()
    joining = Joining(ctx, ByteLedger(transport), announce=lambda: asyncio.sleep(0, True))
    parts = {p: torch.arange(10, dtype=torch.float32) for p in rpc.STATE_PARTS}
    # Kept at round 0's boundary for JOINER, announced for round 1.
    joining.server.snapshots[0] = Snapshot.take(
        parts, 3, HASH, VIEW, 4, chunk_bytes=16, pending=frozenset({JOINER})
    )
    status = SimpleNamespace(
        ctx=ctx,
        last_loss=None,
        outer=SimpleNamespace(taken=0),
        tokens=0,
        resume=SimpleNamespace(resuming=False, resumed_from=None),
        inner=inner,
    )
    transport.register("rpc_status", functools.partial(Peer.rpc_status, status))  # type: ignore[arg-type]
    NeighbourhoodServer(ctx, ("/ip4/127.0.0.1/tcp/4001",))
    board = ExchangeBoard(transport, 8)
    board.provide(EXCHANGE_KEY, torch.zeros(8))
    return transport, ctx


@functools.cache
def _requests() -> list[codec.Message]:
    """Requests every handler would serve, as a caller of the rig's view sends them."""
    transport, ctx = rig()
    cfg, digest = ctx.cfg, VIEW.digest()
    acts = codec.TensorMeta((2, 4, cfg.model.hidden_size), "float32")
    tokens = codec.TensorMeta((2, 4), "int64")
    server = transport._server.handlers["rpc_fetch_chunk"].__self__  # type: ignore[attr-defined]
    served, other = server.snapshots[0].digest, "cd" * 32
    return [
        rpc.ForwardHeader(cfg.peer.run_id, 0, 4, 0, 0, (8, 9), acts, tokens, digest),
        rpc.ForwardHeader(cfg.peer.run_id, 0, 5, 0, 0, (10, 11), acts, tokens, digest),
        rpc.EvalHeader(cfg.peer.run_id, 4, 0, 0, 0, acts, tokens),
        rpc.StateRequest(cfg.peer.run_id, 1, 1, True),
        rpc.StateRequest(cfg.peer.run_id, 1, 1),
        rpc.ChunkRequest(cfg.peer.run_id, 1, 0, served, 3),
        rpc.ChunkRequest(cfg.peer.run_id, 1, 0, other, 0),
        rpc.StatusRequest(cfg.peer.run_id),
        rpc.ExchangeHeader(
            cfg.peer.run_id, 0, 4, 1, 0, ("theta",), codec.TensorMeta((8,), "float32"), 1 << 20
        ),
        rpc.ExchangeHeader(
            cfg.peer.run_id, 0, 8, 1, 0, ("theta",), codec.TensorMeta((8,), "float32"), 1 << 20
        ),
        rpc.Decline(cfg.peer.run_id, 0, 4, 1),
        rpc.PassedRecords(cfg.peer.run_id, b"session!", (SEALED, b"\x00garbage", SEALED[:-1])),
        rpc.NeighbourhoodRequest(cfg.peer.run_id, 1),
        rpc.NeighbourhoodRequest(cfg.peer.run_id, 7),
    ]


VERBS = (
    "rpc_forward",
    "rpc_eval",
    "rpc_fetch_state",
    "rpc_fetch_chunk",
    "rpc_status",
    "rpc_exchange",
    "rpc_decline",
    "rpc_records",
    "rpc_neighbourhood",
    "rpc_nope",
    "reply",
)


@st.composite
def inbound(draw: st.DrawFn) -> tuple[str, bytes, list[int]]:
    """Who calls (mostly the peer the handler serves), and the bytes of its request frame."""
    headers = _requests() if _often(draw, 80) else EXAMPLES
    data = draw(frame_bytes(VERBS, headers)) if _often(draw, 85) else draw(FRAMES)
    tag = next((h.TAG for h in headers if codec.encode(h) in data), "")
    usual = {
        "forward": CALLER,
        "eval": CALLER,
        "exchange": JOINER,
        "decline": JOINER,
        "fetch_state": JOINER,
        "fetch_chunk": JOINER,
    }
    peer = usual.get(tag, CALLER) if _often(draw, 75) else draw(st.sampled_from([CALLER, JOINER, ME, "x"]))
    return peer, data, draw(st.lists(st.integers(0, len(data)), max_size=3))


def check_inbound(args: tuple[str, bytes, list[int]]) -> None:
    """Server.on_stream with every handler registered: nothing escapes it, it ends within its
    deadline, and what it writes back is a reply (an exchange's is followed by its confirmation)
    or an ErrorReply that is not 'internal'; an empty stream gets no answer. A stream is kept
    after a handler's reply, so bytes after the first request's frame are read as the next
    request and answered too; a refusal or a confirmation ends the stream."""
    peer, data, cuts = args
    transport, _ = rig()
    writer = _Writer()
    with allocations() as sizes:
        run_fed(data, cuts, lambda reader: transport._server.on_stream(_peer(peer), reader, writer))  # type: ignore[arg-type]
    assert sum(sizes) <= 2 * MAX_FRAME, f"allocated {sum(sizes)} bytes for one request"
    if not data:
        assert not writer.data, "answered an empty stream"
        return
    answers = run_fed(bytes(writer.data), [], _frames)
    assert answers, "a request went unanswered"
    for envelope, header in answers:
        assert envelope.verb == rpc.REPLY_VERB
        assert not (isinstance(header, rpc.ErrorReply) and header.code == "internal"), header.reason
    assert not any(isinstance(h, rpc.ErrorReply) for _, h in answers[:-1]), "answered after a refusal"
    further = answers[1:]
    if further and further[0][1] == rpc.Ack("received"):
        assert len(answers) == 2, "answered after an exchange's confirmation"
    elif further:  # answers to the requests that followed a whole first frame, one byte or more each
        start = streams._PREAMBLE + int.from_bytes(data[len(streams.MAGIC) : streams._PREAMBLE], "big")
        first = start + codec.decode(data[streams._PREAMBLE : start], rpc.Envelope).nbytes
        assert len(further) <= len(data) - first, f"{len(further)} answers to {len(data) - first} more bytes"


async def _frames(reader: asyncio.StreamReader) -> list[tuple[rpc.Envelope, codec.Message]]:
    """Every frame the server wrote, read as a caller reads them, until the stream ends."""
    out = []
    while True:
        try:
            envelope, header, _ = await read_frame(reader, 1 << 30)
        except streams.StreamClosed:
            return out
        out.append((envelope, header))


FRAME_TARGETS: list[Target] = [
    Target(
        "streams.read_envelope+open_envelope+read_tensors",
        st.tuples(FRAMES, st.lists(st.integers(0, 4096), max_size=4)),
        check_frame,
        "a checked frame, or MessageError / StreamClosed; no buffer over the frame limit",
        ci_examples=250,
    ),
    Target(
        "transport._on_stream[every handler]",
        inbound(),
        check_inbound,
        "one reply or ErrorReply (never 'internal'), no exception, within the deadline",
        ci_examples=150,
    ),
]
