"""The outer exchange: one object per outer step with a group, and the sessions that serve it.

After inner step t = H, 2H, ... a replica swaps theta with the other members of its group
(protocol.plan.outer_plan): the lower rank calls the higher one with `rpc_exchange`, and both
directions stream on that one stream at once. `ExchangeBoard` is the serving side's session
table: what this peer offers per exchange key, and what each caller sent. `OuterExchange` is one
group round (like hivemind's AllReduceRunner): it runs the swaps, or the sharded all-reduce of
DiLoCo with more than two replicas, owns the failures and the bytes, and is finalised once.

Errors a swap reports per member: PeerUnavailable (gone or too slow: the member is probed, and
reported if it does not answer), RemoteRefused, MessageError (it sent garbage: not trusted again),
Implausible (it sent weights that fail protocol/plausible.py: non-finite, of another shape or
dtype, or too far from our slow weights). A member that fails is left out of this step's mean; the
replica steps with the rest (alone, when that was its only partner). An implausible member is
reported (`Rejected`) and avoided for `outer.avoid_rounds` outer steps: we do not call it and
refuse its calls at once, so neither side waits for the other. The checks only read the tensors:
an honest swarm's weights are the simulator's, bit for bit.

With `outer.overlap_steps` = k > 0 the exchange of boundary t runs in the background while the
replica trains on (peer/outer_steps.py); a caller may then be up to k steps past t before it
calls, which `_await_caller` allows for. A call whose
stream broke while the partner still answers probes is made again (CALL_ATTEMPTS): a partner that
had already completed the exchange answers it with what it sent the first time, so both sides
average the same tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from noloco_swarm.peer import events, failpoints, streams
from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.limits import Accepts
from noloco_swarm.peer.rounds import PROBE_PERIOD
from noloco_swarm.peer.streams import (
    InboundStream,
    PeerUnavailable,
    Refused,
    RemoteRefused,
    StreamClosed,
    StreamTruncated,
)
from noloco_swarm.peer.transport import Transport
from noloco_swarm.protocol import outer, plausible
from noloco_swarm.protocol.messages import (
    Ack,
    Envelope,
    ExchangeHeader,
    Message,
    MessageError,
    PeerStatus,
    TensorMeta,
)
from noloco_swarm.protocol.plan import OuterPlan, ShardLayout, exchange_key
from noloco_swarm.protocol.plausible import Implausible

logger = logging.getLogger(__name__)

VERB = "rpc_exchange"
Key = tuple[int, ...]  # protocol.plan.exchange_key: (outer round, inner step[, phase])
Tensors = tuple[torch.Tensor, ...]
CALL_ATTEMPTS = 3  # calls of one exchange whose stream broke, while the partner answers probes
# Failed slots a caller's implausible weights may create before the local peer asked for them.
REJECTED_SLOTS = 16
# Seconds a callee waits for the caller's receipt of its answer; without one it keeps the answer
# (for a call again) until a newer exchange.
RECEIPT_WAIT = 10.0


class Avoided(Exception):
    """We do not exchange with this member now: its outer weights were rejected recently."""


class Passed(Exception):
    """We do not call this member: it trains on past this exchange (it gave up on us)."""


class ExchangeBoard:
    """Exchange sessions by key: our tensors on offer, and what each partner sent us.

    State is created only by the local peer (provide, received) or by a completed exchange for a
    key we provided, so no remote can grow it by asking for keys we never offer.
    """

    def __init__(self, transport: Transport, numel: int) -> None:
        """Serve rpc_exchange on `transport` for a stage of `numel` flat weights: a request
        carrying more than that stage's theta and phi is refused unread (peer/limits.py)."""
        self.transport = transport
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
        transport.register_stream(VERB, self._serve, on_close=self.close, accepts=Accepts.weights(numel))

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
        expect = streams.declared_tensors(header)
        _, theirs = await self.transport.call(
            peer, VERB, header, tensors, timeout=timeout, expect=expect, confirmed=True, pace=pace
        )
        return tuple(theirs)

    def serving(self, key: Key, peer: str) -> bool:
        """Is a call of `peer`'s for exchange `key` being served right now?"""
        return (key, peer) in self._serving

    def forget(self, key: Key) -> None:
        """Finish exchange `key`: drop our tensors and partners', abort its streams, fail its waiters."""
        self._retired = max(key, self._retired or key)
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
            await self._release_on_receipt(stream, slot, kept, confirmed)
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
        await self._release_on_receipt(stream, slot, ours, confirmed)

    async def _release_on_receipt(
        self, stream: InboundStream, slot: tuple[Key, str], ours: Tensors, confirmed: bool
    ) -> None:
        """Forget the answer kept for `slot` once the caller says it has it (see `_served`)."""
        self._delivering.add(slot)
        try:
            if confirmed and await streams.receipt(stream, RECEIPT_WAIT) and self._served.get(slot) is ours:
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
        receiving = asyncio.create_task(
            streams.read_tensors(
                stream.reader, envelope.tensors, stream.counts, part, stream.writer.transport
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
                    await streams.confirm(stream)
                    confirmed = True
            return theirs, ours, confirmed
        finally:
            receiving.cancel()
            await asyncio.gather(receiving, return_exceptions=True)


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


class ByteLedger:
    """Bytes (framing included) moved with each partner since our previous outer step with it.

    Only outer exchanges (and a joiner's one state fetch, which `exclude` keeps out) flow between
    replicas of one stage, so the growth of those peers' counters is this exchange's traffic,
    including what an early partner streamed to us before we reached the step, and calls made
    again after a broken stream. Where replicas do not wait for each other between outer steps
    (one stage), a partner may start streaming the next exchange before we settle this one: its
    bytes then count here instead of there, and only the sum over exchanges is exact.
    """

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._seen: dict[str, tuple[int, int]] = {}

    def settle(self, peers: list[str]) -> tuple[int, int]:
        """(sent, received) with `peers` since the last settlement; marks them settled."""
        counts = self.transport.byte_counts()
        sent = received = 0
        for peer in peers:
            now = counts.get(peer, {})
            seen = self._seen.get(peer, (0, 0))
            sent += now.get("sent_total", 0) - seen[0]
            received += now.get("received_total", 0) - seen[1]
            self._seen[peer] = (now.get("sent_total", 0), now.get("received_total", 0))
        return sent, received

    def exclude(self, peer: str, sent: int) -> None:
        """Keep `sent` bytes (state served to a joiner) out of the next exchange's count."""
        seen = self._seen.get(peer, (0, 0))
        self._seen[peer] = (seen[0] + sent, seen[1])

    def reset(self) -> None:
        """After joining: everything moved so far was the state fetch, no outer exchange."""
        self._seen = {}
        self.settle(list(self.transport.byte_counts()))


class OuterExchange:
    """One outer step's exchange with this round's group; run once, then finished."""

    def __init__(
        self,
        ctx: PeerContext,
        board: ExchangeBoard,
        plan: OuterPlan,
        round_: int,
        drift: float = 0.0,
        *,
        paced: bool = False,
    ) -> None:
        """`paced`: our sending may be spread over the overlap window (`peer.exchange_pacing`);
        the caller says no when the step will be applied sooner, at the run's end."""
        self.ctx, self.board, self.plan, self.round = ctx, board, plan, round_
        self.drift = drift  # how far our slow weights moved alone since we last averaged
        self.paced = paced
        self.pace: streams.Pacer | None = None  # set when the exchange starts (`pacer`)
        view = ctx.rounds.at(round_)
        self.members = {m: view.peer_at(ctx.stage, m) for m in plan.partners}
        self.failed: set[int] = set()
        self._keys: list[Key] = []
        # ||theta - phi||, ||phi|| of ours: computed beside the swap, awaited before judging.
        self._own: asyncio.Future[tuple[float, float]] | None = None

    async def mean_inputs(
        self, theta: torch.Tensor
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor] | None]:
        """The group's thetas (and phis when gamma != beta) by rank, ours included; for DiLoCo
        with more than two replicas, {rank: the stage's mean theta} by sharded all-reduce."""
        me, phi = self.plan.rank, self.ctx.replica.phi
        # The scale a partner's weights are judged by: our own progress this round (plausible.py),
        # computed while the swap starts rather than before it: both only read theta and phi, and
        # a partner's call then finds our weights offered tens of milliseconds sooner.
        self._own = asyncio.ensure_future(asyncio.to_thread(plausible.own_progress, theta, phi))
        self.pace = self.pacer(theta)
        try:
            if self.plan.sharded:
                return {me: await self._allreduce_mean(theta)}, None
            sends_phi = self.ctx.cfg.outer.sends_phi
            parts = (theta, phi) if sends_phi else (theta,)
            names = ("theta", "phi") if sends_phi else ("theta",)
            got = await self._swap_all(0, names, lambda m: parts, lambda m: (phi,) * len(parts))
            thetas = {me: theta} | {m: x[0] for m, x in got.items()}
            phis = ({me: phi} | {m: x[1] for m, x in got.items()}) if sends_phi else None
            return thetas, phis
        finally:
            for key in self._keys:
                self.board.forget(key)
            if not self._own.done():  # the swap failed first: the thread's result is not needed
                self._own.cancel()
            await asyncio.gather(self._own, return_exceptions=True)

    def pacer(self, theta: torch.Tensor) -> streams.Pacer | None:
        """The pace all we send in this exchange goes out at: the slower of `peer.exchange_max_mbit`
        and the pace that spreads it over `peer.exchange_pacing` of the k inner steps it overlaps
        (their length estimated from recent steps), but never so slow that sending takes more than
        half the exchange's deadline: pacing alone must not fail a healthy partner. None: as fast
        as the link takes it. The window's pace applies only to an overlapped exchange that is
        `paced`, once enough steps have been seen. On a link the pipeline's rows share, an
        exchange sent at full speed fills the link's queue and every row waits behind it; a paced
        one leaves the rows room."""
        peer, outer = self.ctx.cfg.peer, self.ctx.cfg.outer
        n = len(self.plan.group)
        copies = (  # sharded: a shard to each other member, twice (reduce-scatter, all-gather)
            2 * (n - 1) / n if self.plan.sharded else len(self.members) * (2 if outer.sends_phi else 1)
        )
        nbytes = theta.numel() * theta.element_size() * copies
        cap = peer.exchange_max_mbit * 1e6 / 8
        rates = [cap] if cap else []
        step = self.ctx.deadlines.typical_step
        if self.paced and peer.exchange_pacing and outer.overlap_steps and step:  # step None: too few seen
            rates.append(nbytes / (peer.exchange_pacing * outer.overlap_steps * step))
        if not rates:
            return None
        slowest = nbytes / (self.ctx.deadlines.exchange / 2)
        if cap and cap < slowest:
            logger.warning(
                "peer.exchange_max_mbit=%g would take %.0f s to send this exchange's %.1f MB, more than "
                "half its deadline (%.0f s): sending at %.1f Mbit/s instead",
                peer.exchange_max_mbit,
                nbytes / cap,
                nbytes / 1e6,
                self.ctx.deadlines.exchange,
                slowest * 8 / 1e6,
            )
        return streams.Pacer(max(min(rates), slowest))

    async def _allreduce_mean(self, theta: torch.Tensor) -> torch.Tensor:
        """The stage's mean theta by reduce-scatter then all-gather over equal padded shards.

        Shard owners sum in ascending rank, the same order as `outer.group_mean`, so the result
        is bit-identical to the simulator's mean. A member that fails phase 1 is left out of the
        mean of this member's shard; a shard whose owner fails phase 2 keeps our own values.
        """
        layout = ShardLayout(theta.numel(), len(self.plan.group))
        padded = torch.zeros(layout.padded, dtype=theta.dtype, device=theta.device)
        padded[: theta.numel()] = theta
        shards = padded.view(layout.parts, layout.size)
        phi = torch.zeros_like(padded)  # our slow weights in the same shards, to judge theirs by
        phi[: theta.numel()] = self.ctx.replica.phi.to(theta.device)
        phi_shards = phi.view(layout.parts, layout.size)
        me = self.plan.rank
        got = await self._swap_all(1, ("theta_shard",), lambda m: (shards[m],), lambda m: (phi_shards[me],))
        mine = outer.group_mean({me: shards[me]} | {m: x[0].to(theta.device) for m, x in got.items()})
        got = await self._swap_all(2, ("mean_shard",), lambda m: (mine,), lambda m: (phi_shards[m],))
        means = padded.clone().view(layout.parts, layout.size)  # a shard we never get keeps ours
        means[me] = mine
        for m, x in got.items():
            means[m] = x[0].to(theta.device)
        return means.view(-1)[: theta.numel()].clone()

    async def _swap_all(
        self,
        phase: int,
        names: tuple[str, ...],
        payload: Callable[[int], Tensors],
        reference: Callable[[int], Tensors],
    ) -> dict[int, Tensors]:
        """Swap `payload(m)` with every member m; what arrived and is plausible next to
        `reference(m)`, our slow weights where m's tensors are (members that failed are noted)."""
        key = exchange_key(self.round, self.plan.step, phase)
        self._keys.append(key)
        failpoints.arm(VERB, key)  # a test's hostile member decides here what it will send
        for m, peer in self.members.items():
            if not self.plan.calls(m):  # they call us and get what we provide for them
                self.board.provide(key, payload(m), to=peer, pace=self.pace)
        results: dict[int, asyncio.Task[Tensors | BaseException]] = {}
        async with asyncio.TaskGroup() as group:
            for m in self.members:
                results[m] = group.create_task(self._swap_one(key, phase, names, m, payload(m)))
        self.board.forget(key)
        assert self._own is not None, "set when the exchange starts"
        own = await self._own
        got = {}
        for m, task in results.items():
            result = task.result()
            if not isinstance(result, BaseException):
                result = await asyncio.to_thread(self._judge, result, reference(m), own)
            if isinstance(result, BaseException):
                self.failed.add(m)
                await self._blame(self.members[m], result)
            else:
                got[m] = result
        return got

    def _judge(
        self, theirs: Tensors, reference: Tensors, progress: tuple[float, float]
    ) -> Tensors | Implausible:
        """`theirs`, or why it may not be averaged in (reads the tensors, never changes them);
        `progress`: our own ||theta - phi|| and ||phi|| this round."""
        o, (own, phi_norm) = self.ctx.cfg.outer, progress
        for got, ref in zip(theirs, reference, strict=True):
            verdict = plausible.check_outer(
                got, ref, own, phi_norm, factor=o.plausible_factor, floor=o.plausible_floor, drift=self.drift
            )
            if not verdict.ok:
                return Implausible(verdict.reason, verdict.detail, verdict.ratio)
        return theirs

    async def _swap_one(
        self, key: Key, phase: int, names: tuple[str, ...], m: int, ours: Tensors
    ) -> Tensors | BaseException:
        ctx, peer = self.ctx, self.members[m]
        if peer in ctx.rounds.dead:
            return PeerUnavailable(f"{peer} is gone")
        if self.board.avoidance.avoided(peer, self.plan.step):
            return Avoided(f"{peer}'s outer weights were rejected lately")
        ours = failpoints.poison(VERB, key, ours)  # a test's hostile member lies here (or below)
        header = ExchangeHeader(
            run_id=ctx.run_id,
            round=self.round,
            step=self.plan.step,
            stage=ctx.stage,
            sender_rank=self.plan.rank,
            parts=names,
            meta=TensorMeta.of(ours[0]),
            chunk_bytes=ctx.transport.config.part_bytes,
            phase=phase,
        )
        if not self.plan.calls(m):
            try:
                return await self._await_caller(key, peer)
            except (PeerUnavailable, RemoteRefused, MessageError) as e:
                return e
        # A partner seen past the step where it waits for this exchange gave up on it and would
        # refuse our weights as stale (we fell behind: a stall, a cut link): send nothing.
        if (at := ctx.rounds.passed(peer, self.plan.step + ctx.cfg.outer.overlap_steps)) is not None:
            ctx.events.emit(events.Unsent(step=self.plan.step, peer=peer, at=at, call="exchange"))
            return Passed(f"{peer} is at step {at}, past the outer step after step {self.plan.step}")
        for attempt in range(CALL_ATTEMPTS):  # a live partner whose stream broke is called again
            try:
                return await self.board.swap(
                    peer, header, ours, timeout=ctx.deadlines.exchange, pace=self.pace
                )
            except (StreamClosed, StreamTruncated) as e:
                if attempt == CALL_ATTEMPTS - 1 or not await ctx.rounds.alive(peer):
                    return e
                ctx.events.emit(
                    events.Retried(step=self.plan.step, peer=peer, reason=str(e), call="exchange")
                )
            except (PeerUnavailable, RemoteRefused, MessageError) as e:
                return e
        raise AssertionError("the last attempt always returns")

    async def _await_caller(self, key: Key, peer: str) -> Tensors:
        """Await a lower-ranked partner's call, probing it so that a crash ends the wait, and so
        does a partner that gave up on this exchange and trains on (its call broke for good)."""
        waiting = asyncio.ensure_future(self.board.received(key, peer, timeout=self.ctx.deadlines.exchange))
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=PROBE_PERIOD)
                if done:
                    return waiting.result()
                status = await self.ctx.rounds.probe(peer)
                if status is None:
                    raise PeerUnavailable(f"{peer} stopped answering before its outer exchange")
                # It waits for this exchange after inner step t + k at the latest (overlap).
                latest = self.plan.step + self.ctx.cfg.outer.overlap_steps
                passed = isinstance(status, PeerStatus) and status.step > latest
                if passed and not self.board.serving(key, peer):  # not its call still landing
                    raise PeerUnavailable(f"{peer} trains on past step {latest} without our exchange")
        finally:
            if not waiting.done():
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)

    async def _blame(self, peer: str, error: BaseException) -> None:
        t = self.plan.step
        if isinstance(error, Implausible):  # before MessageError: poison is not a broken peer
            o = self.ctx.cfg.outer
            self.board.avoidance.avoid(peer, t, o.avoid_rounds, o.inner_steps)
            until = self.board.avoidance.until.get(peer, t)
            logger.warning(
                "rejected the outer weights of %s at step %d (%s: %s); stepping without it%s",
                peer,
                t,
                error.reason,
                error,
                f" until the outer step of step {until}" if until > t else "",
            )
            self.ctx.events.emit(
                events.Rejected(
                    step=t,
                    peer=peer,
                    reason=error.reason,
                    ratio=error.ratio,
                    avoid_until=until,
                    detail=str(error),
                )
            )
        elif isinstance(error, PeerUnavailable):
            await self.ctx.rounds.suspect(peer, f"outer exchange at step {t} failed: {error}")
        elif isinstance(error, MessageError):
            self.ctx.rounds.mark_dead(peer, f"malformed outer exchange at step {t}: {error}")
