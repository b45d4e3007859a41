"""A stage's state moved to a joiner in hashed chunks, from every live donor at once.

Donor side: `Snapshot` is a replica's state at a round boundary with its manifest (chunk hashes,
computed once when it is taken), and serves one chunk per request; a `streams.Pacer` caps the
rate at which a volunteer serves state (`peer.state_serve_rate`).

Joiner side: `download_state` asks every donor for its manifest, adopts the first donor's
snapshot in the joiner's preference order (protocol/chunks.py says why one donor's: replicas of a
stage differ), and keeps `IN_FLIGHT` chunk requests open to each donor that holds the same bytes,
so donors send in parallel. Each chunk is hashed on arrival and kept only if it matches; a donor
that dies, refuses or sends a chunk that does not match its manifest is dropped and its chunks are
asked of the others. Nothing reaches the replica until every chunk has been received and checked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from noloco_swarm.peer import events
from noloco_swarm.peer.net.streams import PeerUnavailable, RemoteRefused
from noloco_swarm.peer.net.transport import Transport
from noloco_swarm.peer.postpone import MAX_LEAD_ROUNDS
from noloco_swarm.protocol import chunks as chunking
from noloco_swarm.protocol.chunks import ChunkPlan
from noloco_swarm.protocol.codec import MessageError, TensorMeta
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.protocol.rpc import STATE_PARTS, ChunkRequest, StateChunk, StateManifest, StateRequest

logger = logging.getLogger(__name__)
IN_FLIGHT = 2  # chunk requests open per donor: one travels while the next is being served
MIB = 1 << 20
DONOR_ERRORS = (PeerUnavailable, RemoteRefused, MessageError)
# A donor that read a joiner in time answers its manifest request at once, with the state of the
# boundary before the joiner's round; one that read it late answers only at the round's own
# boundary, with a state that shares no chunk with the early one. Once an early manifest is in,
# the other donors get this long to answer before the download starts without them.
EARLY_GRACE = 2.0


@dataclass
class Snapshot:
    """A replica's state at the start of `view`'s round, kept for the peers that join at that
    round (members of `view` new to it) or at the next (`pending`: announced for it)."""

    view: MembershipView
    step: int
    adam_step: int
    state_hash: str
    parts: dict[str, torch.Tensor]
    chunk_elements: int
    hashes: tuple[str, ...] = ()
    digest: str = ""  # StateManifest.snapshot, the name chunk requests must give
    pending: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.digest = self.manifest("run", 0).snapshot  # independent of the run and stage named

    @classmethod
    def take(
        cls,
        parts: dict[str, torch.Tensor],
        adam_step: int,
        state_hash: str,
        view: MembershipView,
        step: int,
        chunk_bytes: int | None = None,
        pending: frozenset[str] = frozenset(),
    ) -> Snapshot:
        """From `StageReplica.state_parts()` and its `state_hash()`; hashes every chunk (CPU-bound).
        `chunk_bytes` overrides the size chunks.chunk_elements_for picks."""
        numel = parts[STATE_PARTS[0]].numel()
        elements = chunking.chunk_elements_for(numel) if chunk_bytes is None else max(1, chunk_bytes // 4)
        hashes = chunking.chunk_hashes(parts, elements)
        return cls(view, step, adam_step, state_hash, parts, elements, hashes, pending=pending)

    def serves(self, peer: str, stage: int) -> bool:
        """May `peer` fetch this state: a member of our `stage` in the view (the joiners it admits
        among them), or a joiner of the next round it was kept for?"""
        return peer in self.pending or peer in self.view.stages[stage]

    def manifest(self, run_id: str, stage: int, view: MembershipView | None = None) -> StateManifest:
        """The manifest of this state, with `view` (a later round's: the joiner's) or our own."""
        view = view or self.view
        return StateManifest(
            run_id=run_id,
            stage=stage,
            round=view.round,
            step=self.step,
            view=view.stages,
            adam_step=self.adam_step,
            state_hash=self.state_hash,
            numel=self.parts[STATE_PARTS[0]].numel(),
            chunk_elements=self.chunk_elements,
            chunks=self.hashes,
        )

    def chunk(self, run_id: str, stage: int, request: ChunkRequest) -> tuple[StateChunk, torch.Tensor]:
        """The reply to `request`; MessageError if it names another snapshot or no chunk of ours."""
        if request.snapshot != self.digest:
            raise MessageError(
                f"this peer's snapshot of round {request.round} is {self.digest[:12]}, "
                f"not {request.snapshot[:12]}: ask for its manifest again"
            )
        spans = chunking.layout(self.parts[STATE_PARTS[0]].numel(), self.chunk_elements)
        if not request.index < len(spans):
            raise MessageError(f"chunk {request.index} of {len(spans)} does not exist")
        span = spans[request.index]
        tensor = self.parts[span.part][span.start : span.stop]  # a view: nothing is copied
        header = StateChunk(
            run_id, stage, request.round, request.snapshot, request.index, TensorMeta.of(tensor)
        )
        return header, tensor


@dataclass
class Download:
    """What `download_state` assembled: the adopted manifest and parts, and who sent what."""

    manifest: StateManifest
    parts: dict[str, torch.Tensor]
    target: str  # the donor whose snapshot this is
    sent: dict[str, int] = field(default_factory=dict)  # donor -> chunks kept from it
    lost: dict[str, str] = field(default_factory=dict)  # donor -> why it was dropped


async def ask_manifest(
    transport: Transport,
    donor: str,
    run_id: str,
    stage: int,
    round_: int,
    timeout: float,
    *,
    admitted: bool = False,
) -> StateManifest:
    """`donor`'s manifest for a joiner of `round_`: of the state at the start of `round_` or of
    the round before (StateRequest says when), or of an earlier boundary the donor kept for us
    when we announced an earlier round (at most MAX_LEAD_ROUNDS before: peer/postpone.py); with
    `admitted`, with its view of `round_`."""
    reply, tensors = await transport.call(
        donor, "rpc_fetch_state", StateRequest(run_id, stage, round_, admitted), timeout=timeout
    )
    if not isinstance(reply, StateManifest) or tensors:
        raise MessageError(f"{donor} answered the state request with something else")
    rounds = range(round_, round_ + 1) if admitted else range(round_ - 1 - MAX_LEAD_ROUNDS, round_ + 1)
    if reply.stage != stage or reply.round not in rounds:
        raise MessageError(f"{donor} sent the manifest of stage {reply.stage} round {reply.round}")
    return reply


async def download_state(
    transport: Transport,
    donors: Sequence[str],
    *,
    run_id: str,
    stage: int,
    round_: int,
    numel: int,
    timeout: float,
    admits: Callable[[StateManifest], bool] = lambda m: True,
    emit: Callable[[events.Event], None] | None = None,
) -> Download:
    """Fetch the state `donors` (in order of preference) keep for a joiner of `stage` at `round_`.

    `admits` rejects a manifest this peer may not use (e.g. a view without it). Raises
    PeerUnavailable when no donor is left before every chunk arrived; MessageError when no donor
    sent a usable manifest. Within `timeout` overall.
    """
    async with asyncio.timeout(timeout):
        answers = await _manifests(transport, donors, run_id, stage, round_, timeout, admits)
        room = _Room.from_answers(
            transport, donors, answers, run_id, stage, round_, numel, admits, timeout, emit
        )
        return await room.run()


async def _manifests(
    transport: Transport,
    donors: Sequence[str],
    run_id: str,
    stage: int,
    round_: int,
    timeout: float,
    admits: Callable[[StateManifest], bool],
) -> list[StateManifest | BaseException]:
    """Every donor's answer to our manifest request, in `donors`' order; but once one usable
    manifest of the round before `round_` is in, a donor that has not answered EARLY_GRACE
    seconds later is given up (PeerUnavailable): a donor on the late path would hold the download
    back until our round's boundary, and the swarm would wait for it there."""
    asks = [asyncio.ensure_future(ask_manifest(transport, d, run_id, stage, round_, timeout)) for d in donors]

    def early(task: asyncio.Future[StateManifest]) -> bool:
        if task.cancelled() or task.exception() is not None:
            return False
        answer = task.result()
        return answer.round < round_ and admits(answer)

    pending, until = set(asks), None
    try:
        while pending:
            left = None if until is None else max(0.0, until - asyncio.get_running_loop().time())
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break  # the grace is over
            if until is None and any(early(task) for task in done):
                until = asyncio.get_running_loop().time() + EARLY_GRACE
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    if until is None:
        return [task.exception() or task.result() for task in asks]
    # Only the early states: a later one shares no chunk with them, and waits for our round.
    late = PeerUnavailable(f"it had not answered {EARLY_GRACE:g} s after a manifest of round {round_ - 1}")
    later = MessageError(f"it keeps the state of round {round_}; another donor's of round {round_ - 1} is in")
    return [
        late
        if task.cancelled()
        else task.exception() or (later if task.result().round == round_ else task.result())
        for task in asks
    ]


