"""Wire framing, limits and errors of the tensor transport: an envelope, then raw tensor bytes.

Each direction of a stream carries exactly one frame:

    b"NLS1" | u32 big-endian envelope length | Envelope (protocol/codec.py) | raw tensor bytes

The raw bytes are the tensors of `Envelope.tensors`, in order, each C-contiguous and
little-endian, with no per-part framing: the lengths are known from the metas, so the receiver
reads straight into one preallocated buffer per tensor. The sender writes in parts of
`part_bytes` and waits for the socket to drain after each, which bounds its own buffering. A
paced frame (`Pacer`) is written in parts of at most `PACED_PART` bytes, each when the pace
allows: at a pace below the link's rate, what we send then keeps no more than about one part
queued ahead of other traffic on the link.

Why this and not protobuf messages whose `buffer` field carries the parts: every protobuf part is
copied by `SerializeToString`, `readexactly` and `ParseFromString` before it reaches our buffer;
here a part is copied once, from asyncio's read buffer into the tensor. bench/exchange_throughput.py
measures both (docs/transport.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

from noloco_swarm.peer.net.uplink import Arrivals
from noloco_swarm.protocol import codec, rpc
from noloco_swarm.protocol.codec import Message, MessageError, TensorMeta
from noloco_swarm.protocol.plausible import Implausible
from noloco_swarm.protocol.rpc import Envelope

MAGIC = b"NLS1"
_PREAMBLE = len(MAGIC) + 4
# Finiteness is checked in slices of this many elements as they arrive, overlapping the check with
# the network.
_CHECK_ELEMENTS = 1 << 20
REFUSAL_DEADLINE = 5.0  # seconds to write an ErrorReply and linger for the caller to read it

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("the tensor transport sends raw little-endian bytes; this host is big-endian")


class PeerUnavailable(ConnectionError):
    """The remote could not be reached, did not answer in time, or the stream broke."""


class RelayOnly(PeerUnavailable):
    """The remote is reachable only through a circuit relay, and the call moves bulk data, which
    never crosses a relay (a relay is some third volunteer's link)."""


def relayed(address: object) -> bool:
    """Is `address` (a multiaddr: a stream's remote address, or an announced one) a circuit relay's?"""
    return "/p2p-circuit" in str(address)


class RemoteRefused(RuntimeError):
    """The remote read our request and answered with an ErrorReply (`code`, `reason`)."""

    def __init__(self, peer_id: str, code: str, reason: str) -> None:
        super().__init__(f"peer {peer_id} refused: [{code}] {reason}")
        self.peer_id, self.code, self.reason = peer_id, code, reason


class StreamClosed(PeerUnavailable):
    """The stream closed (or was reset) before the first byte of the remote's answer: it may have
    died, or only this stream may have broken while the remote lives on (a caller may try again)."""


class StreamTruncated(MessageError, PeerUnavailable):
    """The stream ended inside a frame, after the envelope promised more bytes.

    Through p2pd a remote that died mid-transfer and one that lied about its sizes look the same
    (the daemon closes our socket either way), so this is both a MessageError and PeerUnavailable.
    """


class Refused(Exception):
    """Raised by a handler to refuse a well-formed request; the caller gets RemoteRefused."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"[{code}] {reason}")
        self.code, self.reason = code, reason


@dataclass(frozen=True)
class TransportConfig:
    """Limits and part size of the transport; the defaults suit stages of up to ~250M fp32 params."""

    part_bytes: int = 1 << 20
    """Bytes written per part before waiting for the socket to drain (64 KiB .. 4 MiB)."""
    max_frame_bytes: int = 1 << 30
    """Most tensor bytes one received frame may announce; bigger frames are refused unread."""
    max_inflight_bytes: int = 2 << 30
    """Most tensor bytes all requests being received at once may hold; beyond it we answer 'busy'."""
    max_peer_inflight_bytes: int = 1 << 30
    """Most tensor bytes the requests of one caller may hold at once (an honest exchange partner
    sends one stage's weights at a time); beyond it that caller gets 'busy'."""
    max_peer_streams: int = 64
    """Most inbound streams one caller may have open at once (an honest sender has a few per
    microbatch in flight, plus probes); beyond it that caller gets 'busy'."""
    max_streams: int = 1024
    """Most inbound streams open at once, all callers together; beyond it we answer 'busy'."""
    max_peer_kept_streams: int = 8
    """Most streams one caller may keep open between its requests, for reuse (an honest caller
    keeps up to 4 per peer it calls); beyond it, or beyond `max_streams` kept by all callers, a
    stream closes after its reply. A kept stream waiting for its next request holds none of the
    stream slots above."""
    serve_timeout: float = 300.0
    """Deadline for serving one inbound request, including an exchange's wait for our own tensor."""
    header_timeout: float = 30.0
    """Deadline for a request's envelope to arrive once its stream opened: a caller writes it at
    once, so a stream silent for longer is refused ('timeout') and frees its slot."""

    def __post_init__(self) -> None:
        if not 64 << 10 <= self.part_bytes <= 4 << 20:
            raise ValueError(f"part_bytes={self.part_bytes} must be within 64 KiB .. 4 MiB")
        if not 0 < self.max_frame_bytes <= self.max_peer_inflight_bytes <= self.max_inflight_bytes:
            raise ValueError("need 0 < max_frame_bytes <= max_peer_inflight_bytes <= max_inflight_bytes")
        if not 1 <= self.max_peer_streams <= self.max_streams:
            raise ValueError("need 1 <= max_peer_streams <= max_streams")
        if self.max_peer_kept_streams < 0:
            raise ValueError("need max_peer_kept_streams >= 0")
        if self.serve_timeout <= 0 or self.header_timeout <= 0:
            raise ValueError("serve_timeout and header_timeout must be > 0 seconds")


PACED_PART = 64 << 10  # bytes per write of a paced frame (26 ms of a 20 Mbit/s link)


class Pacer:
    """Spaces out writes so that they average at most `bytes_per_s` (0: no cap). One pacer may
    be shared by several writers at once: together they keep to the rate."""

    def __init__(self, bytes_per_s: float) -> None:
        if not 0 <= bytes_per_s < math.inf:
            raise ValueError(f"a pace must be >= 0 bytes/s (0: no cap), got {bytes_per_s}")
        self.rate = bytes_per_s
        self._free_at = 0.0
        # Bytes/s the receivers measured what we sent at this pace arriving at (peer/net/uplink.py),
        # one report per stream, and the most streams that wrote at once (they share the pace).
        self.arrived: list[float] = []
        self.writers = self.most_writers = 0

    async def wait(self, nbytes: int) -> None:
        """Return when `nbytes` more may be written."""
        if self.rate <= 0:
            return
        now = time.monotonic()
        start = max(now, self._free_at)
        self._free_at = start + nbytes / self.rate
        await asyncio.sleep(start - now)


@dataclass
class ByteCounts:
    """Bytes moved with one remote peer. `payload` is tensor bytes; `total` adds framing."""

    sent_payload: int = 0
    sent_total: int = 0
    received_payload: int = 0
    received_total: int = 0
    bad_messages: int = 0  # frames from this peer that we rejected as malformed

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def prepare(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors as they go on the wire: detached, on CPU, contiguous (copies only where needed)."""
    return [t.detach().cpu().contiguous() for t in tensors]


@dataclass
class InboundStream:
    """One stream a remote opened to us, being served."""

    peer: str
    counts: ByteCounts
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    part_bytes: int
    replied: bool = False
    relayed: bool = False
    """It came over a circuit relay (p2pd gives every stream its connection's remote address)."""


async def call_frames(
    peer: str,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    envelope: Envelope,
    wire: list[torch.Tensor],
    counts: ByteCounts,
    config: TransportConfig,
    expect: tuple[TensorMeta, ...] | None,
    confirmed: bool = False,
    lost: Callable[[], bool] | None = None,
    pace: Pacer | None = None,
) -> tuple[Message, list[torch.Tensor]]:
    """Caller side: write our frame (at `pace`, if given) while reading the reply (full duplex);
    check it before allocating.

    `lost` (a test's failpoint) is asked once the whole reply is in: True makes this call behave
    as one whose reply never arrived (no receipt is sent; the caller then discards the reply).

    With `confirmed`, the remote replies while still reading our frame (`rpc_exchange`), and says
    when it has all of it with one more frame (`confirm`): only then is the call complete. Our
    side returning at the reply would close the stream while the tail of our frame was still
    buffered in p2pd, which then resets the stream and drops it (seen under load: "stream ended
    after 4146304 of 4196352 bytes"), and the two sides of an exchange would disagree."""
    part = config.part_bytes
    sending = asyncio.create_task(write_frame(writer, envelope, wire, part, counts, pace))
    try:
        reply_envelope, header = await _read_reply(peer, reader, counts, config, expect)
        arrivals = Arrivals(sum(meta.nbytes for meta in reply_envelope.tensors)) if confirmed else None
        tensors = await read_tensors(reader, reply_envelope.tensors, counts, part, writer.transport, arrivals)
        await sending  # our frame is with p2pd; unless confirmed, the remote has read it before replying
        if confirmed:
            _, ack = await _read_reply(peer, reader, counts, config, expect=())
            if not isinstance(ack, rpc.Ack):
                raise MessageError(f"expected the confirmation frame, got {ack.TAG!r}")
            if pace is not None:  # how fast our frame reached the remote (peer/net/uplink.py)
                pace.arrived.append(ack.rate)
        if lost is not None and lost():
            return header, tensors
        if confirmed:
            # Our receipt: the remote then need not keep its answer for a call of ours again. A
            # receipt that never arrives only makes it keep that answer longer. It says how fast
            # the answer arrived, which the remote's exchange cap follows.
            receipt = Envelope(
                envelope.verb, codec.encode(rpc.Ack(RECEIPT, rate=arrivals.rate() if arrivals else 0.0)), ()
            )
            with contextlib.suppress(OSError):
                await write_frame(writer, receipt, [], part, counts)
        return header, tensors
    finally:
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)


async def _read_reply(
    peer: str,
    reader: asyncio.StreamReader,
    counts: ByteCounts,
    config: TransportConfig,
    expect: tuple[TensorMeta, ...] | None,
) -> tuple[Envelope, Message]:
    """The next reply frame's envelope and header, checked (a refusal raises RemoteRefused)."""
    envelope = await read_envelope(reader, counts)
    header = open_envelope(envelope, config.max_frame_bytes)
    if isinstance(header, rpc.ErrorReply):
        raise RemoteRefused(peer, header.code, header.reason)
    if envelope.verb != rpc.REPLY_VERB:
        raise MessageError(f"expected a reply frame, got verb {envelope.verb!r}")
    if expect is not None and envelope.tensors != expect:  # e.g. outer weights of another shape
        raise Implausible("shape", f"reply carries {envelope.tensors}, expected {expect}")
    return envelope, header


async def reply(
    stream: InboundStream, header: Message, tensors: Sequence[torch.Tensor], pace: Pacer | None = None
) -> None:
    """Server side: write the reply frame (at `pace`, if given)."""
    wire = prepare(tensors)
    envelope = Envelope(rpc.REPLY_VERB, codec.encode(header), tuple(TensorMeta.of(t) for t in wire))
    stream.replied = True
    await write_frame(stream.writer, envelope, wire, stream.part_bytes, stream.counts, pace)


RECEIPT = "got your reply"  # the caller's last frame of a confirmed call (call_frames)


async def confirm(stream: InboundStream, rate: float = 0.0) -> None:
    """Server side, after the reply: we have read all of the caller's frame (see call_frames),
    which arrived at `rate` bytes/s (0: not measured)."""
    await reply(stream, rpc.Ack("received", rate=rate), ())


async def receipt(stream: InboundStream, timeout: float) -> float | None:
    """Server side, after `confirm`: the rate (bytes/s, 0: not measured) our reply reached the
    caller at, if it said it has all of it within `timeout`; None if it did not."""
    try:
        async with asyncio.timeout(timeout):
            envelope = await read_envelope(stream.reader, stream.counts)
        header = open_envelope(envelope, 1 << 16)
    except (TimeoutError, OSError, PeerUnavailable, MessageError, asyncio.IncompleteReadError):
        return None
    if isinstance(header, rpc.Ack) and header.note == RECEIPT and not envelope.tensors:
        return header.rate
    return None


async def refuse(stream: InboundStream, code: str, reason: str, linger: float = REFUSAL_DEADLINE) -> None:
    """Server side: answer ErrorReply if no reply has started, then linger so the caller can read it.

    Closing at once would make p2pd reset the stream while the caller is still sending, which can
    discard our answer; so we read and drop the rest of its frame part by part (nothing of it is
    kept), for at most `linger` seconds.
    """
    if stream.replied:
        return
    with contextlib.suppress(OSError, TimeoutError, PeerUnavailable):
        async with asyncio.timeout(linger):
            await reply(stream, rpc.ErrorReply(code, reason[: codec.MAX_STRING]), ())
            while await stream.reader.read(stream.part_bytes):
                pass


async def write_frame(
    writer: asyncio.StreamWriter,
    envelope: Envelope,
    tensors: list[torch.Tensor],
    part_bytes: int,
    counts: ByteCounts,
    pace: Pacer | None = None,
) -> None:
    """Write one frame; `tensors` must match `envelope.tensors` and come from `prepare`. With
    `pace`, the tensor bytes go out in parts of at most PACED_PART, each when `pace` allows."""
    encoded = codec.encode(envelope)
    writer.write(MAGIC + len(encoded).to_bytes(4, "big") + encoded)
    counts.sent_total += _PREAMBLE + len(encoded)
    await writer.drain()
    paced = pace is not None and pace.rate > 0
    if paced:
        part_bytes = min(part_bytes, PACED_PART)
    if pace is not None:
        pace.writers += 1
        pace.most_writers = max(pace.most_writers, pace.writers)
    try:
        for tensor in tensors:
            data = tensor_bytes(tensor)
            for offset in range(0, len(data), part_bytes):
                part = data[offset : offset + part_bytes]
                if paced:
                    await pace.wait(len(part))
                writer.write(part)
                await writer.drain()
                counts.sent_payload += len(part)
                counts.sent_total += len(part)
    finally:
        if pace is not None:
            pace.writers -= 1


async def read_envelope(reader: asyncio.StreamReader, counts: ByteCounts) -> Envelope:
    """Read and validate the envelope that opens a frame."""
    preamble = await _read_exactly(reader, _PREAMBLE, at_start=True)
    if preamble[: len(MAGIC)] != MAGIC:
        raise MessageError(f"stream does not start with {MAGIC!r}: not a noloco transport frame")
    length = int.from_bytes(preamble[len(MAGIC) :], "big")
    if length > codec.MAX_MESSAGE_BYTES:
        raise MessageError(f"envelope of {length} bytes exceeds {codec.MAX_MESSAGE_BYTES}")
    encoded = await _read_exactly(reader, length)
    counts.received_total += _PREAMBLE + length
    return codec.decode(encoded, Envelope)


def open_envelope(envelope: Envelope, max_bytes: int) -> Message:
    """Decode the header inside an envelope and check the announced tensors before any allocation."""
    if envelope.nbytes > max_bytes:
        raise MessageError(f"frame announces {envelope.nbytes} tensor bytes, over our limit of {max_bytes}")
    header = codec.decode(envelope.header)
    declared = declared_tensors(header)
    if declared is not None and declared != envelope.tensors:
        raise MessageError(
            f"{header.TAG} header declares tensors {declared}, frame carries {envelope.tensors}"
        )
    return header


def declared_tensors(header: Message) -> tuple[TensorMeta, ...] | None:
    """The tensors a header says follow it, in order; None for headers that declare none."""
    if isinstance(header, rpc.ForwardHeader | rpc.BackwardHeader):
        return header.tensors
    if isinstance(header, rpc.EvalHeader):
        return (header.activations, header.tokens)
    if isinstance(header, rpc.ExchangeHeader):
        return (header.meta,) * len(header.parts)
    if isinstance(header, rpc.StateChunk):
        return (header.meta,)
    return None


async def read_tensors(
    reader: asyncio.StreamReader,
    metas: tuple[TensorMeta, ...],
    counts: ByteCounts,
    part_bytes: int,
    transport: asyncio.BaseTransport | None = None,
    arrivals: Arrivals | None = None,
) -> list[torch.Tensor]:
    """Read the raw bytes that follow an envelope into fresh tensors, checking floats as they land.

    With the stream's `transport`, the bytes go from the socket straight into the tensors; with
    `arrivals`, their arrival is timed (peer/net/uplink.py).
    """
    tensors = []
    source = _PayloadSource(reader, transport)
    try:
        for meta in metas:
            tensor = torch.empty(meta.shape, dtype=_dtype(meta))
            flat, view, item = tensor.reshape(-1), tensor_bytes(tensor), tensor.element_size()
            filled = checked = 0  # bytes received; elements checked for finiteness
            while filled < len(view):
                n = await source.read_into(view[filled : filled + min(part_bytes, len(view) - filled)])
                if n == 0:
                    raise StreamTruncated(f"stream ended after {filled} of {meta.nbytes} bytes of a {meta}")
                filled += n
                if arrivals is not None:
                    arrivals.got(n)
                counts.received_payload += n
                counts.received_total += n
                complete = filled // item
                if complete - checked >= _CHECK_ELEMENTS or filled == len(view):
                    check_finite(flat[checked:complete])
                    checked = complete
            tensors.append(tensor)
    finally:
        source.close()
    return tensors


class _PayloadSource:
    """Payload bytes: first those asyncio's StreamReader holds, then straight from the socket.

    A StreamReader copies each byte three times (into its buffer, out as bytes, and the memmove that
    drops them) before we copy it into the tensor; reading the socket into the tensor leaves only the
    kernel's copy and halves the receiver's CPU (bench/exchange_throughput.py). We switch only once a
    short read proves the StreamReader's buffer empty, and pause the transport so no byte can land
    there while we read the socket through a duplicate of its descriptor.
    """

    def __init__(self, reader: asyncio.StreamReader, transport: asyncio.BaseTransport | None) -> None:
        self._reader, self._transport = reader, transport
        self._sock: socket.socket | None = None

    async def read_into(self, view: memoryview) -> int:
        if self._sock is not None:
            return await asyncio.get_running_loop().sock_recv_into(self._sock, view)
        chunk = await self._reader.read(len(view))
        view[: len(chunk)] = chunk
        if 0 < len(chunk) < len(view):  # read() returns less than asked only when it emptied the buffer
            self._bypass_reader()
        return len(chunk)

    def _bypass_reader(self) -> None:
        transport = self._transport
        if (
            not isinstance(transport, asyncio.ReadTransport)
            or transport.is_closing()
            or self._reader.at_eof()
        ):
            return
        raw = transport.get_extra_info("socket")
        if raw is None:
            return
        transport.pause_reading()
        self._sock = socket.socket(fileno=os.dup(raw.fileno()))
        self._sock.setblocking(False)

    def close(self) -> None:
        if self._sock is None:
            return
        self._sock.close()  # only our duplicate descriptor
        self._sock = None
        assert isinstance(self._transport, asyncio.ReadTransport)
        if not self._transport.is_closing():
            self._transport.resume_reading()


def check_finite(tensor: torch.Tensor) -> None:
    """Raise MessageError (Implausible, reason "nonfinite") if a float tensor holds NaN or inf.

    One aminmax pass: NaN and inf reach its min or max. On one core it is ~9x faster than a
    float64 sum (which cannot overflow, as a float32 sum of finite values can) and ~20x faster
    than torch.isfinite(...).all(), and it allocates nothing the size of its input.
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    low, high = torch.aminmax(tensor.reshape(-1))
    if not (math.isfinite(low) and math.isfinite(high)):
        raise Implausible("nonfinite", "tensor holds NaN or infinite values")


def _dtype(meta: TensorMeta) -> torch.dtype:
    return getattr(torch, meta.dtype)  # TensorMeta only admits names of torch dtypes


async def _read_exactly(reader: asyncio.StreamReader, n: int, *, at_start: bool = False) -> bytes:
    try:
        return await reader.readexactly(n)
    except (ConnectionResetError, BrokenPipeError) as e:  # p2pd closed its side with our bytes unread
        if at_start:
            raise StreamClosed(f"the stream was reset before a frame: {e}") from e
        raise
    except asyncio.IncompleteReadError as e:
        if at_start and not e.partial:
            raise StreamClosed("the remote closed the stream without sending a frame") from e
        raise StreamTruncated(f"stream ended after {len(e.partial)} of {n} bytes of a frame") from e
