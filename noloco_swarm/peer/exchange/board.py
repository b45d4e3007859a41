"""The serving side of the outer exchange: what this peer offers per exchange key, and what each
caller sent it.

Within a group the lower rank calls the higher one with `rpc_exchange`, and both directions stream
on that one stream at once (protocol.plan.outer_plan). `ExchangeBoard` is the callee's session
table: created only by the local peer (provide, received) or by a completed exchange for a key it
provided. A call whose stream broke while the partner still answers probes is made again
(runner.CALL_ATTEMPTS): a callee that had already completed the exchange answers it with what it
sent the first time, so both sides average the same tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from noloco_swarm.peer import failpoints
from noloco_swarm.peer.net import streams
from noloco_swarm.peer.net.limits import Accepts
from noloco_swarm.peer.net.streams import InboundStream, PeerUnavailable, Refused, RemoteRefused, StreamClosed
from noloco_swarm.peer.net.transport import Transport
from noloco_swarm.peer.net.uplink import Arrivals, Uplink
from noloco_swarm.protocol import plausible
from noloco_swarm.protocol.codec import Message, MessageError, TensorMeta
from noloco_swarm.protocol.plausible import Implausible
from noloco_swarm.protocol.rpc import Ack, Decline, Envelope, ExchangeHeader

logger = logging.getLogger(__name__)

VERB = "rpc_exchange"
# A caller that avoids its callee (its weights were rejected lately) says so at once with this
# verb, so that the callee steps alone instead of waiting for a call that will not come.
DECLINE = "rpc_decline"
Key = tuple[int, ...]  # protocol.plan.exchange_key: (outer round, inner step[, phase])
Tensors = tuple[torch.Tensor, ...]
# Failed slots a caller's implausible weights may create before the local peer asked for them.
REJECTED_SLOTS = 16
EARLY_DECLINES = 16  # callers whose decline came before the local peer waited for their call
# Seconds a callee waits for the caller's receipt of its answer; without one it keeps the answer
# (for a call again) until a newer exchange.
RECEIPT_WAIT = 10.0


class ExchangeBoard:
    """Exchange sessions by key: our tensors on offer, and what each partner sent us.

    State is created only by the local peer (provide, received) or by a completed exchange for a
    key we provided, so no remote can grow it by asking for keys we never offer.
    """

    def __init__(self, transport: Transport, numel: int) -> None:
        """Serve rpc_exchange on `transport` for a stage of `numel` flat weights: a request
        carrying more than that stage's theta and phi is refused unread (peer/net/limits.py)."""
        self.transport = transport
        self.uplink = Uplink()  # our exchanges' upload rate, as partners measured it
        self._provided: dict[Key, Tensors] = {}
        self._provided_to: dict[tuple[Key, str], Tensors] = {}  # per partner (an all-reduce shard)
        self._changed = asyncio.Event()
        # What each caller sent per (key, peer); None marks a slot already delivered (replays refused).
        self._received: dict[tuple[Key, str], asyncio.Future[Tensors] | None] = {}
        # What we sent each caller in a completed exchange, for a caller whose stream broke before
        # our answer reached it and that calls again: it gets the same answer. Kept until the
        # caller's receipt says it has our answer (streams.receipt) or a newer exchange starts:
        # in a healthy exchange it is gone a round trip after the call, not held all round.
        # (Held, not copied: what we provide is never changed in place, see `provide`.)
        self._served: dict[tuple[Key, str], Tensors] = {}
        self._tasks: dict[Key, set[asyncio.Task[object]]] = {}
        self._serving: set[tuple[Key, str]] = set()  # (key, caller) of calls being served now
        self._delivering: set[tuple[Key, str]] = set()  # answered calls awaiting the caller's receipt
        self._retired: Key | None = None  # newest finished key; older ones are refused
        self._paces: dict[Key, streams.Pacer] = {}  # the pace our answers for a key go out at
        self.avoidance = plausible.Avoidance()  # members whose weights we rejected lately
        self._declines: set[asyncio.Task[None]] = set()  # our declines still on their way
        self._declined_early = EarlyDeclines()  # declines that came before the local peer waited
        transport.register_stream(VERB, self._serve, on_close=self.close, accepts=Accepts.weights(numel))
        transport.register(DECLINE, self._declined)

    # -- the local peer's side -------------------------------------------------------------

    def provide(
        self,
        key: Key,
        tensors: torch.Tensor | Tensors,
        *,
        to: str | None = None,
        pace: streams.Pacer | None = None,
    ) -> None:
        """Offer our flat weights for exchange `key` to every partner that calls for it (or only
        to `to`), sent at `pace` if given. Sent and kept in place, never copied: they must not
        change afterwards (theta is a snapshot taken at the boundary; phi, sent only in the
        two-tensor form, is replaced by that step, never changed in place; all-reduce shards are
        the exchange's own)."""
        if self._retired is not None and key <= self._retired:
            raise ValueError(f"exchange {key} is not newer than the last finished one, {self._retired}")
        for old in self._keys():
            if old < key:
                self.forget(old)
        self._served = {slot: kept for slot, kept in self._served.items() if slot[0] >= key}
        ours = tuple(streams.prepare((tensors,) if isinstance(tensors, torch.Tensor) else tensors))
        if pace is not None:
            self._paces[key] = pace
        if to is None:
            self._provided[key] = ours
        else:
            self._provided_to[(key, to)] = ours
        self._notify()

    async def received(self, key: Key, peer: str, *, timeout: float) -> Tensors:
        """What `peer` sent us when it called for `key` (awaits it, within `timeout`)."""
        slot = (key, peer)
        if slot in self._received and self._received[slot] is None:
            raise RuntimeError(f"exchange {key} with {peer} was already delivered")
        if self._declined_early.take(peer, key):
            raise _avoided_by(peer)
        future = self._received.get(slot) or asyncio.get_running_loop().create_future()
        self._received[slot] = future
        try:
            result = await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError as e:
            raise PeerUnavailable(f"peer {peer} did not exchange {key} within {timeout:.1f} s") from e
        self._received[slot] = None  # delivered: free the tensors, refuse replays
        return result

    async def swap(
        self,
        peer: str,
        header: ExchangeHeader,
        tensors: Tensors,
        *,
        timeout: float,
        pace: streams.Pacer | None = None,
    ) -> Tensors:
        """Call `peer` for the exchange `header` names: send ours (at `pace`, if given), get
        theirs, both ways at once."""
        expect, bulk = streams.declared_tensors(header), {"confirmed": True, "direct": True}
        _, theirs = await self.transport.call(
            peer, VERB, header, tensors, timeout=timeout, expect=expect, pace=pace, **bulk
        )
        return tuple(theirs)

    def decline(self, peer: str, header: ExchangeHeader, *, timeout: float) -> None:
        """Tell the callee `peer` now that we will not call it for the exchange `header` names
        (we avoid it), so that it steps alone at once; sent in the background. A callee that
        does not hear it waits out its deadline as before."""
        task = asyncio.create_task(_send_decline(self.transport, peer, header, timeout))
        self._declines.add(task)
        task.add_done_callback(self._declines.discard)

    async def _declined(
        self, peer: str, header: Message, tensors: list[torch.Tensor]
    ) -> tuple[Message, list[torch.Tensor]]:
        """`peer`, our caller for the exchange `header` names, will not call: it avoids us. The
        local peer's wait for that call (now or when it comes to it) ends with RemoteRefused."""
        if not isinstance(header, Decline):
            raise MessageError(f"{DECLINE} needs a decline, got {header.TAG!r}")
        key, slot = header.key, (header.key, peer)
        if self._retired is not None and key <= self._retired:
            return Ack(), []  # that exchange is over here already
        future = self._received.get(slot)
        if future is not None and not future.done():
            future.set_exception(_avoided_by(peer))
            future.exception()  # retrieved: the local peer may have given up already
        elif slot not in self._received:  # before the local peer waits
            self._declined_early.keep(peer, key)
        return Ack(), []

    def serving(self, key: Key, peer: str) -> bool:
        """Is a call of `peer`'s for exchange `key` being served right now?"""
        return (key, peer) in self._serving

    def forget(self, key: Key) -> None:
        """Finish exchange `key`: drop our tensors and partners', abort its streams, fail its waiters."""
        self._retired = max(key, self._retired or key)
        self._declined_early.retire(self._retired)
        self._provided.pop(key, None)
        self._paces.pop(key, None)
        for slot in [s for s in self._provided_to if s[0] == key]:
            del self._provided_to[slot]
        self._notify()  # servers waiting for this key find it retired and refuse
        for task in self._tasks.pop(key, set()):
            task.cancel()  # it may still be sending our tensors, which the caller may now change
        for slot in [s for s in self._received if s[0] == key]:
            future = self._received.pop(slot)
            if future is not None and not future.done():
                future.set_exception(PeerUnavailable(f"exchange {key} was abandoned"))
                future.exception()  # retrieved: nobody may be waiting any more

    def close(self) -> None:
        for key in self._keys():
            self.forget(key)
        for task in self._declines:
            task.cancel()

    def _keys(self) -> set[Key]:
        """Every exchange this board holds anything of."""
        return {*self._provided, *(k for k, _ in self._provided_to), *(k for k, _ in self._received)}

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- serving a caller ------------------------------------------------------------------

    async def _ours(self, key: Key, peer: str) -> Tensors:
        while key not in self._provided and (key, peer) not in self._provided_to:
            if self._retired is not None and key <= self._retired:
                raise Refused("stale", f"exchange {key} was finished here while you waited")
            await self._changed.wait()
        return self._provided_to.get((key, peer)) or self._provided[key]

    async def _serve(self, stream: InboundStream, header: Message, envelope: Envelope) -> None:
        """Receive the caller's weights while waiting for ours, then stream ours back (duplex)."""
        if not isinstance(header, ExchangeHeader):
            raise MessageError(f"{VERB} needs an exchange header, got {header.TAG!r}")
        key, slot = header.key, (header.key, stream.peer)
        if (kept := self._served.get(slot)) is not None:  # it lost our answer: the same again
            _, _, confirmed = await self._duplex(stream, envelope, lambda: _given(kept), key)
            await self._release_on_receipt(stream, slot, kept, confirmed, self._paces.get(key))
            return
        if self.avoidance.avoided(stream.peer, header.step):
            raise Refused(
                "avoided",
                f"this peer rejected your outer weights lately and averages without you until the "
                f"outer step after inner step {self.avoidance.until[stream.peer]}: step alone",
            )
        if self._retired is not None and key <= self._retired:
            raise Refused("stale", f"exchange {key} is over here (last finished: {self._retired})")
        if slot in self._received and (self._received[slot] is None or self._received[slot].done()):
            raise Refused("duplicate", f"exchange {key} with this peer already happened")
        task = asyncio.current_task()
        assert task is not None
        self._tasks.setdefault(key, set()).add(task)
        self._serving.add(slot)
        try:
            theirs, ours, confirmed = await self._duplex(
                stream, envelope, lambda: self._ours(key, stream.peer), key
            )
        except BaseException as e:
            future = self._received.get(slot)
            # A broken stream may be only this stream: the caller probes us and calls again, and
            # the local peer's wait ends at its deadline, or when its probe finds the caller gone.
            broken = isinstance(e, PeerUnavailable | OSError)
            error = _partner_error(e, stream.peer, key)
            if future is None and isinstance(error, Implausible) and len(self._received) < REJECTED_SLOTS:
                # Poison that came before the local peer asked: it learns at once when it does,
                # instead of waiting on a caller that has already stepped without us.
                future = self._received[slot] = asyncio.get_running_loop().create_future()
            if future is not None and not future.done() and not broken:  # tell the local peer now
                future.set_exception(error)
                future.exception()  # retrieved: that waiter may have given up already
            raise
        finally:
            self._serving.discard(slot)
            tasks = self._tasks.get(key, set())
            tasks.discard(task)
            if not tasks:
                self._tasks.pop(key, None)
        # Only now, with both directions complete, does the local peer see the partner's weights.
        self._served[slot] = ours
        future = self._received.setdefault(slot, asyncio.get_running_loop().create_future())
        if future is not None and not future.done():
            future.set_result(theirs)
        # The pace our answer went out at hears how fast it arrived (peer/net/uplink.py).
        await self._release_on_receipt(stream, slot, ours, confirmed, self._paces.get(key))

    async def _release_on_receipt(
        self,
        stream: InboundStream,
        slot: tuple[Key, str],
        ours: Tensors,
        confirmed: bool,
        pace: streams.Pacer | None,
    ) -> None:
        """Forget the answer kept for `slot` once the caller says it has it (see `_served`); the
        rate the caller says it arrived at goes to `pace`."""
        self._delivering.add(slot)
        try:
            rate = await streams.receipt(stream, RECEIPT_WAIT) if confirmed else None
            if rate is not None and pace is not None:
                pace.arrived.append(rate)
            if rate is not None and self._served.get(slot) is ours:
                del self._served[slot]
        finally:
            self._delivering.discard(slot)

    async def drain(self, timeout: float) -> bool:
        """Wait, at most `timeout` seconds, until no call is being served and every answer we
        sent has reached its caller (its receipt came, or RECEIPT_WAIT ran out). A peer does this
        before it stops: our reply leaves through p2pd's buffers, and a peer that exits as soon
        as it has written its last answer cuts the tail off a partner still reading it over a
        slow link. True if nothing was left in flight."""
        deadline = time.monotonic() + timeout
        while self._serving or self._delivering:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def _duplex(
        self,
        stream: InboundStream,
        envelope: Envelope,
        ours_when_ready: Callable[[], Awaitable[Tensors]],
        key: Key,
    ) -> tuple[Tensors, Tensors, bool]:
        """(theirs, ours, confirmed): read the caller's tensors while ours become ready, then send
        ours; `confirmed`: we told the caller we have all of its tensors (it then sends a receipt)."""
        part = self.transport.config.part_bytes
        arrivals = Arrivals(sum(meta.nbytes for meta in envelope.tensors))  # the caller's uplink
        receiving = asyncio.create_task(
            streams.read_tensors(
                stream.reader, envelope.tensors, stream.counts, part, stream.writer.transport, arrivals
            )
        )
        try:
            waiting = asyncio.ensure_future(ours_when_ready())
            try:
                await asyncio.wait({receiving, waiting}, return_when=asyncio.FIRST_COMPLETED)
                if receiving.done():
                    receiving.result()  # raises now if the caller sent garbage
                ours = await waiting
            finally:
                waiting.cancel()
            mine = tuple(TensorMeta.of(t) for t in ours)
            if mine != envelope.tensors:
                raise Refused("mismatch", f"we hold {mine}, you sent {envelope.tensors}: check the run")
            if failpoints.fire("close_unanswered", VERB):
                raise StreamClosed("failpoint: closed the exchange stream without our answer")
            await streams.reply(stream, Ack(), failpoints.poison(VERB, key, ours), self._paces.get(key))
            theirs = tuple(await receiving)
            # The caller's call ends at this confirmation, not at our reply. Both directions
            # are complete here: if the confirmation is lost, the caller calls again and gets
            # the same answer (kept in `_served`), so this side counts as done either way.
            confirmed = False
            if not failpoints.fire("close_unconfirmed", VERB):
                with contextlib.suppress(OSError):
                    await streams.confirm(stream, arrivals.rate())
                    confirmed = True
            return theirs, ours, confirmed
        finally:
            receiving.cancel()
            await asyncio.gather(receiving, return_exceptions=True)


