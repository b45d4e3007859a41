"""The libp2p tensor transport of a peer: generic (header, tensors) request/response by verb.

One libp2p protocol (`PROTOCOL`) carries every verb. A call is one exchange of frames on a stream
(peer/streams.py): the caller writes its request, the callee its reply, both directions at once. A
verb is served either by a handler (`register`: tensors in, reply out) or by a stream handler that
owns the rest of the stream (`register_stream`: the outer exchange, which starts its reply while
the request's tensors still arrive; peer/exchange.py).

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
A server never lets a bad request escape its stream: it answers ErrorReply when it still can, counts
the bad message against the sender, and keeps serving. Each verb is registered with the tensors its
request may carry (`Accepts`), and each caller may hold only so many streams and bytes at once
(peer/limits.py): both are checked before any tensor byte is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure, P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from noloco_swarm.peer import failpoints, streams
from noloco_swarm.peer.lifetime import start_p2p
from noloco_swarm.peer.limits import NONE, Accepts, Admission
from noloco_swarm.peer.streams import (
    ByteCounts,
    InboundStream,
    PeerUnavailable,
    Refused,
    RemoteRefused,
    StreamClosed,
    StreamTruncated,
    TransportConfig,
)
from noloco_swarm.protocol import messages
from noloco_swarm.protocol.messages import REPLY_VERB, Envelope, Message

__all__ = [
    "PROTOCOL",
    "Accepts",
    "Handler",
    "InboundStream",
    "PeerUnavailable",
    "Refused",
    "RemoteRefused",
    "StreamClosed",
    "StreamTruncated",
    "Transport",
    "TransportConfig",
]

logger = logging.getLogger(__name__)

PROTOCOL = "noloco_swarm.transport.v1"
_BUSY_LINGER = 1.0  # seconds a 'busy' refusal waits for the caller to read it
_IDLE_PER_PEER = 4  # streams a caller keeps for reuse per remote peer (more are closed)
Handler = Callable[[str, Message, list[torch.Tensor]], Awaitable[tuple[Message, Sequence[torch.Tensor]]]]
# Serves a verb from the envelope on: reads the request's tensors and writes the reply itself.
StreamHandler = Callable[[InboundStream, Message, Envelope], Awaitable[None]]


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
        self._idle: dict[str, list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    def take(self, peer: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The most recently used idle stream to `peer` still within its deadline, if any."""
        kept, now = self._idle.get(peer, []), time.monotonic()
        while kept:
            until, reader, writer = kept.pop()
            if until > now and not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        self._idle.pop(peer, None)
        return None

    def give(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kept = self._idle.setdefault(peer, [])
        if len(kept) >= _IDLE_PER_PEER or reader.at_eof() or writer.is_closing():
            writer.close()
            return
        kept.append((time.monotonic() + self._keep, reader, writer))

    def drop(self, peer: str | None = None) -> None:
        """Close the idle streams to `peer` (to every peer without one)."""
        for key in [peer] if peer is not None else list(self._idle):
            for _, _, writer in self._idle.pop(key, []):
                writer.close()


class Transport:
    """Async request/response of (header, tensors) with other peers over one hivemind P2P."""

    def __init__(self, p2p: P2P, config: TransportConfig | None = None, *, owns_p2p: bool = False) -> None:
        self.config = config or TransportConfig()
        self._p2p, self._owns_p2p = p2p, owns_p2p
        self._handlers: dict[str, Handler] = {}
        self._stream_handlers: dict[str, StreamHandler] = {}
        self._accepts: dict[str, Accepts] = {}
        self._admission = Admission(self.config)
        self._counts: dict[str, ByteCounts] = {}
        self._serving: set[asyncio.Task[Any]] = set()
        self._closing: list[Callable[[], None]] = []
        self._idle = _IdleStreams(self.config.header_timeout / 3)
        self._opened: dict[str, int] = {}  # streams our calls opened, per remote peer
        self._started = self._closed = False
        # (caller, verb, header) -> raises Refused to turn a caller away (peer/tickets.py's gate)
        self.gatekeeper: Callable[[str, str, Message], Awaitable[None]] | None = None

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
            await self._p2p.add_binary_stream_handler(PROTOCOL, self._on_stream)
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
        """Serve `verb` with `handler(peer_id, header, tensors) -> (reply_header, reply_tensors)`.

        A request may carry only the tensors `accepts` allows (by default none); others are refused
        before a byte of them is read. The handler may raise MessageError (bad input: the caller
        gets ErrorReply 'bad_request') or Refused (the caller gets ErrorReply with its code).
        Received tensors are already checked against the header's metas and for finiteness.
        """
        self._check_new_verb(verb, accepts)
        self._handlers[verb] = handler

    def register_stream(
        self, verb: str, handler: StreamHandler, on_close: Callable[[], None], accepts: Accepts = NONE
    ) -> None:
        """Serve `verb` with `handler(stream, header, envelope)`, which reads the request's tensors
        (those `accepts` allows; their bytes are reserved for it) and writes the reply itself. It
        may raise what a handler may. `on_close` runs at shutdown, after serving has stopped."""
        self._check_new_verb(verb, accepts)
        self._stream_handlers[verb] = handler
        self._closing.append(on_close)

    def _check_new_verb(self, verb: str, accepts: Accepts) -> None:
        Envelope(verb, b"")  # validates the verb's form
        if verb == REPLY_VERB:
            raise ValueError(f"{REPLY_VERB!r} is not a verb")
        if verb in self._handlers or verb in self._stream_handlers:
            raise ValueError(f"{verb} is served already")
        self._accepts[verb] = accepts

    def received_from(self, peer: str) -> int:
        """Bytes received from `peer` so far (framing included, counted as they arrive)."""
        counts = self._counts.get(peer)
        return 0 if counts is None else counts.received_total

    def streams_from(self, peer: str) -> int:
        """Inbound streams of `peer`'s that hold a slot now (being served, or a refusal lingering)."""
        return self._admission.streams.get(peer, 0)

    def streams_opened_to(self, peer: str) -> int:
        """Streams our calls to `peer` have opened so far (a kept stream serves many calls)."""
        return self._opened.get(peer, 0)

    def close_idle(self, peer: str | None = None) -> None:
        """Close the streams kept for reuse to `peer` (to every peer without one)."""
        self._idle.drop(peer)

    def kept_from(self, peer: str) -> int:
        """Inbound streams of `peer`'s kept open between its requests, for reuse."""
        return self._admission.kept.get(peer, 0)

    def byte_counts(self) -> dict[str, dict[str, int]]:
        """Snapshot of bytes moved per remote peer id (diff two snapshots for one outer step)."""
        return {peer: counts.as_dict() for peer, counts in sorted(self._counts.items())}

    async def shutdown(self) -> None:
        """Stop serving, fail pending exchanges, and stop the daemon if we started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.close_idle()
        for task in self._serving:
            task.cancel()
        await asyncio.gather(*self._serving, return_exceptions=True)
        for close in self._closing:
            close()
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
        try:
            async with asyncio.timeout(timeout):
                await self._p2p._client.connect(PeerID.from_base58(peer_id), maddrs)
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
        expect: tuple[messages.TensorMeta, ...] | None = None,
        confirmed: bool = False,
    ) -> tuple[Message, list[torch.Tensor]]:
        """Send (header, tensors) to `peer_id`'s `verb` handler and return its reply, all within
        `timeout`. With `expect`, a reply carrying other tensors is refused before it is read.
        With `confirmed`, the call ends only when the remote confirms it read all of our frame
        (for a verb that replies while still reading: see streams.call_frames)."""
        return await self._call(
            str(peer_id), verb, header, tensors, timeout, expect=expect, confirmed=confirmed
        )

    async def _call(
        self,
        peer: str,
        verb: str,
        header: Message,
        tensors: Sequence[torch.Tensor],
        timeout: float,
        expect: tuple[messages.TensorMeta, ...] | None,
        confirmed: bool = False,
    ) -> tuple[Message, list[torch.Tensor]]:
        if self._closed:
            raise RuntimeError("this transport is shut down")
        wire = streams.prepare(tensors)
        envelope = Envelope(verb, messages.encode(header), tuple(messages.TensorMeta.of(t) for t in wire))
        declared = streams.declared_tensors(header)
        if declared is not None and declared != envelope.tensors:
            raise ValueError(f"{header.TAG} header declares {declared}, tensors are {envelope.tensors}")
        counts = self._counts_for(peer)
        reuse = not confirmed  # a confirmed call ends in the callee's stream handler, which closes
        try:
            async with asyncio.timeout(timeout):
                kept = self._idle.take(peer) if reuse else None
                if kept is not None:
                    try:
                        return await self._frames(peer, verb, kept, envelope, wire, counts, expect, confirmed)
                    except _Unanswered:
                        pass  # the callee had let this stream go: a fresh one, as without reuse
                _, reader, writer = await self._p2p.call_binary_stream_handler(
                    PeerID.from_base58(peer), PROTOCOL
                )
                self._opened[peer] = self._opened.get(peer, 0) + 1
                return await self._frames(
                    peer, verb, (reader, writer), envelope, wire, counts, expect, confirmed
                )
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
        stream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        envelope: Envelope,
        wire: list[torch.Tensor],
        counts: ByteCounts,
        expect: tuple[messages.TensorMeta, ...] | None,
        confirmed: bool,
    ) -> tuple[Message, list[torch.Tensor]]:
        """One call's frames on `stream`; the stream is kept for reuse after a whole plain answer."""
        reader, writer = stream
        lose, kept = _LostReply(verb), False
        try:
            answer = await streams.call_frames(
                peer, reader, writer, envelope, wire, counts, self.config, expect, confirmed, lose
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
                self._idle.give(peer, reader, writer)
            else:
                writer.close()

    # -- serving ----------------------------------------------------------------------------

    async def _on_stream(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serve one inbound stream, request after request; nothing a remote sends escapes this."""
        peer = info.peer_id.to_base58()  # authenticated by p2pd: the caller cannot choose it
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        try:
            # A new stream's slot is held from its first byte, a refusal's linger included: a
            # caller flooding us with streams (garbage or silent) holds at most its cap of them.
            with self._admission.stream(peer):
                more = await self._answer(self._inbound(peer, reader, writer), first=True)
            with self._admission.keep(peer) as kept:  # idle between requests: no slot, its own cap
                while more and kept:
                    more = await self._answer(self._inbound(peer, reader, writer), first=False)
        except Refused as e:  # no slot for this caller: 'busy', answered briefly
            await streams.refuse(self._inbound(peer, reader, writer), e.code, e.reason, _BUSY_LINGER)
        except asyncio.CancelledError:  # shut down while serving: end here (raised, asyncio logs it)
            return
        finally:
            self._serving.discard(task)
            with contextlib.suppress(RuntimeError):  # a loop closed under an unfinished stream
                writer.close()

    async def _answer(self, stream: InboundStream, first: bool) -> bool:
        """Serve one request within its deadline; answer ErrorReply for whatever goes wrong. True
        if the stream may carry another request (a handler's whole reply went out)."""
        try:
            async with asyncio.timeout(self.config.serve_timeout):
                return await self._serve(stream, first)
        except messages.MessageError as e:  # they sent garbage (or died mid-frame)
            stream.counts.bad_messages += 1
            logger.info("rejected a malformed request from %s: %s", stream.peer, e)
            await streams.refuse(stream, "bad_request", str(e))
        except Refused as e:
            # A busy refusal lingers briefly: a flood of requests must not pile up lingering tasks.
            linger = _BUSY_LINGER if e.code == "busy" else streams.REFUSAL_DEADLINE
            await streams.refuse(stream, e.code, e.reason, linger)
        except TimeoutError:
            await streams.refuse(stream, "timeout", f"not served within {self.config.serve_timeout:.0f} s")
        except (PeerUnavailable, OSError) as e:  # the caller went away; nothing to answer
            logger.debug("stream from %s broke: %s", stream.peer, e)
        except Exception as e:  # a bug in a handler: tell the caller, then let it surface
            await streams.refuse(stream, "internal", f"the remote failed: {type(e).__name__}")
            raise
        return False

    async def _serve(self, stream: InboundStream, first: bool) -> bool:
        """One request; True if its stream may carry another. A kept stream (not `first`) takes
        its slot once the next envelope is in; one that ends or stays idle for `header_timeout`
        is closed without a word: its caller stopped offering it for new calls a while ago, and
        sends a call that meets it closed again on a fresh stream."""
        try:
            async with asyncio.timeout(self.config.header_timeout):
                envelope = await streams.read_envelope(stream.reader, stream.counts)
        except StreamClosed:
            if first:
                raise
            return False
        except TimeoutError:
            if not first:
                return False
            raise Refused("timeout", f"no request within {self.config.header_timeout:.0f} s") from None
        with contextlib.nullcontext() if first else self._admission.stream(stream.peer):
            return await self._handle(stream, envelope)

    async def _handle(self, stream: InboundStream, envelope: Envelope) -> bool:
        header = streams.open_envelope(envelope, self.config.max_frame_bytes)
        verb = envelope.verb
        if verb not in self._handlers and verb not in self._stream_handlers:
            raise Refused("unknown_verb", f"this peer does not serve {verb}")
        if self.gatekeeper is not None:  # who may call at all, before what they send
            await self.gatekeeper(stream.peer, verb, header)
        try:  # from the envelope alone: not a byte of the tensors is read or allocated yet
            self._accepts[verb].check(envelope.tensors, verb)
        except Refused:
            stream.counts.bad_messages += 1
            raise
        with self._admission.reserve(stream.peer, envelope.nbytes):
            if verb in self._stream_handlers:
                await self._stream_handlers[verb](stream, header, envelope)
                return False  # the stream handler owned the stream to its end
            tensors = await streams.read_tensors(
                stream.reader, envelope.tensors, stream.counts, stream.part_bytes, stream.writer.transport
            )
            reply_header, reply_tensors = await self._handlers[verb](stream.peer, header, tensors)
        if failpoints.fire("close_unanswered", verb):
            return False  # closed without a reply, as p2pd now and then does under load
        await streams.reply(stream, reply_header, reply_tensors)
        return True

    def _inbound(
        self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> InboundStream:
        return InboundStream(peer, self._counts_for(peer), reader, writer, self.config.part_bytes)

    def _counts_for(self, peer: str) -> ByteCounts:
        return self._counts.setdefault(peer, ByteCounts())


def dialable(address: Multiaddr, peer_id: str) -> Multiaddr:
    """`address` without its trailing /p2p/<peer_id>: the daemon is given the peer id apart, and
    py-multiaddr writes a /p2p/ part as a CID, which p2pd cannot parse ("length greater than
    remaining number of bytes in buffer"): every dial with a full announced address failed."""
    tail = Multiaddr(f"/p2p/{peer_id}")
    return address.decapsulate(tail) if str(address).endswith(str(tail)) else address
