"""Wire framing of the tensor transport: one envelope, then raw tensor bytes, on a libp2p stream.

Each direction of a stream carries exactly one frame:

    b"NLS1" | u32 big-endian envelope length | Envelope (messages codec) | raw tensor bytes

The raw bytes are the tensors of `Envelope.tensors`, in order, each C-contiguous and
little-endian, with no per-part framing: the lengths are known from the metas, so the receiver
reads straight into one preallocated buffer per tensor. The sender writes in parts of
`part_bytes` and waits for the socket to drain after each, which bounds its own buffering.

Why this and not protobuf messages whose `buffer` field carries the parts: every protobuf part is
copied by `SerializeToString`, `readexactly` and `ParseFromString` before it reaches our buffer;
here a part is copied once, from asyncio's read buffer into the tensor. bench/exchange_throughput.py
measures both (docs/transport.md).
"""

from __future__ import annotations

import asyncio
import math
import sys
from dataclasses import dataclass, fields

import torch

from noloco_swarm.protocol import messages
from noloco_swarm.protocol.messages import Envelope, Message, MessageError, TensorMeta

MAGIC = b"NLS1"
_PREAMBLE = len(MAGIC) + 4
# Finiteness is checked in slices of this many elements so the bool mask stays small (16 MiB).
_CHECK_ELEMENTS = 1 << 24
# Above this many bytes the finiteness check runs in a worker thread so the event loop keeps serving
# other streams (torch releases the GIL for it).
_THREAD_CHECK_BYTES = 8 << 20

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("the tensor transport sends raw little-endian bytes; this host is big-endian")


class PeerUnavailable(ConnectionError):
    """The remote could not be reached, did not answer in time, or the stream broke."""


class RemoteRefused(RuntimeError):
    """The remote read our request and answered with an ErrorReply (`code`, `reason`)."""

    def __init__(self, peer_id: str, code: str, reason: str) -> None:
        super().__init__(f"peer {peer_id} refused: [{code}] {reason}")
        self.peer_id, self.code, self.reason = peer_id, code, reason


class StreamTruncated(MessageError, PeerUnavailable):
    """The stream ended inside a frame, after the envelope promised more bytes.

    Through p2pd a remote that died mid-transfer and one that lied about its sizes look the same
    (the daemon closes our socket either way), so this is both a MessageError and PeerUnavailable.
    """


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


def prepare(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Tensors as they go on the wire: detached, on CPU, contiguous (copies only where needed)."""
    return [t.detach().cpu().contiguous() for t in tensors]


async def write_frame(
    writer: asyncio.StreamWriter,
    envelope: Envelope,
    tensors: list[torch.Tensor],
    part_bytes: int,
    counts: ByteCounts,
) -> None:
    """Write one frame; `tensors` must match `envelope.tensors` and come from `prepare`."""
    encoded = messages.encode(envelope)
    writer.write(MAGIC + len(encoded).to_bytes(4, "big") + encoded)
    counts.sent_total += _PREAMBLE + len(encoded)
    await writer.drain()
    for tensor in tensors:
        data = tensor_bytes(tensor)
        for offset in range(0, len(data), part_bytes):
            part = data[offset : offset + part_bytes]
            writer.write(part)
            await writer.drain()
            counts.sent_payload += len(part)
            counts.sent_total += len(part)


async def read_envelope(reader: asyncio.StreamReader, counts: ByteCounts) -> Envelope:
    """Read and validate the envelope that opens a frame."""
    preamble = await _read_exactly(reader, _PREAMBLE, at_start=True)
    if preamble[: len(MAGIC)] != MAGIC:
        raise MessageError(f"stream does not start with {MAGIC!r}: not a noloco transport frame")
    length = int.from_bytes(preamble[len(MAGIC) :], "big")
    if length > messages.MAX_MESSAGE_BYTES:
        raise MessageError(f"envelope of {length} bytes exceeds {messages.MAX_MESSAGE_BYTES}")
    encoded = await _read_exactly(reader, length)
    counts.received_total += _PREAMBLE + length
    return messages.decode(encoded, Envelope)


def open_envelope(envelope: Envelope, max_bytes: int) -> Message:
    """Decode the header inside an envelope and check the announced tensors before any allocation."""
    if envelope.nbytes > max_bytes:
        raise MessageError(f"frame announces {envelope.nbytes} tensor bytes, over our limit of {max_bytes}")
    header = messages.decode(envelope.header)
    declared = declared_tensors(header)
    if declared is not None and declared != envelope.tensors:
        raise MessageError(f"{header.TAG} header declares tensors {declared}, frame carries {envelope.tensors}")
    return header


def declared_tensors(header: Message) -> tuple[TensorMeta, ...] | None:
    """The tensors a header says follow it, in order; None for headers that declare none."""
    if isinstance(header, messages.ForwardHeader):
        return (header.activations, header.tokens)
    if isinstance(header, messages.BackwardHeader):
        return (header.grad,)
    if isinstance(header, messages.ExchangeHeader):
        return (header.meta,) * len(header.parts)
    return None


async def read_tensors(
    reader: asyncio.StreamReader, metas: tuple[TensorMeta, ...], counts: ByteCounts, part_bytes: int
) -> list[torch.Tensor]:
    """Read the raw bytes that follow an envelope into fresh tensors and check them."""
    tensors = []
    for meta in metas:
        tensor = torch.empty(meta.shape, dtype=_dtype(meta))
        view, filled = tensor_bytes(tensor), 0
        while filled < len(view):
            chunk = await reader.read(min(part_bytes, len(view) - filled))
            if not chunk:
                raise StreamTruncated(f"stream ended after {filled} of {meta.nbytes} bytes of a {meta}")
            view[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
            counts.received_payload += len(chunk)
            counts.received_total += len(chunk)
        if meta.nbytes > _THREAD_CHECK_BYTES:
            await asyncio.to_thread(check_finite, tensor)
        else:
            check_finite(tensor)
        tensors.append(tensor)
    return tensors


def check_finite(tensor: torch.Tensor) -> None:
    """Raise MessageError if a float tensor holds NaN or inf; checked in slices to bound memory."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), _CHECK_ELEMENTS):
        if not bool(torch.isfinite(flat[start : start + _CHECK_ELEMENTS]).all()):
            raise MessageError("tensor holds NaN or infinite values")


def check_metas(tensors: list[torch.Tensor], expected: tuple[TensorMeta, ...]) -> None:
    """Raise MessageError unless the received tensors are exactly the expected ones (shape, dtype)."""
    got = tuple(TensorMeta.of(t) for t in tensors)
    if got != expected:
        raise MessageError(f"expected tensors {expected}, got {got}")


def _dtype(meta: TensorMeta) -> torch.dtype:
    dtype = getattr(torch, meta.dtype)
    assert isinstance(dtype, torch.dtype) and math.prod(meta.shape) == meta.numel
    return dtype


async def _read_exactly(reader: asyncio.StreamReader, n: int, *, at_start: bool = False) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        if at_start and not e.partial:
            raise PeerUnavailable("the remote closed the stream without sending a frame") from e
        raise StreamTruncated(f"stream ended after {len(e.partial)} of {n} bytes of a frame") from e
