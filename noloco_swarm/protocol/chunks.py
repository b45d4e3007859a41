"""A stage's state in hashed chunks, and which donor sends which chunk to a joiner.

A donor's snapshot (messages.STATE_PARTS: phi, delta and the AdamW moments, each a flat fp32 vector
of `numel` values) is cut into chunks of at most `chunk_elements` values that never straddle two
parts; its manifest (messages.StateManifest) lists every chunk's BLAKE3 hash (cryptographic, like
sha256, and about three times as fast on one core here: the joiner hashes every byte it receives).

Replicas of a stage do not hold the same state: NoLoCo's groups are smaller than the stage, and
even where one group spans the stage (so phi and delta agree after the outer step) the AdamW
moments are local to each replica. So a joiner adopts exactly one donor's snapshot, the *target*:
the first live donor in its own preference order, which is what it would have downloaded from a
single donor. Any other donor whose manifest lists the same hash for a chunk holds the same bytes
and can send that chunk; a chunk is accepted only if it hashes to the target's entry. If the
target fails (dies, or sends bytes that do not match its own manifest), the next live donor in the
order becomes the target, and chunks already received that match its manifest are kept.

`ChunkPlan` is that policy, with no I/O: peer/donors.py runs it over the network.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import blake3
import torch

from noloco_swarm.protocol.rpc import STATE_PARTS, StateManifest

MAX_CHUNK_BYTES = 4 << 20
MIN_CHUNK_BYTES = 256 << 10
CHUNKS = 64
"""A state is cut into about this many chunks (within MIN..MAX_CHUNK_BYTES each): enough to spread
over many donors and to re-fetch little when one fails, few enough that a request's round trip
stays small against its transfer."""


@dataclass(frozen=True)
class Chunk:
    """Values [start, stop) of one state part."""

    index: int
    part: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@functools.lru_cache(maxsize=16)
def layout(numel: int, chunk_elements: int) -> tuple[Chunk, ...]:
    """The chunks of a state whose parts hold `numel` values each, in manifest order."""
    if numel < 1 or chunk_elements < 1:
        raise ValueError(f"need numel >= 1 and chunk_elements >= 1, got {numel}, {chunk_elements}")
    starts = range(0, numel, chunk_elements)
    spans = [(part, s, min(s + chunk_elements, numel)) for part in STATE_PARTS for s in starts]
    return tuple(Chunk(i, part, start, stop) for i, (part, start, stop) in enumerate(spans))


STRIKES = 3
"""Failed requests in a row after which a donor that broke a stream or timed out is dropped
(one that sent garbage or refused is dropped at once): a stream can break on a live link."""


def chunk_elements_for(numel: int) -> int:
    """Values per chunk for a state whose parts hold `numel` fp32 values each."""
    total = numel * 4 * len(STATE_PARTS)
    return min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, total // CHUNKS)) // 4


def digest(tensor: torch.Tensor) -> str:
    """BLAKE3 of a contiguous CPU tensor's raw (little-endian) bytes, as 64 hex digits."""
    flat = tensor.reshape(-1)
    if not flat.is_contiguous():
        raise ValueError("hash a contiguous tensor")
    return blake3.blake3(memoryview(flat.view(torch.uint8).numpy())).hexdigest()


def chunk_hashes(parts: Mapping[str, torch.Tensor], chunk_elements: int) -> tuple[str, ...]:
    """The manifest's hash list for a snapshot's parts."""
    numel = parts[STATE_PARTS[0]].numel()
    return tuple(digest(parts[c.part][c.start : c.stop]) for c in layout(numel, chunk_elements))


def same_layout(a: StateManifest, b: StateManifest) -> bool:
    return (a.numel, a.chunk_elements) == (b.numel, b.chunk_elements)


