"""State from several donors over real p2pd daemons: parallel chunks, forged chunks, a donor's death."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from noloco_swarm.peer import events
from noloco_swarm.peer.donors import EARLY_GRACE, Snapshot, download_state
from noloco_swarm.peer.net.transport import Transport, TransportConfig
from noloco_swarm.protocol import codec, rpc
from noloco_swarm.protocol.membership import MembershipView
from tests.integration.helpers import p2pd_descendants
from tests.integration.test_transport import run, wait_until

pytestmark = pytest.mark.integration
RUN, NUMEL, CHUNK_BYTES = "donors", 100_000, 64 << 10  # 7 chunks per part, 28 in all
CONFIG = TransportConfig(serve_timeout=20)
VIEW = MembershipView(2, (("a", "b", "c"),))


def parts(seed: int) -> dict[str, torch.Tensor]:
    """phi and delta shared by every replica (one group spans the stage), moments their own."""
    own = torch.Generator().manual_seed(seed)
    shared = torch.Generator().manual_seed(0)
    return {
        "phi": torch.randn(NUMEL, generator=shared),
        "delta": torch.randn(NUMEL, generator=shared),
        "exp_avg": torch.randn(NUMEL, generator=own),
        "exp_avg_sq": torch.rand(NUMEL, generator=own),
    }


class Donor:
    """Serves a snapshot as a replica does (peer/joining.py), and misbehaves when told to."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.snapshot = Snapshot.take(parts(1), 6, "e" * 64, VIEW, 6, CHUNK_BYTES)
        self.forge: set[int] = set()  # chunks sent with one value changed
        self.die_once_fetched: list[events.Event] | None = None  # the joiner's events: die after one
        self.served = 0
        self.dying: asyncio.Task[None] | None = None
        self.hold: asyncio.Event | None = None  # a late donor's: its manifest waits for this
        transport.register("rpc_fetch_state", self.manifest)
        transport.register("rpc_fetch_chunk", self.chunk)

    def serve(self, seed: int, view: MembershipView = VIEW) -> None:
        self.snapshot = Snapshot.take(parts(seed), 6, "e" * 64, view, 6, CHUNK_BYTES)
        self.forge, self.die_once_fetched, self.served, self.hold = set(), None, 0, None

    async def manifest(self, peer: str, header: codec.Message, _: list) -> tuple[codec.Message, list]:
        if self.hold is not None:  # as a donor that read the joiner late waits for its round
            await self.hold.wait()
        return self.snapshot.manifest(RUN, 0), []

    async def chunk(self, peer: str, header: codec.Message, _: list) -> tuple[codec.Message, list]:
        assert isinstance(header, rpc.ChunkRequest)
        seen = self.die_once_fetched
        me = self.transport.peer_id
        if seen is not None and any(isinstance(e, events.ChunkFetched) and e.donor == me for e in seen):
            # Its p2pd exits and every stream to it breaks; shutdown also ends this handler.
            self.dying = asyncio.get_running_loop().create_task(self.transport.shutdown())
            await asyncio.sleep(60)
        reply, tensor = self.snapshot.chunk(RUN, 0, header)
        if header.index in self.forge:
            tensor = tensor.clone()
            tensor[0] += 1.0
        self.served += 1
        return reply, [tensor]


@pytest.fixture(scope="module")
def swarm(loop: asyncio.AbstractEventLoop) -> Iterator[tuple[Transport, Donor, Donor]]:
    """A joiner and two donors, connected; always shut down, and no p2pd of ours may remain."""
    before = p2pd_descendants()
    started: list[Transport] = []
    donors: list[Donor] = []
    try:
        joiner = loop.run_until_complete(Transport.create(config=CONFIG))
        started.append(joiner)
        entry = loop.run_until_complete(joiner.visible_addresses())
        for _ in range(2):
            started.append(loop.run_until_complete(Transport.create(initial_peers=entry, config=CONFIG)))
            donors.append(Donor(started[-1]))
        yield joiner, donors[0], donors[1]
    finally:
        for transport in reversed(started):
            loop.run_until_complete(transport.shutdown())  # idempotent
        for donor in donors:
            if donor.dying is not None:
                loop.run_until_complete(donor.dying)
    assert wait_until(lambda: p2pd_descendants() <= before), "a transport left its p2pd running"