class EarlyDeclines:
    """Exchanges callers declined before the local peer waited for their call: the latest per
    caller, at most EARLY_DECLINES callers (the oldest go first), forgotten as their keys retire."""

    def __init__(self) -> None:
        self.keys: dict[str, Key] = {}

    def keep(self, peer: str, key: Key) -> None:
        self.keys.pop(peer, None)
        while len(self.keys) >= EARLY_DECLINES:
            del self.keys[next(iter(self.keys))]
        self.keys[peer] = key

    def take(self, peer: str, key: Key) -> bool:
        """Did `peer` decline `key`? (Once: the answer is used up.)"""
        if self.keys.get(peer) != key:
            return False
        del self.keys[peer]
        return True

    def retire(self, retired: Key) -> None:
        self.keys = {p: k for p, k in self.keys.items() if k > retired}


async def _send_decline(transport: Transport, peer: str, h: ExchangeHeader, timeout: float) -> None:
    decline = Decline(h.run_id, h.round, h.step, h.stage, h.phase)
    try:
        await transport.call(peer, DECLINE, decline, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - a word of courtesy: the callee's deadline still ends its wait
        logger.debug("could not tell %s that we decline exchange %s: %s", peer, decline.key, e)


def _avoided_by(peer: str) -> RemoteRefused:
    return RemoteRefused(peer, "avoided", f"{peer} rejected our outer weights lately and steps without us")


async def _given(tensors: Tensors) -> Tensors:
    return tensors


def _partner_error(error: BaseException, peer: str, key: Key) -> Exception:
    """What the local peer awaiting `received` sees when the partner's call failed."""
    if isinstance(error, MessageError | PeerUnavailable):
        return error
    if isinstance(error, Refused) and error.code == "mismatch":  # its weights are not our shape
        return Implausible("shape", f"exchange {key} from {peer}: {error.reason}")
    if isinstance(error, Refused):
        return MessageError(f"exchange {key} from {peer}: {error.reason}")
    return PeerUnavailable(f"exchange {key} with {peer} did not complete ({type(error).__name__})")
