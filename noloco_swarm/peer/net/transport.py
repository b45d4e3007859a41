"""The libp2p tensor transport of a peer: generic (header, tensors) request/response by verb.

One libp2p protocol (`PROTOCOL`) carries every verb. A call is one exchange of frames on a stream
(peer/net/streams.py): the caller writes its request, the callee its reply, both directions at once. A
verb is served either by a handler (`register`: tensors in, reply out) or by a stream handler that
owns the rest of the stream (`register_stream`: the outer exchange, which starts its reply while
the request's tensors still arrive; peer/exchange/board.py).

Streams are kept and reused. After a handler's reply the callee reads the stream's next request,
for up to `header_timeout` seconds, and the caller keeps the stream for its next call to that peer
for a third of that (`_IdleStreams`). Opening a libp2p stream costs two unix connections through
p2pd, a yamux stream and a protocol negotiation, in every peer's CPU, for every call; a pipeline
calls each next-stage replica once per step. A stream whose request met a closed stream before
any byte of an answer (the callee let it go idle, or its stream handler ended it) was not served:
the call goes once more on a fresh stream, which is what it would have used without reuse. A
stream handler's stream, a refusal's and a failed call's are closed, never reused.

Errors a caller sees: `PeerUnavailable` (cannot connect, deadline passed, stream broke),
`RemoteRefused` (the remote answered with an ErrorReply), `MessageError` (the remote sent garbage).
The serving side, its limits and its answers to bad requests are peer/net/serving.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure, P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from noloco_swarm.peer import failpoints
from noloco_swarm.peer.net import streams
from noloco_swarm.peer.net.lifetime import start_p2p
from noloco_swarm.peer.net.limits import NONE, Accepts
from noloco_swarm.peer.net.serving import Gatekeeper, Handler, Server, StreamHandler
from noloco_swarm.peer.net.streams import (
    ByteCounts,
    InboundStream,
    PeerUnavailable,
    Refused,
    RelayOnly,
    RemoteRefused,
    StreamClosed,
    StreamTruncated,
    TransportConfig,
    relayed,
)
from noloco_swarm.protocol import codec
from noloco_swarm.protocol.codec import Message
from noloco_swarm.protocol.rpc import Envelope

__all__ = [
    "PROTOCOL",
    "Accepts",
    "Handler",
    "InboundStream",
    "PeerUnavailable",
    "Refused",
    "RelayOnly",
    "RemoteRefused",
    "StreamClosed",
    "StreamTruncated",
    "Transport",
    "TransportConfig",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

PROTOCOL = "noloco_swarm.transport.v1"
_IDLE_PER_PEER = 4  # streams a caller keeps for reuse per remote peer (more are closed)
_BACKOFF_POLL = 0.5  # seconds between dials while our daemon backs off from a peer


class _LostReply:
    """A test's `lose_reply` failpoint for one call, asked once its whole reply is in: the call
    then ends as one whose reply never came (no receipt sent; the reply discarded)."""

    def __init__(self, verb: str) -> None:
        self.verb, self.lost = verb, False

    def __call__(self) -> bool:
        self.lost = failpoints.fire("lose_reply", self.verb)
        return self.lost

    def raise_if_lost(self, peer: str) -> None:
        if self.lost:
            raise StreamClosed(f"failpoint: {peer}'s reply to {self.verb} was discarded")


class _Unanswered(StreamClosed):
    """The stream closed before the first byte of the callee's answer."""


