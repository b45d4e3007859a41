"""The libp2p tensor transport of a peer: header + tensors request/response and the outer exchange.

One libp2p protocol (`PROTOCOL`) carries every verb; each call opens a stream on which each side
sends one frame (peer/streams.py): the caller its request, the callee its reply. Both directions
run concurrently, so the outer exchange moves theta both ways at once on one stream.

Errors a caller sees: `PeerUnavailable` (cannot connect, deadline passed, stream broke),
`RemoteRefused` (the remote answered with an ErrorReply), `MessageError` (the remote sent garbage).
A server never lets a bad request escape its stream: it answers ErrorReply when it still can, counts
the bad message against the sender, and keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, overload

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure, P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from noloco_swarm.peer import streams
from noloco_swarm.peer.streams import (
    ByteCounts,
    InboundStream,
    PeerUnavailable,
    Refused,
    RemoteRefused,
    StreamTruncated,
    TransportConfig,
)
from noloco_swarm.protocol import messages
from noloco_swarm.protocol.messages import REPLY_VERB, Ack, Envelope, ExchangeHeader, Message

__all__ = [
    "PROTOCOL",
    "ExchangeKey",
    "Handler",
    "PeerUnavailable",
    "Refused",
    "RemoteRefused",
    "StreamTruncated",
    "Transport",
    "TransportConfig",
]

logger = logging.getLogger(__name__)

PROTOCOL = "noloco_swarm.transport.v1"
EXCHANGE_VERB = "rpc_exchange"
Handler = Callable[[str, Message, list[torch.Tensor]], Awaitable[tuple[Message, Sequence[torch.Tensor]]]]
ExchangeKey = tuple[int, ...]  # ExchangeHeader.key: (outer round, inner step[, phase])


class Transport:
    """Async request/response of (header, tensors) with other peers over one hivemind P2P."""

    def __init__(self, p2p: P2P, config: TransportConfig | None = None, *, owns_p2p: bool = False) -> None:
        self.config = config or TransportConfig()
        self._p2p, self._owns_p2p = p2p, owns_p2p
        self._handlers: dict[str, Handler] = {}
        self._counts: dict[str, ByteCounts] = {}
        self._serving: set[asyncio.Task[Any]] = set()
        self._inflight = 0
        self._started = self._closed = False
        # Outer exchange: our tensors per key, and what each caller sent us per (key, peer);
        # None marks a slot already delivered, so a replayed request is refused.
        self._provided: dict[ExchangeKey, tuple[torch.Tensor, ...]] = {}
        self._provided_to: dict[tuple[ExchangeKey, str], tuple[torch.Tensor, ...]] = {}  # per partner
        self._provided_changed = asyncio.Event()
        self._received: dict[tuple[ExchangeKey, str], asyncio.Future[tuple[torch.Tensor, ...]] | None] = {}
        self._exchange_tasks: dict[ExchangeKey, set[asyncio.Task[Any]]] = {}
        self._retired: ExchangeKey | None = None  # newest finished key; older ones are refused

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
        token = _DIE_WITH_PARENT.set(True)
        try:
            _install_die_with_parent_hook()
            p2p = await P2P.create(
                initial_peers=list(initial_peers) or None,
                host_maddrs=list(host_maddrs),
                identity_path=identity_path,
                **p2p_options,
            )
        finally:
            _DIE_WITH_PARENT.reset(token)
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

    def register(self, verb: str, handler: Handler) -> None:
        """Serve `verb` with `handler(peer_id, header, tensors) -> (reply_header, reply_tensors)`.

        The handler may raise MessageError (bad input: the caller gets ErrorReply 'bad_request') or
        Refused (the caller gets ErrorReply with its code). Received tensors are already checked
        against the header's metas and for finiteness.
        """
        Envelope(verb, b"")  # validates the verb's form
        if verb == REPLY_VERB:
            raise ValueError(f"{REPLY_VERB!r} is not a verb")
        if verb == EXCHANGE_VERB:
            raise ValueError(f"{EXCHANGE_VERB} is served by provide_exchange, not a handler")
        self._handlers[verb] = handler

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
        for key in {*self._provided, *(slot[0] for slot in self._received)}:
            self.forget_exchange(key)
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
        """Dial `peer_id` at the addresses it announced, so that calls to it need no lookup.

        A fresh daemon knows only the peers it has talked to; without this, the first call to a
        peer found through the run's directory can fail with "Connect failed". False if it fails.
        """
        maddrs = []
        for address in addresses:
            with contextlib.suppress(ValueError, TypeError):  # an announcement's address is untrusted
                maddrs.append(Multiaddr(address))
        try:
            async with asyncio.timeout(timeout):
                await self._p2p._client.connect(PeerID.from_base58(peer_id), maddrs)
        except (ControlFailure, P2PDaemonError, OSError, TimeoutError, ValueError) as e:
            logger.debug("could not connect to %s: %s", peer_id, e)
            return False
        return True

    async def call(
        self,
        peer_id: str | PeerID,
        verb: str,
        header: Message,
        tensors: Sequence[torch.Tensor] = (),
        *,
        timeout: float,
    ) -> tuple[Message, list[torch.Tensor]]:
        """Send (header, tensors) to `peer_id`'s `verb` handler and return its reply, all within `timeout`."""
        return await self._call(str(peer_id), verb, header, tensors, timeout, expect=None)

    @overload
    async def exchange(
        self, peer_id: str | PeerID, header: ExchangeHeader, tensors: torch.Tensor, *, timeout: float
    ) -> torch.Tensor: ...
    @overload
    async def exchange(
        self,
        peer_id: str | PeerID,
        header: ExchangeHeader,
        tensors: Sequence[torch.Tensor],
        *,
        timeout: float,
    ) -> tuple[torch.Tensor, ...]: ...
    async def exchange(
        self,
        peer_id: str | PeerID,
        header: ExchangeHeader,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        *,
        timeout: float,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Send our flat weights (one per `header.parts`) and get the partner's, both ways at once.

        Who calls whom: within a group each member calls every higher-ranked member (so in a pair
        the lower rank calls); the higher-ranked side calls `provide_exchange` and awaits
        `received_exchange` instead. Our tensors must match `header.meta`; the partner's must too.
        """
        single = isinstance(tensors, torch.Tensor)
        ours = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        expect = streams.declared_tensors(header)
        _, theirs = await self._call(str(peer_id), EXCHANGE_VERB, header, ours, timeout, expect=expect)
        return theirs[0] if single else tuple(theirs)

    async def _call(
        self,
        peer: str,
        verb: str,
        header: Message,
        tensors: Sequence[torch.Tensor],
        timeout: float,
        expect: tuple[messages.TensorMeta, ...] | None,
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
                try:
                    return await streams.call_frames(
                        peer, reader, writer, envelope, wire, counts, self.config, expect
                    )
                finally:
                    writer.close()
        except PeerUnavailable:
            raise
        except TimeoutError as e:
            raise PeerUnavailable(f"peer {peer} did not complete {verb} within {timeout:.1f} s") from e
        except (P2PDaemonError, OSError, EOFError) as e:  # dial failed, or the stream broke
            raise PeerUnavailable(f"peer {peer} is unreachable for {verb}: {e}") from e

    # -- the outer exchange, serving side --------------------------------------------------
    # State is created only by the local peer (provide, received_exchange) or by a completed
    # exchange for a key we provided, so no remote can grow it by asking for keys we never offer.

    def provide_exchange(
        self, key: ExchangeKey, tensors: torch.Tensor | Sequence[torch.Tensor], *, to: str | None = None
    ) -> None:
        """Offer our flat weights for outer exchange `key` to every partner that calls us for it.

        The tensors are sent from in place (no copy): do not modify them until `forget_exchange(key)`
        or a newer key is provided; both abort streams still sending them, so no partner ever
        accepts a torn tensor. Providing a key forgets all older keys; their callers are refused.
        """
        if self._retired is not None and key <= self._retired:
            raise ValueError(f"exchange {key} is not newer than the last finished one, {self._retired}")
        for old in (
            {k for k in self._provided} | {k for k, _ in self._provided_to} | {s[0] for s in self._received}
        ):
            if old < key:
                self.forget_exchange(old)
        ours = tuple(streams.prepare((tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)))
        if to is None:
            self._provided[key] = ours
        else:  # what only partner `to` gets (e.g. the shard it averages in an all-reduce)
            self._provided_to[(key, to)] = ours
        self._notify_provided()

    async def received_exchange(
        self, key: ExchangeKey, peer_id: str | PeerID, *, timeout: float
    ) -> tuple[torch.Tensor, ...]:
        """What `peer_id` sent us when it called rpc_exchange for `key` (awaits it, within `timeout`)."""
        slot = (key, str(peer_id))
        if slot in self._received and self._received[slot] is None:
            raise RuntimeError(f"exchange {key} with {peer_id} was already delivered")
        future = self._received.get(slot) or asyncio.get_running_loop().create_future()
        self._received[slot] = future
        try:
            result = await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError as e:
            raise PeerUnavailable(f"peer {peer_id} did not exchange {key} within {timeout:.1f} s") from e
        self._received[slot] = None  # delivered: free the tensors, refuse replays
        return result

    def forget_exchange(self, key: ExchangeKey) -> None:
        """Finish exchange `key`: drop our tensors and partners', abort its streams, fail its waiters."""
        self._retired = max(key, self._retired or key)
        self._provided.pop(key, None)
        for slot in [s for s in self._provided_to if s[0] == key]:
            del self._provided_to[slot]
        self._notify_provided()  # servers waiting for this key find it retired and refuse
        for task in self._exchange_tasks.pop(key, set()):
            task.cancel()  # it may still be sending our tensors, which the caller may now change
        for slot in [s for s in self._received if s[0] == key]:
            future = self._received.pop(slot)
            if future is not None and not future.done():
                future.set_exception(PeerUnavailable(f"exchange {key} was abandoned"))
                future.exception()  # retrieved: nobody may be waiting any more

    def _notify_provided(self) -> None:
        self._provided_changed.set()
        self._provided_changed = asyncio.Event()

    async def _our_tensors(self, key: ExchangeKey, peer: str) -> tuple[torch.Tensor, ...]:
        while key not in self._provided and (key, peer) not in self._provided_to:
            if self._retired is not None and key <= self._retired:
                raise Refused("stale", f"exchange {key} was finished here while you waited")
            await self._provided_changed.wait()
        return self._provided_to.get((key, peer)) or self._provided[key]

    async def _serve_exchange(self, stream: InboundStream, header: Message, envelope: Envelope) -> None:
        """Receive the caller's weights while waiting for ours, then stream ours back (duplex)."""
        if not isinstance(header, ExchangeHeader):
            raise messages.MessageError(f"{EXCHANGE_VERB} needs an exchange header, got {header.TAG!r}")
        key, slot = header.key, (header.key, stream.peer)
        if self._retired is not None and key <= self._retired:
            raise Refused("stale", f"exchange {key} is over here (last finished: {self._retired})")
        if slot in self._received and (self._received[slot] is None or self._received[slot].done()):
            raise Refused("duplicate", f"exchange {key} with this peer already happened")
        task = asyncio.current_task()
        assert task is not None
        self._exchange_tasks.setdefault(key, set()).add(task)
        part = self.config.part_bytes
        try:
            with self._reserve(envelope.nbytes):
                receiving = asyncio.create_task(
                    streams.read_tensors(
                        stream.reader, envelope.tensors, stream.counts, part, stream.writer.transport
                    )
                )
                try:
                    waiting = asyncio.create_task(self._our_tensors(key, stream.peer))
                    try:
                        await asyncio.wait({receiving, waiting}, return_when=asyncio.FIRST_COMPLETED)
                        if receiving.done():
                            receiving.result()  # raises now if the caller sent garbage
                        ours = await waiting
                    finally:
                        waiting.cancel()
                    mine = tuple(messages.TensorMeta.of(t) for t in ours)
                    if mine != envelope.tensors:
                        raise Refused(
                            "mismatch", f"we hold {mine}, you sent {envelope.tensors}: check the run"
                        )
                    await streams.reply(stream, Ack(), ours)
                    theirs = tuple(await receiving)
                finally:
                    receiving.cancel()
                    await asyncio.gather(receiving, return_exceptions=True)
        except BaseException as e:
            future = self._received.get(slot)
            if future is not None and not future.done():  # the local peer waits: tell it now
                future.set_exception(_partner_error(e, stream.peer, key))
                future.exception()  # retrieved: that waiter may have given up already
            raise
        finally:
            tasks = self._exchange_tasks.get(key, set())
            tasks.discard(task)
            if not tasks:
                self._exchange_tasks.pop(key, None)
        # Only now, with both directions complete, does the local peer see the partner's weights.
        if slot not in self._received:
            self._received[slot] = asyncio.get_running_loop().create_future()
        future = self._received[slot]
        if future is not None and not future.done():
            future.set_result(theirs)

    # -- serving ----------------------------------------------------------------------------

    async def _on_stream(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serve one inbound stream; nothing a remote sends escapes this function."""
        peer = info.peer_id.to_base58()
        stream = InboundStream(peer, self._counts_for(peer), reader, writer, self.config.part_bytes)
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        try:
            async with asyncio.timeout(self.config.serve_timeout):
                await self._serve(stream)
        except messages.MessageError as e:  # they sent garbage (or died mid-frame)
            stream.counts.bad_messages += 1
            logger.info("rejected a malformed request from %s: %s", stream.peer, e)
            await streams.refuse(stream, "bad_request", str(e))
        except Refused as e:
            await streams.refuse(stream, e.code, e.reason)
        except TimeoutError:
            await streams.refuse(stream, "timeout", f"not served within {self.config.serve_timeout:.0f} s")
        except (PeerUnavailable, OSError) as e:  # the caller went away; nothing to answer
            logger.debug("stream from %s broke: %s", stream.peer, e)
        except Exception as e:  # a bug in a handler: tell the caller, then let it surface
            await streams.refuse(stream, "internal", f"the remote failed: {type(e).__name__}")
            raise
        finally:
            self._serving.discard(task)
            writer.close()

    async def _serve(self, stream: InboundStream) -> None:
        envelope = await streams.read_envelope(stream.reader, stream.counts)
        header = streams.open_envelope(envelope, self.config.max_frame_bytes)
        if envelope.verb == EXCHANGE_VERB:
            await self._serve_exchange(stream, header, envelope)
            return
        handler = self._handlers.get(envelope.verb)
        if handler is None:
            raise Refused("unknown_verb", f"this peer does not serve {envelope.verb}")
        with self._reserve(envelope.nbytes):
            tensors = await streams.read_tensors(
                stream.reader, envelope.tensors, stream.counts, stream.part_bytes, stream.writer.transport
            )
            reply_header, reply_tensors = await handler(stream.peer, header, tensors)
        await streams.reply(stream, reply_header, reply_tensors)

    @contextlib.contextmanager
    def _reserve(self, nbytes: int) -> Iterator[None]:
        """Account tensor bytes being received, so many concurrent callers cannot exhaust memory."""
        if self._inflight + nbytes > self.config.max_inflight_bytes:
            raise Refused("busy", f"receiving {self._inflight} bytes already; retry shortly")
        self._inflight += nbytes
        try:
            yield
        finally:
            self._inflight -= nbytes

    def _counts_for(self, peer: str) -> ByteCounts:
        return self._counts.setdefault(peer, ByteCounts())


def _partner_error(error: BaseException, peer: str, key: ExchangeKey) -> Exception:
    """What the local peer awaiting `received_exchange` sees when the partner's call failed."""
    if isinstance(error, messages.MessageError | PeerUnavailable):
        return error
    if isinstance(error, Refused):  # e.g. a shape that is not ours: the partner's data does not fit
        return messages.MessageError(f"exchange {key} from {peer}: {error.reason}")
    return PeerUnavailable(f"exchange {key} with {peer} did not complete ({type(error).__name__})")


# -- p2pd must die with us -----------------------------------------------------------------
# hivemind starts p2pd without tying its life to ours, so a SIGKILLed peer would leave the daemon
# running. While `Transport.create` runs, subprocesses get PR_SET_PDEATHSIG(SIGTERM): the kernel
# signals p2pd when the thread that started it (our event loop's) exits, however it exits.

_DIE_WITH_PARENT: contextvars.ContextVar[bool] = contextvars.ContextVar("die_with_parent", default=False)
_PR_SET_PDEATHSIG = 1


def _install_die_with_parent_hook() -> None:
    original = asyncio.subprocess.create_subprocess_exec
    if not sys.platform.startswith("linux") or getattr(original, "_noloco_hook", False):
        return
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child must not dlopen

    def die_with_parent() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))

    async def create_subprocess_exec(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        if _DIE_WITH_PARENT.get() and "preexec_fn" not in kwargs:
            kwargs["preexec_fn"] = die_with_parent
        return await original(*args, **kwargs)

    create_subprocess_exec._noloco_hook = True  # type: ignore[attr-defined]
    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec  # type: ignore[assignment]