class _Room:
    """One download: its plan, its buffers, and one worker per open request to a donor."""

    @classmethod
    def from_answers(
        cls,
        transport: Transport,
        donors: Sequence[str],
        answers: list[StateManifest | BaseException],
        run_id: str,
        stage: int,
        round_: int,
        numel: int,
        admits: Callable[[StateManifest], bool],
        timeout: float,
        emit: Callable[[events.Event], None] | None,
    ) -> _Room:
        """The room for the donors whose manifest answers fit; MessageError if none does."""
        manifests, lost = {}, {}
        for donor, answer in zip(donors, answers, strict=True):
            if isinstance(answer, StateManifest) and answer.numel == numel and admits(answer):
                manifests[donor] = answer
            elif isinstance(answer, StateManifest):
                lost[donor] = f"its manifest of round {round_} does not fit this peer ({answer.numel} values)"
            elif isinstance(answer, DONOR_ERRORS):
                lost[donor] = str(answer)
            else:
                raise answer  # a bug of ours
        if not manifests:
            raise MessageError(f"no donor sent a usable manifest of round {round_}: {lost}")
        room = cls(transport, ChunkPlan(manifests, list(donors)), run_id, stage, round_, timeout, emit)
        room.plan.lost.update(lost)
        room.announce()
        return room

    def __init__(
        self,
        transport: Transport,
        plan: ChunkPlan,
        run_id: str,
        stage: int,
        round_: int,
        timeout: float,
        emit: Callable[[events.Event], None] | None,
    ) -> None:
        self.transport, self.plan = transport, plan
        self.run_id, self.stage, self.round, self.timeout = run_id, stage, round_, timeout
        self.emit = emit or (lambda e: None)
        numel = plan.manifest.numel
        self.parts = {part: torch.empty(numel, dtype=torch.float32) for part in STATE_PARTS}
        self.sent_by: dict[int, str] = {}  # index -> donor whose bytes the buffers hold
        self.changed = asyncio.Condition()

    async def run(self) -> Download:
        plan = self.plan
        workers = [asyncio.create_task(self._worker(d)) for d in plan.order for _ in range(IN_FLIGHT)]
        try:
            while not (plan.finished or plan.failed):
                waiter = asyncio.create_task(self._until_settled())
                done, _ = await asyncio.wait([waiter, *workers], return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is not waiter and not task.cancelled() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]  # a bug of ours, not a donor's
                workers = [w for w in workers if not w.done()]
                waiter.cancel()
                await asyncio.gather(waiter, return_exceptions=True)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        if plan.failed:
            raise PeerUnavailable(f"every donor of round {self.round} was lost: {plan.lost}")
        assert plan.target is not None
        sent: dict[str, int] = {}
        for index in plan.done:
            sent[self.sent_by[index]] = sent.get(self.sent_by[index], 0) + 1
        return Download(plan.manifest, self.parts, plan.target, sent, dict(plan.lost))

    async def _until_settled(self) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.plan.finished or self.plan.failed)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _worker(self, donor: str) -> None:
        plan = self.plan
        while donor in plan.live and not (plan.finished or plan.failed):
            index = plan.take(donor)
            if index is None:  # nothing for this donor now; a lost target may bring more
                async with self.changed:
                    await self.changed.wait()
                continue
            try:
                await self._fetch(donor, index)
            except DONOR_ERRORS as e:
                # A broken stream or a busy donor may be transient; garbage and refusals are not.
                transient = isinstance(e, PeerUnavailable) or (
                    isinstance(e, RemoteRefused) and e.code in ("busy", "timeout")
                )
                if donor in plan.live:
                    logger.warning("donor %s failed chunk %d of round %d: %s", donor, index, self.round, e)
                self._fail(donor, index, str(e), fatal=not transient)
            finally:
                plan.release(donor, index)
            await self._notify()

    def announce(self) -> None:
        """Tell whose snapshot is being assembled now, and who may send chunks of it."""
        plan = self.plan
        if plan.target is None:
            return
        donors = [d for d in plan.order if d in plan.live]
        snapshot = plan.manifest.snapshot
        self.emit(
            events.StateFetch(
                round=self.round,
                target=plan.target,
                donors=donors,
                snapshot=snapshot,
                snapshot_round=plan.manifest.round,
            )
        )

    def _fail(self, donor: str, index: int, reason: str, *, fatal: bool) -> None:
        target = self.plan.target
        if not self.plan.fail(donor, index, reason, fatal=fatal):
            return
        self.emit(events.DonorLost(round=self.round, donor=donor, reason=reason[:200]))
        if self.plan.target != target and self.plan.target is not None:
            logger.warning(
                "donor %s failed; adopting the snapshot of %s (%d chunks kept)",
                donor,
                self.plan.target,
                len(self.plan.done),
            )
            self.announce()

    async def _fetch(self, donor: str, index: int) -> None:
        mine = self.plan.manifests[donor]
        span = chunking.layout(mine.numel, mine.chunk_elements)[index]
        request = ChunkRequest(self.run_id, self.stage, self.round, mine.snapshot, index)
        expect = (TensorMeta((span.numel,), "float32"),)
        reply, (tensor,) = await self.transport.call(
            donor, "rpc_fetch_chunk", request, timeout=self.timeout, expect=expect, direct=True
        )
        if not isinstance(reply, StateChunk) or (reply.index, reply.snapshot) != (index, mine.snapshot):
            raise MessageError(f"{donor} answered the request for chunk {index} with something else")
        if await asyncio.to_thread(chunking.digest, tensor) != mine.chunks[index]:
            raise MessageError(f"chunk {index} from {donor} does not hash to its manifest's entry")
        if not self.plan.accept(donor, index, mine.chunks[index]):
            return  # held already, or the target changed while it travelled
        self.parts[span.part][span.start : span.stop].copy_(tensor)
        self.sent_by[index] = donor
        self.emit(
            events.ChunkFetched(
                round=self.round, donor=donor, index=index, part=span.part, of=len(mine.chunks)
            )
        )
