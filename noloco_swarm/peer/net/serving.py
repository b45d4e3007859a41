"""The serving side of the tensor transport: inbound streams, request after request.

A stream's first request takes one of its caller's stream slots from the stream's first byte;
after a handler's whole reply the stream is kept (within its caller's cap of kept streams) and its
next request read for up to `header_timeout`, taking a slot again once its envelope is in. The
caller reuses it (peer/net/transport.py). Each verb is registered with the tensors its request may
carry (`Accepts`) and each caller may hold only so many streams and bytes at once
(peer/net/limits.py): both are checked before any tensor byte is read. Nothing a remote sends escapes
`on_stream`: a bad request is answered with ErrorReply where it still can be, counted against its
sender, and serving goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from noloco_swarm.peer import failpoints
from noloco_swarm.peer.net import streams
from noloco_swarm.peer.net.limits import NONE, Accepts, Admission
from noloco_swarm.peer.net.streams import (
    ByteCounts,
    InboundStream,
    PeerUnavailable,
    Refused,
    StreamClosed,
    TransportConfig,
)
from noloco_swarm.protocol import codec
from noloco_swarm.protocol.codec import Message
from noloco_swarm.protocol.rpc import REPLY_VERB, Envelope

logger = logging.getLogger(__name__)

_BUSY_LINGER = 1.0  # seconds a 'busy' refusal waits for the caller to read it
_SETTLE_POLL = 0.02  # seconds between looks for inbound streams still open (callers_gone)
Handler = Callable[[str, Message, list[torch.Tensor]], Awaitable[tuple[Message, Sequence[torch.Tensor]]]]
# Serves a verb from the envelope on: reads the request's tensors and writes the reply itself.
StreamHandler = Callable[[InboundStream, Message, Envelope], Awaitable[None]]
# (caller, verb, header) -> raises Refused to turn a caller away (peer/tickets.py's gate)
Gatekeeper = Callable[[str, str, Message], Awaitable[None]]


class Server:
    """Serves one transport's verbs on the streams remotes open to it."""

    def __init__(self, config: TransportConfig, counts_for: Callable[[str], ByteCounts]) -> None:
        self.config, self._counts_for = config, counts_for
        self.handlers: dict[str, Handler] = {}
        self._stream_handlers: dict[str, StreamHandler] = {}
        self._accepts: dict[str, Accepts] = {}
        self.admission = Admission(config)
        self._serving: set[asyncio.Task[Any]] = set()
        self._closing: list[Callable[[], None]] = []
        self.gatekeeper: Gatekeeper | None = None

    async def stop(self) -> None:
        """End every stream being served, then run the stream handlers' `on_close`."""
        for task in self._serving:
            task.cancel()
        await asyncio.gather(*self._serving, return_exceptions=True)
        for close in self._closing:
            close()

    async def callers_gone(self, timeout: float) -> bool:
        """Wait up to `timeout` s until no inbound stream is open (each caller closed its own, or
        went away); True if none is."""
        deadline = time.monotonic() + timeout
        while self._serving and time.monotonic() < deadline:
            await asyncio.sleep(_SETTLE_POLL)
        return not self._serving

    def register(self, verb: str, handler: Handler, accepts: Accepts = NONE) -> None:
        """Serve `verb` with `handler(peer_id, header, tensors) -> (reply_header, reply_tensors)`.

        A request may carry only the tensors `accepts` allows (by default none); others are refused
        before a byte of them is read. The handler may raise MessageError (bad input: the caller
        gets ErrorReply 'bad_request') or Refused (the caller gets ErrorReply with its code).
        Received tensors are already checked against the header's metas and for finiteness.
        """
        self._check_new_verb(verb, accepts)
        self.handlers[verb] = handler

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
        if verb in self.handlers or verb in self._stream_handlers:
            raise ValueError(f"{verb} is served already")
        self._accepts[verb] = accepts

    async def on_stream(
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
            relay = streams.relayed(info.addr)
            with self.admission.stream(peer):
                more = await self._answer(self._inbound(peer, reader, writer, relay), first=True)
            with self.admission.keep(peer) as kept:  # idle between requests: no slot, its own cap
                while more and kept:
                    more = await self._answer(self._inbound(peer, reader, writer, relay), first=False)
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
        except codec.MessageError as e:  # they sent garbage (or died mid-frame)
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
        with contextlib.nullcontext() if first else self.admission.stream(stream.peer):
            return await self._handle(stream, envelope)

    async def _handle(self, stream: InboundStream, envelope: Envelope) -> bool:
        header = streams.open_envelope(envelope, self.config.max_frame_bytes)
        verb = envelope.verb
        if verb not in self.handlers and verb not in self._stream_handlers:
            raise Refused("unknown_verb", f"this peer does not serve {verb}")
        if self.gatekeeper is not None:  # who may call at all, before what they send
            await self.gatekeeper(stream.peer, verb, header)
        try:  # from the envelope alone: not a byte of the tensors is read or allocated yet
            self._accepts[verb].check(envelope.tensors, verb)
        except Refused:
            stream.counts.bad_messages += 1
            raise
        if stream.relayed and self._accepts[verb].direct_only:
            raise Refused("relayed", f"{verb} moves bulk data and is never served through a relay")
        with self.admission.reserve(stream.peer, envelope.nbytes):
            if verb in self._stream_handlers:
                await self._stream_handlers[verb](stream, header, envelope)
                return False  # the stream handler owned the stream to its end
            tensors = await streams.read_tensors(
                stream.reader, envelope.tensors, stream.counts, stream.part_bytes, stream.writer.transport
            )
            reply_header, reply_tensors = await self.handlers[verb](stream.peer, header, tensors)
        if failpoints.fire("close_unanswered", verb):
            return False  # closed without a reply, as p2pd now and then does under load
        await streams.reply(stream, reply_header, reply_tensors)
        return True

    def _inbound(
        self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, relayed: bool = False
    ) -> InboundStream:
        return InboundStream(
            peer, self._counts_for(peer), reader, writer, self.config.part_bytes, relayed=relayed
        )