class _IdleStreams:
    """The caller's streams kept for reuse, per remote peer, each until a deadline.

    A stream is kept for a third of `header_timeout`, the time the callee waits for its next
    request: the callee closes an idle stream only after the caller stopped offering it."""

    def __init__(self, keep: float) -> None:
        self._keep = keep
        self._idle: dict[str, list[tuple[float, _Stream]]] = {}

    def take(self, peer: str, direct: bool = False) -> _Stream | None:
        """The most recently used idle stream to `peer` still within its deadline, if any (with
        `direct`, one that did not come through a relay: a relayed one is closed)."""
        kept, now = self._idle.get(peer, []), time.monotonic()
        while kept:
            until, stream = kept.pop()
            if until > now and _open(stream) and not (direct and stream.relayed):
                return stream
            stream.writer.close()
        self._idle.pop(peer, None)
        return None

    def give(self, peer: str, stream: _Stream) -> None:
        kept = self._idle.setdefault(peer, [])
        if len(kept) >= _IDLE_PER_PEER or not _open(stream):
            stream.writer.close()
            return
        kept.append((time.monotonic() + self._keep, stream))

    def drop(self, peer: str | None = None) -> None:
        """Close the idle streams to `peer` (to every peer without one)."""
        for key in [peer] if peer is not None else list(self._idle):
            for _, stream in self._idle.pop(key, []):
                stream.writer.close()


