"""Joining a running swarm and serving state to joiners: the round to enter at, and the state.

A newcomer asks the live peers where they are (rpc_status), announces the round two after the
furthest step it hears of (so every member reads the announcement before that boundary), and
downloads its stage's state from the live replicas of the stage while the swarm trains the round
before its own. Each replica that reads the announcement at the boundary before the joiner's
round keeps a snapshot taken right after the outer step there (theta == phi then; with an
overlapped outer step, which is still in flight at the boundary, its fast weights there serve as
the joiner's phi and theta: see `_snapshot`), with a manifest of chunk hashes (rpc_fetch_state),
and serves it one chunk per request (rpc_fetch_chunk). A replica that reads it only at the
joiner's own boundary keeps its state there instead, and the swarm's first round with the joiner
waits for its download. The newcomer adopts one replica's snapshot, takes its chunks from every
replica holding the same bytes in parallel (peer/donors.py, protocol/chunks.py), checks the whole
against the announced weights hash, and adopts that replica's view of its round, which admits it.
So a joiner starts one round behind its donor: NoLoCo's replicas differ anyway, and its first
outer step averages it with a partner like any other replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import torch
from hivemind.utils.multiaddr import Multiaddr

from noloco_swarm.peer import events, failpoints
from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.donors import DONOR_ERRORS, MIB, Snapshot, ask_manifest, download_state
from noloco_swarm.peer.exchange.ledger import ByteLedger
from noloco_swarm.peer.liveness import DHT_ERRORS, PROBE_TIMEOUT, ask_status
from noloco_swarm.peer.net.limits import Accepts
from noloco_swarm.peer.net.streams import Pacer
from noloco_swarm.peer.net.transport import Transport
from noloco_swarm.peer.views import Held
from noloco_swarm.protocol import codec, records, rpc
from noloco_swarm.protocol.clock import StepClock
from noloco_swarm.protocol.codec import MessageError
from noloco_swarm.protocol.membership import (
    JOIN_RETRY_ROUNDS,
    MembershipView,
    donor_serves,
    entering,
    newest,
    pending_joiners,
)
from noloco_swarm.protocol.plan import join_round
from noloco_swarm.protocol.rpc import StateManifest

logger = logging.getLogger(__name__)
R = TypeVar("R", rpc.StateRequest, rpc.ChunkRequest)


class RunEnding(RuntimeError):
    """The run ends before the first round this peer could join at: there is nothing left to train."""


async def furthest_step(
    transport: Transport, run_id: str, others: list[records.PeerAnnouncement], timeout: float
) -> int | None:
    """The furthest inner step any of `others` reports, asked directly (their announcements' step
    is only as fresh as their last heartbeat); None if none of them answered."""
    answers = await asyncio.gather(
        *(ask_status(transport, a.peer_id, run_id, timeout) for a in others), return_exceptions=True
    )
    steps = [x.step for x in answers if isinstance(x, rpc.PeerStatus)]
    return max(steps) if steps else None


def pick_join_round(furthest: int, clock: StepClock, end_step: int, later: int = 0) -> int:
    """The round to join at: JOIN_MARGIN_ROUNDS (plus `later`, at most JOIN_RETRY_ROUNDS more:
    donors refuse rounds further ahead) after the furthest step of the swarm. Raises RunEnding if
    the run is over by then."""
    target = join_round(furthest, clock.inner_steps) + min(later, JOIN_RETRY_ROUNDS)
    if clock.round_start(target) >= end_step:
        raise RunEnding(
            f"the run ends at step {end_step}, before round {target} (step {clock.round_start(target)}) "
            "where this peer could join"
        )
    return target


def servers_for(others: list[records.PeerAnnouncement], stage: int, round_: int) -> list[str]:
    """Peers of `stage` that were members before `round_` (they hold its state)."""
    return [a.peer_id for a in others if a.stage == stage and a.joined_round < round_]


def check_request(header: codec.Message, run_id: str, stage: int, kind: type[R] = rpc.StateRequest) -> R:
    if not isinstance(header, kind):
        raise MessageError(f"expected a {kind.TAG} request")
    if header.run_id != run_id or header.stage != stage:
        raise MessageError(
            f"this is stage {stage} of {run_id!r}, not stage {header.stage} of {header.run_id!r}"
        )
    return header


class Joining:
    """This peer's joins (at start-up or after an exclusion) and the state it serves to joiners."""

    def __init__(
        self,
        ctx: PeerContext,
        ledger: ByteLedger,
        announce: Callable[[], Awaitable[bool]],
        retire_before: Callable[[int], None] = lambda _: None,
    ) -> None:
        """`retire_before(J)`: we join at round J, and will hold no outer exchange of a round before
        it (the exchange board refuses those at once: see join_late)."""
        self.ctx, self.ledger, self._announce = ctx, ledger, announce
        self._retire_before = retire_before
        self.joined_round = 0
        self.snapshots: dict[int, Snapshot] = {}  # round -> state served to that round's joiners
        self.entering: asyncio.Future[bool] | None = None  # our announcement once we entered
        self.pacer = Pacer(ctx.cfg.peer.state_serve_rate * MIB)
        ctx.transport.register("rpc_fetch_state", self.rpc_fetch_state)
        ctx.transport.register("rpc_fetch_chunk", self.rpc_fetch_chunk, Accepts(direct_only=True))

    async def keep_for_joiners(self, previous: MembershipView, view: MembershipView, held: Held) -> None:
        """At a boundary: snapshot our state (just after the outer step) for the joiners of our
        stage that the records `held` announce for the next round (they download it during this
        one, and nobody waits for them), and for those `view` admits that we kept nothing for at
        the boundary before (they download it now, and the round waits for them)."""
        ctx = self.ctx
        early = self.snapshots.get(view.round - 1)
        listings = newest(held[0])
        new = entering(previous, view, listings)
        joiners = [
            p for p in view.stages[ctx.stage] if p in new and not (early is not None and p in early.pending)
        ]
        pending = frozenset(pending_joiners(view, ctx.stage, listings))
        if pending and failpoints.fire("miss_joiners", "rpc_fetch_state"):  # a test's announcement read late
            logger.warning("failpoint miss_joiners:rpc_fetch_state: no state kept for %s", sorted(pending))
            pending = frozenset()
        if joiners or pending:
            snapshot = await asyncio.to_thread(self._snapshot, view, pending)
            self.snapshots[view.round] = snapshot
            if joiners:
                ctx.events.emit(events.Joiners(round=view.round, peers=joiners, snapshot=snapshot.digest))
            if pending:
                ctx.events.emit(
                    events.Joiners(round=view.round + 1, peers=sorted(pending), snapshot=snapshot.digest)
                )
        # A joiner downloads during the round before its own (or, late, during its own).
        for old in [r for r in self.snapshots if r < view.round - 1]:
            del self.snapshots[old]

    def _snapshot(self, view: MembershipView, pending: frozenset[str]) -> Snapshot:
        replica = self.ctx.replica
        parts, adam_step = replica.state_parts()
        if self.ctx.cfg.outer.overlap_steps > 0:
            # This boundary's outer step is still in flight here (overlap), and the joiner was no
            # member of the round it closes, so it takes no part in it: it starts from our fast
            # weights at the boundary as its slow and fast weights, with our outer momentum. Every
            # part is of this one boundary, and they hash to what we announce.
            parts["phi"] = replica.theta()
        return Snapshot.take(parts, adam_step, replica.state_hash(), view, self.ctx.step, pending=pending)

    async def join_late(self, end_step: int, *, stale: bool = False) -> None:
        """Enter a running swarm two rounds ahead with a live replica's state.

        Each attempt asks the live peers where they are, announces the round two after the
        furthest, and checks that nobody has reached the boundary before that round while the
        announcement was on its way (a member that passed it without reading us would keep no
        state for us there, and one that passed our round would not admit us): only then does
        it ask for the state. An attempt that learns nothing fresh (no peer answered: our link
        was cut, or our connections went stale with it) or whose announcement was not stored
        reconnects and tries again instead of fetching a round the swarm may have left. With
        `stale` (we were excluded, maybe cut off) it dials every peer afresh from the start."""
        ctx = self.ctx
        timeout = ctx.cfg.peer.join_timeout
        deadline = time.monotonic() + timeout
        problem, reconnect, later = "", False, 0
        while True:
            if problem:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"this peer could not join the run within {timeout:.0f} s: {problem}")
                logger.warning("%s", problem)
                if reconnect:
                    await self._reconnect()
                await asyncio.sleep(1.0)
            problem, reconnect = "", True
            others = [a for a in await asyncio.to_thread(ctx.rounds.read_peers) if a.peer_id != ctx.me]
            if not any(a.stage == ctx.stage for a in others):  # our DHT node lost its neighbours in a cut?
                problem = f"no replica of stage {ctx.stage} is in the run's directory (reconnecting)"
                continue
            dial = ctx.transport.redial if stale else ctx.transport.connect
            async with asyncio.TaskGroup() as group:
                for a in others:
                    group.create_task(dial(a.peer_id, a.addresses, timeout=PROBE_TIMEOUT))
            furthest = await furthest_step(ctx.transport, ctx.run_id, others, PROBE_TIMEOUT)
            if furthest is None:  # cut off, or our connections went stale in a cut: dial afresh
                problem, stale = "no peer of the run answered where it is (was this peer cut off?)", True
                continue
            stale = False
            target = pick_join_round(max(furthest, *(a.step for a in others)), ctx.clock, end_step, later)
            start = ctx.clock.round_start(target)
            self.joined_round = ctx.rounds.joining_at = target
            # A restarted member's old membership stays in the views up to round `target`: its
            # exchange partners that call our id get a refusal at once, not a wait to the deadline.
            self._retire_before(target)
            if not await self._announce():
                problem = f"the DHT did not store our announcement for round {target} (reconnecting)"
                continue
            # Hand our announcement to them too, in case the DHT is late, while we ask again
            # where they are (a dead one costs each the same timeout, once).
            handing = asyncio.ensure_future(ctx.rounds.passing.hand_over(a.peer_id for a in others))
            now = await furthest_step(ctx.transport, ctx.run_id, others, PROBE_TIMEOUT)
            await handing
            # Donors keep our state at the boundary before our round if they read us by then: a
            # swarm already there may have passed it without us, and would wait for our download.
            if now is not None and now >= ctx.clock.round_start(target - 1):
                logger.warning(
                    "the swarm reached step %d while we announced round %d (step %d); choosing a later one",
                    now,
                    target,
                    start,
                )
                later = JOIN_RETRY_ROUNDS  # the swarm outpaces our announcements: aim one round further
                continue
            ctx.events.emit(events.Joining(round=target, step=start))
            logger.warning("joining the running swarm at round %d (step %d)", target, start)
            servers = servers_for(others, ctx.stage, target)
            # Spread joiners over the servers: each adopts the snapshot of the first in its own order.
            servers.sort(key=lambda p: hashlib.sha256(f"{ctx.me}/{p}".encode()).digest())
            try:
                view, step = await self._fetch_state(servers, target, max(1.0, deadline - time.monotonic()))
            except (*DONOR_ERRORS, TimeoutError) as e:
                problem, reconnect = f"state fetch for round {target} failed: {e}", False
            else:
                ctx.step = step
                ctx.rounds.adopt(view)
                # Say at once that we entered (our step is now the round's first): a member that
                # missed us at this round admits us late on that evidence (next_view), not on the
                # announcement we made before, which a heartbeat would refresh only ttl/3 later.
                self.entering = asyncio.ensure_future(self._announce())
                return

    async def _fetch_state(
        self, servers: list[str], round_: int, timeout: float
    ) -> tuple[MembershipView, int]:
        """Download and load our stage's state at the start of `round_` from `servers` (in order of
        preference); the first's view of the round (it admits us) and the step the round starts at.
        Raises what `download_state` raises, or MessageError; the replica is untouched then."""
        ctx, replica = self.ctx, self.ctx.replica

        def admits(manifest: StateManifest) -> bool:  # the state of the round before admits nobody yet
            stages = manifest.view
            return len(stages) == ctx.cfg.num_stages and (
                manifest.round < round_ or ctx.me in stages[ctx.stage]
            )

        got = await download_state(
            ctx.transport,
            servers,
            run_id=ctx.run_id,
            stage=ctx.stage,
            round_=round_,
            numel=replica.phi.numel(),
            timeout=timeout,
            admits=admits,
            emit=ctx.events.emit,
        )
        manifest = got.manifest
        backup = replica.state_parts(with_theta=True)
        await asyncio.to_thread(replica.load_state_parts, got.parts, manifest.adam_step)
        try:
            if replica.state_hash() != manifest.state_hash:
                raise MessageError(f"the state of {got.target} does not hash to what it announced")
            stages = manifest.view
            if manifest.round < round_:  # the state of the boundary before ours: now our view
                stages = await self._entry_view(got.target, manifest, round_, timeout, admits)
            try:
                view = MembershipView(round=round_, stages=stages)  # validates the ids' order
            except ValueError as e:
                raise MessageError(f"{got.target}'s view of round {round_} is malformed: {e}") from e
        except (*DONOR_ERRORS, TimeoutError):
            replica.load_state_parts(*backup)
            raise
        self.ledger.reset()  # the fetch is no outer exchange
        ctx.events.emit(
            events.Joined(
                round=round_,
                step=ctx.clock.round_start(round_),
                from_step=manifest.step,
                server=got.target,
                state_hash=manifest.state_hash,
                peer_id=ctx.me,
                snapshot=manifest.snapshot,
                sent=got.sent,
            )
        )
        logger.warning(
            "loaded the state of %s for round %d; chunks per donor: %s%s",
            got.target,
            round_,
            got.sent,
            f"; lost {sorted(got.lost)}" if got.lost else "",
        )
        return view, ctx.clock.round_start(round_)

    async def _entry_view(
        self,
        donor: str,
        held: StateManifest,
        round_: int,
        timeout: float,
        admits: Callable[[StateManifest], bool],
    ) -> tuple[tuple[str, ...], ...]:
        """`donor`'s view of `round_`, once it has one, which must admit us; we hold the state it
        kept for us at the boundary before (`held`)."""
        ctx = self.ctx
        entry = await ask_manifest(
            ctx.transport, donor, ctx.run_id, ctx.stage, round_, timeout, admitted=True
        )
        if entry.snapshot != held.snapshot or not admits(entry):
            raise MessageError(
                f"{donor}'s view of round {round_} does not admit this peer with the state it sent"
            )
        return entry.view

    async def _reconnect(self) -> None:
        """Dial the run's entry points again and refill our DHT node's routing table from them."""
        ctx, entry = self.ctx, self.ctx.cfg.network.initial_peers
        ids = [str(Multiaddr(m)["p2p"]) for m in entry]
        async with asyncio.TaskGroup() as group:
            for peer, maddr in zip(ids, entry, strict=True):
                group.create_task(ctx.transport.connect(peer, [maddr], timeout=PROBE_TIMEOUT))
        try:
            answered = await asyncio.to_thread(ctx.rounds.directory.rebootstrap, ids)
        except DHT_ERRORS as e:
            logger.warning("could not reach the run's entry points again: %s", e)
            return
        logger.warning("%d of %d entry points answered", answered, len(ids))

    async def rpc_fetch_state(
        self, peer_id: str, header: codec.Message, tensors: list[torch.Tensor]
    ) -> tuple[codec.Message, list[torch.Tensor]]:
        """A peer joining our stage at a round asks for the manifest of the state we keep for it:
        of the boundary before its round if we read its announcement there (it downloads while
        the swarm trains), else of its round's (see StateRequest)."""
        ctx = self.ctx
        request = check_request(header, ctx.run_id, ctx.stage)
        round_ = request.round
        if not donor_serves(ctx.clock.round_of(ctx.step), round_):  # see pick_join_round
            raise MessageError(f"round {round_} is too far ahead (this peer is at step {ctx.step})")
        if round_ < 1:
            raise MessageError("nobody joins at round 0: it is the founders'")
        until = time.monotonic() + min(ctx.cfg.peer.join_timeout, ctx.transport.config.serve_timeout - 5.0)
        if not request.admitted:
            await ctx.rounds.wait(round_ - 1, timeout=until - time.monotonic())
            early = self.snapshots.get(round_ - 1)
            if early is not None and peer_id in early.pending:
                return early.manifest(ctx.run_id, ctx.stage), []
        view = await ctx.rounds.wait(round_, timeout=until - time.monotonic())
        if peer_id not in view.stages[ctx.stage]:
            raise MessageError(f"peer {peer_id} is not admitted at round {round_} by this peer's view")
        if request.admitted:  # it holds the state we kept for it at the boundary before
            early = self.snapshots.get(round_ - 1)
            if early is None or peer_id not in early.pending:
                raise MessageError(
                    f"this peer kept no state for {peer_id} at the boundary before round {round_}"
                )
            return early.manifest(ctx.run_id, ctx.stage, view), []
        snapshot = self.snapshots.get(round_)
        if snapshot is None or snapshot.view != view:
            raise MessageError(f"this peer kept no state for {peer_id} at round {round_}")
        return snapshot.manifest(ctx.run_id, ctx.stage), []

    async def rpc_fetch_chunk(
        self, peer_id: str, header: codec.Message, tensors: list[torch.Tensor]
    ) -> tuple[codec.Message, list[torch.Tensor]]:
        """A joiner that holds our manifest downloads one chunk of that snapshot."""
        ctx = self.ctx
        request = check_request(header, ctx.run_id, ctx.stage, rpc.ChunkRequest)
        reply, tensor = self._kept_for(peer_id, request).chunk(ctx.run_id, ctx.stage, request)
        nbytes = tensor.numel() * tensor.element_size()
        await self.pacer.wait(nbytes)
        ctx.events.emit(events.ServedState(round=request.round, peer=peer_id, chunk=request.index))
        # Keep the state we serve out of the next outer step's byte count with this peer.
        self.ledger.exclude(peer_id, nbytes)
        return reply, [tensor]

    def _kept_for(self, peer_id: str, request: rpc.ChunkRequest) -> Snapshot:
        """The snapshot `request` names, if we keep it for `peer_id` (see Snapshot.serves)."""
        for snapshot in self.snapshots.values():
            if snapshot.digest == request.snapshot and snapshot.serves(peer_id, self.ctx.stage):
                return snapshot
        raise MessageError(
            f"this peer keeps no snapshot {request.snapshot[:12]} for {peer_id} (round {request.round}): "
            "ask for its manifest again"
        )
