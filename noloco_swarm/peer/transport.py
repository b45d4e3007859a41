"""The libp2p tensor transport of a peer: generic (header, tensors) request/response by verb.

One libp2p protocol (`PROTOCOL`) carries every verb; each call opens a stream on which each side
sends one frame (peer/streams.py): the caller its request, the callee its reply. Both directions
run concurrently. A verb is served either by a handler (`register`: tensors in, reply out) or by a
stream handler that owns the rest of the stream (`register_stream`: the outer exchange, which
starts its reply while the request's tensors still arrive; peer/exchange.py).

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

    def byte_counts(self) -> dict[str, dict[str, int]]:
        """Snapshot of bytes moved per remote peer id (diff two snapshots for one outer step)."""
        return {peer: counts.as_dict() for peer, counts in sorted(self._counts.items())}

    async def shutdown(self) -> None:
        """Stop serving, fail pending exchanges, and stop the daemon if we started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
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
        try:
            async with asyncio.timeout(timeout):
                _, reader, writer = await self._p2p.call_binary_stream_handler(
                    PeerID.from_base58(peer), PROTOCOL
                )
                lose = _LostReply(verb)
                try:
                    answer = await streams.call_frames(
                        peer, reader, writer, envelope, wire, counts, self.config, expect, confirmed, lose
                    )
                except TimeoutError:
                    raise
                except (OSError, EOFError) as e:  # the stream broke (reset) after it opened
                    raise StreamClosed(f"the stream to {peer} for {verb} broke: {e}") from e
                else:
                    lose.raise_if_lost(peer)
                    return answer
                finally:
                    writer.close()
        except PeerUnavailable:
            raise
        except TimeoutError as e:
            raise PeerUnavailable(f"peer {peer} did not complete {verb} within {timeout:.1f} s") from e
        except (P2PDaemonError, OSError, EOFError) as e:  # dial failed, or the stream broke
            raise PeerUnavailable(f"peer {peer} is unreachable for {verb}: {e}") from e

    # -- serving ----------------------------------------------------------------------------

    async def _on_stream(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serve one inbound stream; nothing a remote sends escapes this function."""
        peer = info.peer_id.to_base58()  # authenticated by p2pd: the caller cannot choose it
        stream = InboundStream(peer, self._counts_for(peer), reader, writer, self.config.part_bytes)
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        try:
            # The slot is held until a refusal has lingered too: a caller flooding us with garbage
            # holds at most its cap of streams, lingering ones included.
            with self._admission.stream(peer):
                await self._answer(stream)
        except Refused as e:  # no slot for this caller: 'busy', answered briefly
            await streams.refuse(stream, e.code, e.reason, _BUSY_LINGER)
        except asyncio.CancelledError:  # shut down while serving: end here (raised, asyncio logs it)
            return
        finally:
            self._serving.discard(task)
            with contextlib.suppress(RuntimeError):  # a loop closed under an unfinished stream
                writer.close()

    async def _answer(self, stream: InboundStream) -> None:
        """Serve one stream within its deadline; answer ErrorReply for whatever goes wrong."""
        try:
            async with asyncio.timeout(self.config.serve_timeout):
                await self._serve(stream)
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

    async def _serve(self, stream: InboundStream) -> None:
        try:
            async with asyncio.timeout(self.config.header_timeout):
                envelope = await streams.read_envelope(stream.reader, stream.counts)
        except TimeoutError:
            raise Refused("timeout", f"no request within {self.config.header_timeout:.0f} s") from None
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
                return
            tensors = await streams.read_tensors(
                stream.reader, envelope.tensors, stream.counts, stream.part_bytes, stream.writer.transport
            )
            reply_header, reply_tensors = await self._handlers[verb](stream.peer, header, tensors)
        if failpoints.fire("close_unanswered", verb):
            return  # closed without a reply, as p2pd now and then does under load
        await streams.reply(stream, reply_header, reply_tensors)

    def _counts_for(self, peer: str) -> ByteCounts:
        return self._counts.setdefault(peer, ByteCounts())


def dialable(address: Multiaddr, peer_id: str) -> Multiaddr:
    """`address` without its trailing /p2p/<peer_id>: the daemon is given the peer id apart, and
    py-multiaddr writes a /p2p/ part as a CID, which p2pd cannot parse ("length greater than
    remaining number of bytes in buffer"): every dial with a full announced address failed."""
    tail = Multiaddr(f"/p2p/{peer_id}")
    return address.decapsulate(tail) if str(address).endswith(str(tail)) else address