@dataclass(frozen=True)
class _Stream:
    """A stream our call opened: its two ends, and whether it came through a circuit relay."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    relayed: bool


def _open(stream: _Stream) -> bool:
    """Neither side of a kept stream has ended yet (the callee's close shows as end of file)."""
    return not stream.reader.at_eof() and not stream.writer.is_closing()


class _Dialer:
    """Our dials and stream opens to other peers: the daemon's dial backoff waited out, streams
    counted, and bulk calls kept off circuit relays."""

    def __init__(self, p2p: P2P) -> None:
        self._p2p = p2p
        self.opened: dict[str, int] = {}  # streams our calls opened, per remote peer
        self.direct: dict[str, list[Multiaddr]] = {}  # peer -> its last announced direct addresses
        self._unreached: dict[str, str] = {}  # peer -> why our last dial of it failed (none since)

    async def open_stream(self, peer: str) -> _Stream:
        info, reader, writer = await self.dial(
            peer, lambda: self._p2p.call_binary_stream_handler(PeerID.from_base58(peer), PROTOCOL)
        )
        self.opened[peer] = self.opened.get(peer, 0) + 1
        return _Stream(reader, writer, relayed(info.addr))

    async def direct_stream(self, peer: str, verb: str, relayed_stream: _Stream) -> _Stream:
        """Our only connection to `peer` goes through a relay: dial its announced direct addresses
        (libp2p opens new streams on a direct connection once there is one), then try once more."""
        relayed_stream.writer.close()
        addresses = self.direct.get(peer, [])
        if addresses:
            with contextlib.suppress(ControlFailure, P2PDaemonError, OSError, ValueError):
                await self._p2p._client.connect(PeerID.from_base58(peer), addresses)
        stream = await self.open_stream(peer)
        if stream.relayed:
            stream.writer.close()
            tried = (
                f"its {len(addresses)} announced direct addresses did not answer"
                if addresses
                else "it announces no direct address"
            )
            raise RelayOnly(
                f"peer {peer} is reachable only through a relay ({tried}); {verb} moves bulk data and is never relayed"
            )
        return stream

    async def dial(self, peer: str, dial: Callable[[], Awaitable[T]]) -> T:
        """`dial()` (a connect, or a stream open that may dial), waiting out our daemon's dial
        backoff (within the caller's deadline) unless a dial of ours explains it.

        After a failed dial our daemon refuses for about 5 s (longer after repeated failures) to
        dial the same address again, answering "dial backoff" at once. A dial we made ourselves
        that failed is evidence about the peer, and so is the backoff after it. One we did not
        see (our DHT node's, on the same daemon: it gives up on a slow handshake within its own
        short timeout) is not: failing our call on its backoff once marked a live peer gone at
        the first step of a swarm started on a loaded machine."""
        while True:
            try:
                result = await dial()
            except P2PDaemonError as e:
                if not backed_off(e):
                    self._unreached[peer] = str(e)
                    raise
                if peer in self._unreached:
                    raise P2PDaemonError(f"{e} (after: {self._unreached[peer]})") from e
                await asyncio.sleep(_BACKOFF_POLL)
            else:
                self._unreached.pop(peer, None)
                return result


class Transport:
    """Async request/response of (header, tensors) with other peers over one hivemind P2P."""

    def __init__(self, p2p: P2P, config: TransportConfig | None = None, *, owns_p2p: bool = False) -> None:
        self.config = config or TransportConfig()
        self._p2p, self._owns_p2p = p2p, owns_p2p
        self._counts: dict[str, ByteCounts] = {}
        self._server = Server(self.config, self._counts_for)
        self._idle = _IdleStreams(self.config.header_timeout / 3)
        self._dialer = _Dialer(p2p)
        self._started = self._closed = False

    @classmethod
    async def create(
        cls,
        host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        initial_peers: Sequence[str] = (),
        identity_path: str | None = None,
        config: TransportConfig | None = None,
        **p2p_options: Any,
    ) -> Transport:
        """Start a p2pd daemon that dies with this process, and serve on it."""
        p2p = await start_p2p(
            initial_peers=list(initial_peers) or None,
            host_maddrs=list(host_maddrs),
            identity_path=identity_path,
            **p2p_options,
        )
        transport = cls(p2p, config, owns_p2p=True)
        try:
            await transport.start()
        except BaseException:
            await transport.shutdown()
            raise
        return transport

    async def start(self) -> None:
        """Register our stream handler with the daemon; `create` does this for you."""
        if not self._started:
            await self._p2p.add_binary_stream_handler(PROTOCOL, self._server.on_stream)
            self._started = True

    async def __aenter__(self) -> Transport:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def peer_id(self) -> str:
        return self._p2p.peer_id.to_base58()

    @property
    def p2p(self) -> P2P:
        return self._p2p

    async def visible_addresses(self) -> list[str]:
        """Multiaddrs (with /p2p/<id>) that other peers can dial."""
        return [str(addr) for addr in await self._p2p.get_visible_maddrs()]

    def register(self, verb: str, handler: Handler, accepts: Accepts = NONE) -> None:
        """Serve `verb` with `handler`: see Server.register."""
        self._server.register(verb, handler, accepts)

    def register_stream(
        self, verb: str, handler: StreamHandler, on_close: Callable[[], None], accepts: Accepts = NONE
    ) -> None:
        """Serve `verb` with a stream handler: see Server.register_stream."""
        self._server.register_stream(verb, handler, on_close, accepts)

    @property
    def gatekeeper(self) -> Gatekeeper | None:
        """(caller, verb, header) -> raises Refused to turn a caller away (peer/tickets.py's gate)."""
        return self._server.gatekeeper

    @gatekeeper.setter
    def gatekeeper(self, gate: Gatekeeper | None) -> None:
        self._server.gatekeeper = gate

    def received_from(self, peer: str) -> int:
        """Bytes received from `peer` so far (framing included, counted as they arrive)."""
        counts = self._counts.get(peer)
        return 0 if counts is None else counts.received_total

    def streams_from(self, peer: str) -> int:
        """Inbound streams of `peer`'s that hold a slot now (being served, or a refusal lingering)."""
        return self._server.admission.streams.get(peer, 0)

    def streams_opened_to(self, peer: str) -> int:
        """Streams our calls to `peer` have opened so far (a kept stream serves many calls)."""
        return self._dialer.opened.get(peer, 0)

    def close_idle(self, peer: str | None = None) -> None:
        """Close the streams kept for reuse to `peer` (to every peer without one)."""
        self._idle.drop(peer)

    def kept_from(self, peer: str) -> int:
        """Inbound streams of `peer`'s kept open between its requests, for reuse."""
        return self._server.admission.kept.get(peer, 0)

    def byte_counts(self) -> dict[str, dict[str, int]]:
        """Snapshot of bytes moved per remote peer id (diff two snapshots for one outer step)."""
        return {peer: counts.as_dict() for peer, counts in sorted(self._counts.items())}

    async def settle(self, timeout: float) -> bool:
        """Close the streams our calls keep for reuse, then wait up to `timeout` s until every
        caller has closed its streams to us (or gone): a reply we wrote last has reached a caller
        that closed its stream. True if all have; then shutting down loses no reply."""
        self.close_idle()
        return await self._server.callers_gone(timeout)

    async def shutdown(self) -> None:
        """Stop serving, fail pending exchanges, and stop the daemon if we started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.close_idle()
        await self._server.stop()
        if self._owns_p2p:
            try:
                await asyncio.wait_for(self._p2p.shutdown(), 10)
            except TimeoutError:  # p2pd ignored SIGTERM; do not leave it behind
                child = getattr(self._p2p, "_child", None)
                if child is not None and child.returncode is None:
                    child.kill()
                    await child.wait()
        elif self._started:
            with contextlib.suppress(P2PDaemonError, OSError):
                await self._p2p.remove_binary_stream_handler(PROTOCOL)

    # -- calling ----------------------------------------------------------------------------

    async def connect(self, peer_id: str, addresses: Sequence[str], *, timeout: float) -> bool:
        """Dial `peer_id` at its announced addresses (False if it fails): a fresh daemon knows only
        the peers it has talked to, and a first call without this can fail with "Connect failed"."""
        maddrs = []
        for address in addresses:
            with contextlib.suppress(ValueError, TypeError):  # an announcement's address is untrusted
                maddrs.append(dialable(Multiaddr(address), peer_id))
        if direct := [m for m in maddrs if not relayed(m)]:
            self._dialer.direct[peer_id] = direct
        try:
            async with asyncio.timeout(timeout):
                await self._dialer.dial(
                    peer_id, lambda: self._p2p._client.connect(PeerID.from_base58(peer_id), maddrs)
                )
        except (ControlFailure, P2PDaemonError, OSError, TimeoutError, ValueError) as e:
            logger.debug("could not connect to %s: %s", peer_id, e)
            return False
        return True

    async def redial(self, peer_id: str, addresses: Sequence[str], *, timeout: float) -> bool:
        """Drop our connection to `peer_id` and dial it again. After our link was cut, the old
        connection can stay open while its TCP retransmissions back off for tens of seconds, so
        calls over it hang although the link is back; a fresh one answers at once. (Without
        addresses to dial it only connects: dropping the connection could lose the peer.)"""
        if not addresses:
            return await self.connect(peer_id, addresses, timeout=timeout)
        self.close_idle(peer_id)  # streams of the old connection
        with contextlib.suppress(ControlFailure, P2PDaemonError, OSError, ValueError):
            async with asyncio.timeout(timeout):
                await self._p2p._client.disconnect(PeerID.from_base58(peer_id))
        return await self.connect(peer_id, addresses, timeout=timeout)

    async def call(
        self,
        peer_id: str | PeerID,
        verb: str,
        header: Message,
        tensors: Sequence[torch.Tensor] = (),
        *,
        timeout: float,
        expect: tuple[codec.TensorMeta, ...] | None = None,
        confirmed: bool = False,
        pace: streams.Pacer | None = None,
        direct: bool = False,
    ) -> tuple[Message, list[torch.Tensor]]:
        """Send (header, tensors) to `peer_id`'s `verb` handler and return its reply, all within
        `timeout`. With `expect`, a reply carrying other tensors is refused before it is read.
        With `confirmed`, the call ends only when the remote confirms it read all of our frame
        (for a verb that replies while still reading: see streams.call_frames). With `pace`, our
        tensors are sent at that pace (streams.write_frame). With `direct` (bulk data: an outer
        exchange, a state chunk), never through a circuit relay: a stream that opens on a relayed
        connection is closed unused, the peer's announced direct addresses are dialled once, and
        if the next stream comes through a relay too the call fails with RelayOnly."""
        return await self._call(
            str(peer_id),
            verb,
            header,
            tensors,
            timeout,
            expect,
            confirmed=confirmed,
            pace=pace,
            direct=direct,
        )

    async def _call(
        self,
        peer: str,
        verb: str,
        header: Message,
        tensors: Sequence[torch.Tensor],
        timeout: float,
        expect: tuple[codec.TensorMeta, ...] | None,
        confirmed: bool = False,
        pace: streams.Pacer | None = None,
        direct: bool = False,
    ) -> tuple[Message, list[torch.Tensor]]:
        if self._closed:
            raise RuntimeError("this transport is shut down")
        wire = streams.prepare(tensors)
        envelope = Envelope(verb, codec.encode(header), tuple(codec.TensorMeta.of(t) for t in wire))
        declared = streams.declared_tensors(header)
        if declared is not None and declared != envelope.tensors:
            raise ValueError(f"{header.TAG} header declares {declared}, tensors are {envelope.tensors}")
        counts = self._counts_for(peer)
        reuse = not confirmed  # a confirmed call ends in the callee's stream handler, which closes
        try:
            async with asyncio.timeout(timeout):
                kept = self._idle.take(peer, direct) if reuse else None
                if kept is not None:
                    try:
                        return await self._frames(
                            peer, verb, kept, envelope, wire, counts, expect, confirmed, pace
                        )
                    except _Unanswered:
                        pass  # the callee had let this stream go: a fresh one, as without reuse
                stream = await self._dialer.open_stream(peer)
                if direct and stream.relayed:
                    stream = await self._dialer.direct_stream(peer, verb, stream)
                return await self._frames(peer, verb, stream, envelope, wire, counts, expect, confirmed, pace)
        except PeerUnavailable:
            raise
        except TimeoutError as e:
            raise PeerUnavailable(f"peer {peer} did not complete {verb} within {timeout:.1f} s") from e
        except (P2PDaemonError, OSError, EOFError) as e:  # dial failed, or the stream broke
            raise PeerUnavailable(f"peer {peer} is unreachable for {verb}: {e}") from e

    async def _frames(
        self,
        peer: str,
        verb: str,
        stream: _Stream,
        envelope: Envelope,
        wire: list[torch.Tensor],
        counts: ByteCounts,
        expect: tuple[codec.TensorMeta, ...] | None,
        confirmed: bool,
        pace: streams.Pacer | None = None,
    ) -> tuple[Message, list[torch.Tensor]]:
        """One call's frames on `stream`; the stream is kept for reuse after a whole plain answer."""
        reader, writer = stream.reader, stream.writer
        lose, kept = _LostReply(verb), False
        try:
            answer = await streams.call_frames(
                peer, reader, writer, envelope, wire, counts, self.config, expect, confirmed, lose, pace
            )
        except StreamClosed as e:  # closed before the first byte of an answer: not served
            raise _Unanswered(str(e)) from e
        except TimeoutError:
            raise
        except (OSError, EOFError) as e:  # the stream broke (reset) after it opened
            raise StreamClosed(f"the stream to {peer} for {verb} broke: {e}") from e
        else:
            lose.raise_if_lost(peer)
            kept = not confirmed and not self._closed
            return answer
        finally:
            if kept:
                self._idle.give(peer, stream)
            else:
                writer.close()

    def _counts_for(self, peer: str) -> ByteCounts:
        return self._counts.setdefault(peer, ByteCounts())


def backed_off(error: BaseException) -> bool:
    """Did our daemon refuse a dial only because earlier dials of the same addresses failed? (Its
    message lists each address it tried, with why it failed.)"""
    text = str(error)
    tried = [line.strip() for line in text.splitlines() if line.strip().startswith("* [")]
    return "dial backoff" in text and all(line.endswith("dial backoff") for line in tried)


def dialable(address: Multiaddr, peer_id: str) -> Multiaddr:
    """`address` without its trailing /p2p/<peer_id> (the daemon is given the peer id apart), with
    any other /p2p/ part (a relay's, in a /p2p-circuit address) in the binary form p2pd reads.
    py-multiaddr writes a /p2p/ part as a CID, which p2pd cannot parse ("length greater than
    remaining number of bytes in buffer"): every dial with a full announced address failed, and
    so did every dial of a relayed one."""
    tail = Multiaddr(f"/p2p/{peer_id}")
    if str(address).endswith(str(tail)):
        address = address.decapsulate(tail)
    parts = []
    for part in address.split():
        ((protocol, value),) = part.items()
        if protocol.name == "p2p":  # code 421, then the multihash's length and bytes
            digest = PeerID.from_base58(value).to_bytes()
            parts.append(_P2P_CODE + _uvarint(len(digest)) + digest)
        else:
            parts.append(part.to_bytes())
    return Multiaddr(b"".join(parts))


_P2P_CODE = bytes.fromhex("a503")  # the unsigned varint of 421, the p2p protocol's code


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)