def fetch(loop: asyncio.AbstractEventLoop, joiner: Transport, donors: list[Donor], seen: list) -> object:
    return run(
        loop,
        download_state(
            joiner,
            [d.transport.peer_id for d in donors],
            run_id=RUN,
            stage=0,
            round_=2,
            numel=NUMEL,
            timeout=20,
            emit=seen.append,
        ),
    )


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_chunks_come_from_both_donors_and_the_state_is_the_first_ones(
    loop: asyncio.AbstractEventLoop, swarm: tuple[Transport, Donor, Donor]
) -> None:
    joiner, a, b = swarm
    a.serve(1)
    b.serve(2)
    seen: list[events.Event] = []
    got = fetch(loop, joiner, [a, b], seen)
    ida, idb = a.transport.peer_id, b.transport.peer_id
    assert got.target == ida and same(got.parts, parts(1)) and got.lost == {}
    assert got.manifest.snapshot == a.snapshot.manifest(RUN, 0).snapshot
    assert got.sent[ida] + got.sent[idb] == 28 and got.sent[idb] > 0  # b shares phi and delta
    from_b = {e.part for e in events.of_kind(seen, events.ChunkFetched) if e.donor == idb}
    assert from_b <= {"phi", "delta"}, "b's moments are not a's: they must come from a"


@pytest.mark.parametrize("who", ["target", "other"])
def test_a_forged_chunk_never_reaches_the_state(
    loop: asyncio.AbstractEventLoop, swarm: tuple[Transport, Donor, Donor], who: str
) -> None:
    joiner, a, b = swarm
    a.serve(1)
    b.serve(1)  # the same state: every chunk has two holders
    forger, honest = (a, b) if who == "target" else (b, a)
    forger.forge = set(range(28))
    seen: list[events.Event] = []
    got = fetch(loop, joiner, [a, b], seen)
    assert got.target == honest.transport.peer_id and same(got.parts, parts(1))
    assert list(got.lost) == [forger.transport.peer_id] and "hash" in got.lost[forger.transport.peer_id]
    assert forger.transport.peer_id not in got.sent
    lost = events.of_kind(seen, events.DonorLost)
    assert [e.donor for e in lost] == [forger.transport.peer_id]


def test_a_donor_on_the_late_path_does_not_hold_back_the_early_ones(
    loop: asyncio.AbstractEventLoop, swarm: tuple[Transport, Donor, Donor]
) -> None:
    """One donor keeps the joiner's state at the boundary before its round (round 1 of a joiner
    of round 2) and answers at once; the other read the joiner late and answers only at the
    round's own boundary (here: never, until the test lets it). The joiner downloads the early
    state EARLY_GRACE after its manifest came, without the late donor, whose state shares no
    chunk with it; before, it waited for every manifest, and the swarm with it."""
    joiner, a, b = swarm
    a.serve(1, MembershipView(1, VIEW.stages))
    b.serve(2)
    b.hold = asyncio.Event()
    seen: list[events.Event] = []
    try:
        got = fetch(loop, joiner, [b, a], seen)  # the late donor first in preference
        assert not b.hold.is_set()
    finally:
        b.hold.set()
    ida, idb = a.transport.peer_id, b.transport.peer_id
    assert got.target == ida and got.manifest.round == 1 and same(got.parts, parts(1))
    assert got.sent == {ida: 28} and b.served == 0
    assert f"{EARLY_GRACE:g} s after a manifest of round 1" in got.lost[idb]


# Last in this module: its donor stays dead.
def test_a_donor_that_dies_mid_download_hands_over_to_the_other(
    loop: asyncio.AbstractEventLoop, swarm: tuple[Transport, Donor, Donor]
) -> None:
    """The target dies after the joiner took a chunk from it: the joiner adopts the other donor's
    state, keeping what both hold (phi, delta) and fetching the other's own moments."""
    joiner, a, b = swarm
    a.serve(1)
    b.serve(2)
    seen: list[events.Event] = []
    a.die_once_fetched = seen
    got = fetch(loop, joiner, [a, b], seen)
    ida, idb = a.transport.peer_id, b.transport.peer_id
    assert any(isinstance(e, events.ChunkFetched) and e.donor == ida for e in seen), "a died too early"
    assert got.target == idb and same(got.parts, parts(2)), "the state is not exactly b's"
    assert got.manifest.snapshot == b.snapshot.manifest(RUN, 0).snapshot
    assert ida in got.lost and got.sent[idb] >= 14  # at least b's own moments
