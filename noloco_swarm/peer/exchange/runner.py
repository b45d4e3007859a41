"""One outer exchange: this peer's side of one outer step with its group, run once.

After inner step t = H, 2H, ... a replica swaps theta with the other members of its group
(protocol.plan.outer_plan). `OuterExchange` is one group round (like hivemind's AllReduceRunner):
it runs the swaps through the board (board.py), or the sharded all-reduce of DiLoCo with more than
two replicas, owns the failures and the bytes, and is finalised once.

Errors a swap reports per member: PeerUnavailable (gone or too slow: the member is probed, and
reported if it does not answer; RelayOnly, reachable only through a circuit relay, which never
carries an exchange: told at once, like an avoided member, and not suspected), RemoteRefused,
MessageError (it sent garbage: not trusted again),
Implausible (it sent weights that fail protocol/plausible.py: non-finite, of another shape or
dtype, or too far from our slow weights). A member that fails is left out of this step's mean; the
replica steps with the rest (alone, when that was its only partner). An implausible member is
reported (`Rejected`) and avoided for `outer.avoid_rounds` outer steps: we refuse its calls at
once, and where we would call it we tell it at once that we will not (`board.decline`), so neither
side waits for the other. The checks only read the tensors:
an honest swarm's weights are the simulator's, bit for bit.

With `outer.overlap_steps` = k > 0 the exchange of boundary t runs in the background while the
replica trains on (peer/outer_steps.py); a caller may then be up to k steps past t before it
calls, which `_await_caller` allows for. A call whose stream broke while the partner still
answers probes is made again (CALL_ATTEMPTS).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch

from noloco_swarm.peer import events, failpoints
from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.exchange.board import VERB, ExchangeBoard, Key, Tensors
from noloco_swarm.peer.liveness import PROBE_PERIOD
from noloco_swarm.peer.net import streams
from noloco_swarm.peer.net.streams import (
    PeerUnavailable,
    RelayOnly,
    RemoteRefused,
    StreamClosed,
    StreamTruncated,
)
from noloco_swarm.protocol import outer, plausible
from noloco_swarm.protocol.codec import MessageError, TensorMeta
from noloco_swarm.protocol.plan import OuterPlan, ShardLayout, exchange_key
from noloco_swarm.protocol.plausible import Implausible
from noloco_swarm.protocol.rpc import ExchangeHeader, PeerStatus

logger = logging.getLogger(__name__)

CALL_ATTEMPTS = 3  # calls of one exchange whose stream broke, while the partner answers probes


class Avoided(Exception):
    """We do not exchange with this member now: its outer weights were rejected recently."""


class Passed(Exception):
    """We do not call this member: it trains on past this exchange (it gave up on us)."""


class Rejoining(Exception):
    """The partner we wait for was restarted under its id and joins a later round: the process
    that held this exchange's membership is gone, and the one that answers will not call."""


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

    def pacer(self, theta: torch.Tensor) -> streams.Pacer:
        """The pace all we send in this exchange goes out at: the slowest of the exchange cap
        (`peer.exchange_max_mbit`; by default 97% of the payload rate our partners measured our last
        exchanges arriving at, peer/net/uplink.py) and the pace that spreads it over
        `peer.exchange_pacing` of the k inner steps it overlaps (their length estimated from
        recent steps), but never so slow that sending takes more than half the exchange's
        deadline: pacing alone must not fail a healthy partner. Rate 0: as fast as the link takes
        it. The window's pace applies only to an overlapped exchange that is `paced`, once enough
        steps have been seen. On a link the pipeline's rows share, an exchange sent at full speed
        fills the link's queue and every row waits behind it; a paced one leaves the rows room."""
        peer, outer = self.ctx.cfg.peer, self.ctx.cfg.outer
        n = len(self.plan.group)
        copies = (  # sharded: a shard to each other member, twice (reduce-scatter, all-gather)
            2 * (n - 1) / n if self.plan.sharded else len(self.members) * (2 if outer.sends_phi else 1)
        )
        nbytes = theta.numel() * theta.element_size() * copies
        auto = peer.exchange_max_mbit is None
        cap = (self.board.uplink.cap() or 0.0) if auto else peer.exchange_max_mbit * 1e6 / 8
        rates = [cap] if cap else []
        step = self.ctx.deadlines.typical_step
        if self.paced and peer.exchange_pacing and outer.overlap_steps and step:  # step None: too few seen
            rates.append(nbytes / (peer.exchange_pacing * outer.overlap_steps * step))
        slowest = nbytes / (self.ctx.deadlines.exchange / 2)
        if cap and cap < slowest:
            logger.warning(
                "%s would take %.0f s to send this exchange's %.1f MB, more than half its deadline "
                "(%.0f s): sending at %.1f Mbit/s instead",
                "the measured link" if auto else f"peer.exchange_max_mbit={peer.exchange_max_mbit:g}",
                nbytes / cap,
                nbytes / 1e6,
                self.ctx.deadlines.exchange,
                slowest * 8 / 1e6,
            )
        pace = streams.Pacer(max(min(rates), slowest) if rates else 0.0)
        self.board.uplink.track(pace)  # partners' reports on it still count, whatever set the cap
        return pace

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
        avoided = self.board.avoidance.avoided(peer, self.plan.step)
        if not avoided:
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
        if avoided:  # it would wait for our call as callee: tell it not to (it calls: refused)
            if self.plan.calls(m):
                self.board.decline(peer, header, timeout=ctx.deadlines.exchange)
            return Avoided(f"{peer}'s outer weights were rejected lately")
        if not self.plan.calls(m):
            try:
                return await self._await_caller(key, peer)
            except (PeerUnavailable, RemoteRefused, MessageError, Rejoining) as e:
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
            except RelayOnly as e:  # no bulk data through a relay: tell it, so it steps at once
                self.board.decline(peer, header, timeout=ctx.deadlines.exchange)
                return e
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
                joins = status.joining_at if isinstance(status, PeerStatus) else None
                if joins is not None and joins > key[0]:
                    raise Rejoining(f"{peer} was restarted and joins at round {joins}, after exchange {key}")
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
        elif isinstance(error, RemoteRefused) and error.code == "avoided":
            logger.warning("%s avoids us at the outer step of step %d: stepping without it", peer, t)
            self.ctx.events.emit(events.Declined(step=t, peer=peer))
        # Alive, but only through a relay; or restarted, its old membership ending by reports or at
        # its new round: not suspect.
        elif isinstance(error, RelayOnly | Rejoining):
            logger.warning("stepping without %s at the outer step of step %d: %s", peer, t, error)
        elif isinstance(error, PeerUnavailable):
            await self.ctx.rounds.suspect(peer, f"outer exchange at step {t} failed: {error}")
        elif isinstance(error, MessageError):
            self.ctx.rounds.mark_dead(peer, f"malformed outer exchange at step {t}: {error}")
