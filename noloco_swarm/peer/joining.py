"""Joining a running swarm: the round to enter at, and the state to enter with.

A newcomer learns whom to join with from a member (peer/neighbourhood.py: the members of its stage
and the stages next to it; the whole directory only when no member answers), asks some of them
where they are (rpc_status), announces the round two after the furthest step it hears of (so
every member reads the announcement before that boundary: it hands the announcement to those it
asked, and they pass it on), and
downloads its stage's state from the live replicas of the stage while the swarm trains the round
before its own: each replica that read the announcement at the boundary before the joiner's
round keeps a snapshot there (peer/snapshots.py). A download that would outlast that round moves
the joiner's round further off, and the same snapshot is kept for it (peer/postpone.py). The
newcomer adopts one replica's snapshot, takes its chunks from every replica holding the same
bytes in parallel (peer/donors.py, protocol/chunks.py), checks the whole against the announced
weights hash, and adopts that replica's view of its round, which admits it. So a joiner starts
one round (or, moved, a few) behind its donor: NoLoCo's replicas differ anyway, and its first
outer step averages it with a partner like any other replica.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from noloco_swarm.peer import events, failpoints
from noloco_swarm.peer.context import PeerContext
from noloco_swarm.peer.donors import DONOR_ERRORS, ask_manifest, download_state
from noloco_swarm.peer.exchange.ledger import ByteLedger
from noloco_swarm.peer.liveness import DHT_ERRORS, PROBE_TIMEOUT, ask_status
from noloco_swarm.peer.neighbourhood import (
    SAMPLED,
    Contact,
    Found,
    contacts,
    entry_point_ids,
    in_our_order,
    sampled,
)
from noloco_swarm.peer.net.transport import Transport
from noloco_swarm.peer.postpone import (
    CHECK_SECONDS,
    DownloadWatch,
    Pace,
    Postponement,
    later_round,
)
from noloco_swarm.peer.snapshots import StateServer
from noloco_swarm.protocol import rpc
from noloco_swarm.protocol.clock import StepClock
from noloco_swarm.protocol.codec import MessageError
from noloco_swarm.protocol.membership import (
    JOIN_RETRY_ROUNDS,
    MembershipView,
)
from noloco_swarm.protocol.plan import join_round
from noloco_swarm.protocol.rpc import StateManifest

logger = logging.getLogger(__name__)


class RunEnding(RuntimeError):
    """The run ends before the first round this peer could join at: there is nothing left to train."""


async def furthest_step(
    transport: Transport, run_id: str, others: Sequence[Contact], timeout: float
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


async def after_announcing(
    transport: Transport, run_id: str, asked: Sequence[Contact], boundary: int
) -> int | None:
    """`furthest_step` of `asked` once we announced a round. Failpoint outpaced:rpc_status: not
    before the swarm has passed `boundary` (the one before our round), as one that outpaced our
    announcement has (its members kept state there for us if they read it in time)."""
    if failpoints.fire("outpaced", "rpc_status"):
        while (step := await furthest_step(transport, run_id, asked, PROBE_TIMEOUT)) is not None:
            if step >= boundary:
                return step
            await asyncio.sleep(0.1)
    return await furthest_step(transport, run_id, asked, PROBE_TIMEOUT)


def servers_for(others: Sequence[Contact], stage: int, round_: int) -> list[str]:
    """Peers of `stage` that were members before `round_` (they hold its state)."""
    return [a.peer_id for a in others if a.stage == stage and a.joined_round < round_]


class Joining:
    """This peer's joins (at start-up or after an exclusion); `server` serves state to joiners."""

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
        self.entering: asyncio.Future[bool] | None = None  # our announcement once we entered
        self.server = StateServer(ctx, ledger)  # the state we keep for joiners of our stage

    async def join_late(self, end_step: int, *, stale: bool = False, found: Found | None = None) -> None:
        """Enter a running swarm two rounds ahead with a live replica's state.

        Each attempt asks the live peers where they are, announces the round two after the
        furthest, and checks that nobody has reached the boundary before that round while the
        announcement was on its way (a member that passed it without reading us would keep no
        state for us there, and one that passed our round would not admit us): only then does
        it ask for the state. An attempt that learns nothing fresh (no peer answered: our link
        was cut, or our connections went stale with it) or whose announcement was not stored
        reconnects and tries again instead of fetching a round the swarm may have left. With
        `stale` (we were excluded, maybe cut off) it dials every peer afresh from the start.
        `found`: a member's answer in hand (peer/neighbourhood.py), for the first attempt."""
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
            others, through = await contacts(ctx, ctx.stage, found, ask=not problem)
            problem, reconnect = "", True
            found, asked = None, sampled(others, ctx.stage, ctx.me, SAMPLED)
            if not any(a.stage == ctx.stage for a in others):  # our DHT node lost its neighbours in a cut?
                problem = f"no replica of stage {ctx.stage} is in the run's directory (reconnecting)"
                continue
            dial = ctx.transport.redial if stale else ctx.transport.connect
            async with asyncio.TaskGroup() as group:
                for a in others:
                    group.create_task(dial(a.peer_id, a.addresses, timeout=PROBE_TIMEOUT))
            furthest = await furthest_step(ctx.transport, ctx.run_id, asked, PROBE_TIMEOUT)
            asked_at = time.monotonic()
            if furthest is None:  # cut off, or our connections went stale in a cut: dial afresh
                problem, stale = "no peer of the run answered where it is (was this peer cut off?)", True
                continue
            stale = False
            target = pick_join_round(max(furthest, *(a.step for a in asked)), ctx.clock, end_step, later)
            # A round we moved to (peer/postpone.py) stays ours: the members keep the newest round
            # a joiner announced, and would not admit it at an earlier one.
            target = max(target, self.joined_round)
            start = ctx.clock.round_start(target)
            self.joined_round = ctx.rounds.joining_at = target
            # A restarted member's old membership stays in the views up to round `target`: its
            # exchange partners that call our id get a refusal at once, not a wait to the deadline.
            self._retire_before(target)
            if not await self._announce():
                problem = f"the DHT did not store our announcement for round {target} (reconnecting)"
                continue
            ctx.events.emit(events.Joining(round=target, step=start, through=through))
            # Hand our announcement to them too, in case the DHT is late, while we ask again
            # where they are (a dead one costs each the same timeout, once).
            handing = asyncio.ensure_future(ctx.rounds.passing.hand_over(a.peer_id for a in asked))
            now = await after_announcing(ctx.transport, ctx.run_id, asked, ctx.clock.round_start(target - 1))
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
            logger.warning("joining the running swarm at round %d (step %d)", target, start)
            servers = servers_for(others, ctx.stage, target)
            # Spread joiners over the servers: each adopts the snapshot of the first in its own order.
            servers = in_our_order(ctx.me, servers)
            try:
                donors = [a for a in others if a.peer_id in servers]
                watcher = functools.partial(
                    self._postpone_while, others, end_step, (asked_at, furthest), donors
                )
                view, step = await self._fetch_state(
                    servers, target, max(1.0, deadline - time.monotonic()), donors, watcher
                )
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
        self,
        servers: list[str],
        round_: int,
        timeout: float,
        donors: list[Contact],
        watcher: Callable[[DownloadWatch], Awaitable[None]],
    ) -> tuple[MembershipView, int]:
        """Download and load our stage's state at the start of `round_` from `servers` (in order of
        preference; `donors`: their contacts); the first's view of the round (it admits us) and the
        step the round starts at. `watcher(watch)` runs while the download does (`_postpone_while`):
        a download that would outlast the swarm's way to `round_` moves our round further off, and
        we enter that one. Raises what `download_state` raises, or MessageError; the replica is
        untouched then."""
        ctx, replica = self.ctx, self.ctx.replica
        watch, until = DownloadWatch(), time.monotonic() + timeout

        def admits(manifest: StateManifest) -> bool:  # the state of a round before ours admits nobody yet
            stages = manifest.view
            return len(stages) == ctx.cfg.num_stages and (
                manifest.round < self.joined_round or ctx.me in stages[ctx.stage]
            )

        def emit(event: events.Event) -> None:
            watch.seen(event)
            ctx.events.emit(event)

        watching = asyncio.ensure_future(watcher(watch))
        try:
            got = await download_state(
                ctx.transport,
                servers,
                run_id=ctx.run_id,
                stage=ctx.stage,
                round_=round_,
                numel=replica.phi.numel(),
                timeout=timeout,
                admits=admits,
                emit=emit,
            )
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
        round_ = self.joined_round  # later than asked, if the download moved it
        manifest = got.manifest
        backup = replica.state_parts(with_theta=True)
        await asyncio.to_thread(replica.load_state_parts, got.parts, manifest.adam_step)
        try:
            if replica.state_hash() != manifest.state_hash:
                raise MessageError(f"the state of {got.target} does not hash to what it announced")
            stages = manifest.view
            if manifest.round < round_:  # the state of a boundary before ours: now our view
                if round_ > manifest.round + 1:  # moved: a donor answers for a round once it is near
                    await self._until_swarm_in(round_ - 1, donors, until - time.monotonic())
                stages = await self._entry_view(
                    got.target, manifest, round_, until - time.monotonic(), admits
                )
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

    async def _postpone_while(
        self,
        others: list[Contact],
        end_step: int,
        first: tuple[float, int],
        donors: list[Contact],
        watch: DownloadWatch,
    ) -> None:
        """While the download `watch` sees runs: ask the donors where they are every CHECK_SECONDS,
        and announce a later round (to `others`) whenever the download would end after the swarm
        reaches ours (its pace measured since `first`: (when, furthest step)) and before
        `end_step`."""
        ctx = self.ctx
        while True:
            await asyncio.sleep(CHECK_SECONDS)
            step = await furthest_step(ctx.transport, ctx.run_id, donors, PROBE_TIMEOUT)
            chunks = watch.pace()
            if step is None or chunks is None:
                continue
            now = (time.monotonic(), step)
            later = later_round(
                target=self.joined_round,
                snapshot_round=watch.snapshot_round,
                inner_steps=ctx.clock.inner_steps,
                chunks=chunks,
                total_chunks=watch.total,
                steps=Pace(first, now),
            )
            if later is None or ctx.clock.round_start(later.to) >= end_step:
                continue  # in time, or the run ends first: the swarm waits for us at our round
            if not failpoints.fire("keep_round", "rpc_fetch_state"):
                await self._postpone(later, others)

    async def _until_swarm_in(self, round_: int, donors: list[Contact], timeout: float) -> None:
        """Until a donor says it has reached `round_`; TimeoutError after `timeout` seconds."""
        async with asyncio.timeout(max(0.0, timeout)):
            while True:
                step = await furthest_step(self.ctx.transport, self.ctx.run_id, donors, PROBE_TIMEOUT)
                if step is not None and self.ctx.clock.round_of(step) >= round_:
                    return
                await asyncio.sleep(CHECK_SECONDS)

    async def _postpone(self, later: Postponement, others: list[Contact]) -> None:
        """Announce round `later.to` instead of ours, and hand it to the peers we asked, as at first."""
        ctx, was = self.ctx, self.joined_round
        self.joined_round = ctx.rounds.joining_at = later.to
        self._retire_before(later.to)
        ctx.events.emit(
            events.JoinPostponed(
                round=was,
                to=later.to,
                download_seconds=round(later.download_seconds, 2),
                swarm_seconds=round(later.swarm_seconds, 2),
            )
        )
        logger.warning(
            "our download ends in about %.0f s, the swarm reaches round %d in about %.0f s: "
            "joining at round %d instead",
            later.download_seconds,
            was,
            later.swarm_seconds,
            later.to,
        )
        if not await self._announce():
            logger.warning(
                "the DHT did not store our announcement of round %d (the heartbeat retries)", later.to
            )
        await ctx.rounds.passing.hand_over(a.peer_id for a in sampled(others, ctx.stage, ctx.me, SAMPLED))

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
        ids = entry_point_ids(entry)
        async with asyncio.TaskGroup() as group:
            for peer, maddr in zip(ids, entry, strict=True):
                group.create_task(ctx.transport.connect(peer, [maddr], timeout=PROBE_TIMEOUT))
        try:
            answered = await asyncio.to_thread(ctx.rounds.directory.rebootstrap, ids)
        except DHT_ERRORS as e:
            logger.warning("could not reach the run's entry points again: %s", e)
            return
        logger.warning("%d of %d entry points answered", answered, len(ids))