class ChunkPlan:
    """Which chunk each donor sends next, and what a donor's failure changes.

    `preference` orders the donors by whose state the joiner would rather adopt. A donor is asked
    first for pending chunks that the fewest live donors hold (a target's own AdamW moments have
    one holder, so they start at once); once nothing is pending it duplicates a chunk another
    donor is still sending (the end game), so one stalled donor cannot hold up the end.
    """

    def __init__(self, manifests: Mapping[str, StateManifest], preference: Sequence[str]) -> None:
        self.manifests = dict(manifests)
        self.order = [d for d in preference if d in self.manifests]
        if not self.order:
            raise ValueError("no donor to plan for")
        self.live: set[str] = set(self.order)
        self.lost: dict[str, str] = {}  # donor -> why it was dropped
        self.target: str | None = self.order[0]
        self.done: dict[int, str] = {}  # index -> hash of the bytes held for it
        self.fetching: dict[int, set[str]] = {}  # index -> donors asked for it, not yet answered
        self.strikes: dict[str, int] = {}  # donor -> requests failed in a row
        self.retargets = 0

    @property
    def manifest(self) -> StateManifest:
        """The target's manifest: the state being assembled."""
        if self.target is None:
            raise LookupError("every donor was lost")
        return self.manifests[self.target]

    @property
    def finished(self) -> bool:
        return self.target is not None and len(self.done) == len(self.manifest.chunks)

    @property
    def failed(self) -> bool:
        return self.target is None

    def holds(self, donor: str, index: int) -> bool:
        """Whether `donor` is live and holds the target's bytes of chunk `index`."""
        if donor not in self.live or self.target is None:
            return False
        mine, target = self.manifests[donor], self.manifest
        return same_layout(mine, target) and mine.chunks[index] == target.chunks[index]

    def holders(self, index: int) -> list[str]:
        return [d for d in self.order if self.holds(d, index)]

    def take(self, donor: str) -> int | None:
        """The chunk `donor` should send next (now marked as asked of it), or None: nothing for it."""
        if self.target is None or donor not in self.live:
            return None
        mine = [i for i in range(len(self.manifest.chunks)) if i not in self.done and self.holds(donor, i)]
        pending = [i for i in mine if not self.fetching.get(i)]
        if pending:
            index = min(pending, key=lambda i: (len(self.holders(i)), i))
        else:
            endgame = [i for i in mine if donor not in self.fetching.get(i, set())]
            if not endgame:
                return None
            index = min(endgame, key=lambda i: (len(self.fetching[i]), i))
        self.fetching.setdefault(index, set()).add(donor)
        return index

    def accept(self, donor: str, index: int, received: str) -> bool:
        """`donor` sent chunk `index`, hashing to `received`. True: keep these bytes for it.

        Bytes that do not hash to the donor's own manifest entry are its fault: it is dropped.
        Bytes that match its manifest but no longer the target's (the target changed while they
        travelled), or a chunk already held, are discarded without blame.
        """
        self.fetching.get(index, set()).discard(donor)
        if donor not in self.live:
            return False
        mine = self.manifests[donor]
        if not 0 <= index < len(mine.chunks) or received != mine.chunks[index]:
            self.lose(donor, f"chunk {index} does not hash to its manifest's entry")
            return False
        self.strikes[donor] = 0
        if index in self.done or not self.holds(donor, index):
            return False
        self.done[index] = received
        return True

    def fail(self, donor: str, index: int, reason: str, *, fatal: bool) -> bool:
        """A request of `donor` for `index` failed. True if that drops the donor: at once if
        `fatal` (it sent garbage or refused), else after STRIKES failures in a row."""
        self.release(donor, index)
        if donor not in self.live:
            return False
        self.strikes[donor] = self.strikes.get(donor, 0) + 1
        if fatal or self.strikes[donor] >= STRIKES:
            self.lose(donor, reason)
            return True
        return False

    def release(self, donor: str, index: int) -> None:
        """`donor` was asked for `index` but will not send it (e.g. the download was cancelled)."""
        self.fetching.get(index, set()).discard(donor)

    def lose(self, donor: str, reason: str) -> None:
        """Drop `donor` (dead, refused, or sent garbage); if it was the target, adopt the next."""
        if donor not in self.live:
            return
        self.live.discard(donor)
        self.lost[donor] = reason
        for asked in self.fetching.values():
            asked.discard(donor)
        if donor != self.target:
            return
        self.target = next((d for d in self.order if d in self.live), None)
        self.retargets += 1
        if self.target is None:
            self.done.clear()
            return
        target = self.manifest
        old = self.manifests[donor]
        keep = same_layout(old, target)
        self.done = {i: h for i, h in self.done.items() if keep and target.chunks[i] == h}
