"""Chunked state transfer: the layout, the manifest, and which donor sends what when donors fail."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from noloco_swarm.protocol import chunks as c
from noloco_swarm.protocol import codec, rpc
from noloco_swarm.protocol.chunks import ChunkPlan

VIEW = (("a", "b", "j"), ("c",))
NUMEL, CHUNK = 10, 4  # three chunks per part: 4 + 4 + 2 values


def state(seed: int, shared: tuple[str, ...] = ("phi", "delta")) -> dict[str, torch.Tensor]:
    """A replica's parts: `shared` parts equal for every seed, the others the seed's own."""
    own = torch.Generator().manual_seed(seed)
    return {
        p: torch.arange(NUMEL, dtype=torch.float32) + i if p in shared else torch.randn(NUMEL, generator=own)
        for i, p in enumerate(rpc.STATE_PARTS)
    }


def manifest(parts: dict[str, torch.Tensor], chunk: int = CHUNK, step: int = 6) -> rpc.StateManifest:
    return rpc.StateManifest("run", 0, 2, step, VIEW, 6, "e" * 64, NUMEL, chunk, c.chunk_hashes(parts, chunk))


@given(st.integers(1, 300), st.integers(1, 64))
def test_layout_covers_every_part_once_without_straddling(numel: int, chunk: int) -> None:
    spans = c.layout(numel, chunk)
    assert [s.index for s in spans] == list(range(len(spans)))
    for part in rpc.STATE_PARTS:
        mine = [s for s in spans if s.part == part]
        assert mine[0].start == 0 and mine[-1].stop == numel
        assert all(a.stop == b.start for a, b in itertools.pairwise(mine))
        assert all(0 < s.numel <= chunk for s in mine)
    assert len(spans) == len(rpc.STATE_PARTS) * -(-numel // chunk)


def test_manifest_names_the_content_and_checks_its_layout() -> None:
    a, b = manifest(state(1)), manifest(state(2))
    assert len(a.chunks) == 12 and codec.decode(codec.encode(a)) == a
    assert a.chunks[:6] == b.chunks[:6] and a.chunks[6:] != b.chunks[6:]  # phi, delta shared
    assert a.snapshot == manifest(state(1)).snapshot != b.snapshot
    assert a.snapshot != manifest(state(1), step=9).snapshot  # counters are part of the state
    with pytest.raises(ValueError, match="chunk hashes"):
        rpc.StateManifest("run", 0, 2, 6, VIEW, 6, "e" * 64, NUMEL, CHUNK, a.chunks[:-1])
    with pytest.raises(ValueError, match="sha256"):
        rpc.StateManifest("run", 0, 2, 6, VIEW, 6, "e" * 64, NUMEL, CHUNK, ("E" * 64,) * 12)


def drain(plan: ChunkPlan, donor: str, parts: dict[str, torch.Tensor]) -> list[int]:
    """Let `donor` send everything it is asked for, honestly; the chunks it sent."""
    sent = []
    while (index := plan.take(donor)) is not None:
        span = c.layout(NUMEL, CHUNK)[index]
        assert plan.accept(donor, index, c.digest(parts[span.part][span.start : span.stop]))
        sent.append(index)
    return sent


def test_shared_chunks_come_from_every_holder_and_own_ones_from_the_target() -> None:
    a, b = state(1), state(2)
    plan = ChunkPlan({"a": manifest(a), "b": manifest(b)}, ["a", "b"])
    assert plan.target == "a" and plan.holders(0) == ["a", "b"] and plan.holders(6) == ["a"]
    first = [plan.take("a"), plan.take("a")]
    assert first == [6, 7], "the target's own chunks (one holder) go first"
    assert plan.take("b") == 0 and plan.take("b") == 1
    assert all(plan.take("b") not in range(6, 12) for _ in range(4))  # b never sends a's moments


def test_the_whole_plan_ends_with_the_targets_bytes() -> None:
    parts = {"a": state(1), "b": state(2), "c": state(3, shared=("phi",))}
    plan = ChunkPlan({d: manifest(p) for d, p in parts.items()}, ["b", "a", "c"])
    got = {d: [] for d in parts}
    while not plan.finished:
        for d in parts:
            if (index := plan.take(d)) is not None:
                span = c.layout(NUMEL, CHUNK)[index]
                assert plan.accept(d, index, c.digest(parts[d][span.part][span.start : span.stop]))
                got[d].append(index)
    assert sorted(plan.done) == list(range(12)) and plan.done == dict(enumerate(manifest(parts["b"]).chunks))
    assert set(got["c"]) <= {0, 1, 2} and set(got["a"]) <= set(range(6)) and got["a"] and got["c"]


def test_a_forged_chunk_drops_its_donor_and_is_asked_of_another() -> None:
    a, b = state(1), state(2)
    plan = ChunkPlan({"a": manifest(a), "b": manifest(b)}, ["a", "b"])
    assert plan.take("b") == 0
    assert not plan.accept("b", 0, c.digest(torch.zeros(CHUNK)))  # not what b's manifest says
    assert "b" not in plan.live and "hash" in plan.lost["b"] and 0 not in plan.done
    assert plan.target == "a" and plan.take("b") is None
    assert sorted(drain(plan, "a", a)) == list(range(12)) and plan.finished


def test_losing_the_target_adopts_the_next_donor_and_keeps_the_bytes_it_shares() -> None:
    a, b = state(1), state(2)
    plan = ChunkPlan({"a": manifest(a), "b": manifest(b)}, ["a", "b"])
    for _ in range(8):  # a sends its moments and phi; b sends nothing yet
        index = plan.take("a")
        assert index is not None
        span = c.layout(NUMEL, CHUNK)[index]
        plan.accept("a", index, c.digest(a[span.part][span.start : span.stop]))
    asked = plan.take("a")
    plan.lose("a", "stream broke")
    assert plan.target == "b" and plan.retargets == 1 and asked not in plan.done
    kept = set(plan.done)
    assert kept <= set(range(6)) and kept, "a's moments are not b's; its phi and delta are"
    sent = drain(plan, "b", b)
    assert kept.isdisjoint(sent) and plan.finished
    assert plan.done == dict(enumerate(manifest(b).chunks))


def test_a_chunk_that_was_the_old_targets_is_discarded_without_blame() -> None:
    a, b = state(1), state(2)
    plan = ChunkPlan({"a": manifest(a), "b": manifest(b), "x": manifest(a)}, ["a", "b", "x"])
    index = plan.take("x")
    assert index == 6 and plan.holders(6) == ["a", "x"]
    plan.lose("a", "died")
    assert plan.target == "b"
    span = c.layout(NUMEL, CHUNK)[index]
    assert not plan.accept("x", index, c.digest(a[span.part][span.start : span.stop]))
    assert "x" in plan.live and index not in plan.done


def test_end_game_duplicates_a_slow_donors_chunk_and_everyone_lost_fails() -> None:
    a = state(1)
    plan = ChunkPlan({"a": manifest(a), "b": manifest(a)}, ["a", "b"])
    taken = [plan.take("a") for _ in range(12)]
    assert sorted(taken) == list(range(12))  # type: ignore[type-var]
    again = plan.take("b")
    assert again is not None and plan.fetching[again] == {"a", "b"}
    plan.lose("a", "died")
    plan.lose("b", "died")
    assert plan.failed and not plan.finished and plan.take("b") is None
    with pytest.raises(LookupError):
        _ = plan.manifest


def test_a_donor_with_another_layout_sends_nothing() -> None:
    a = state(1)
    plan = ChunkPlan({"a": manifest(a), "b": manifest(a, chunk=5)}, ["a", "b"])
    assert plan.take("b") is None and plan.holders(0) == ["a"]


def test_chunk_size_aims_at_64_chunks_within_bounds() -> None:
    assert c.chunk_elements_for(1 << 20) * 4 == 256 << 10  # a 16 MiB state: 64 chunks
    assert c.chunk_elements_for(16 << 20) * 4 == 4 << 20  # 256 MiB: 64 chunks
    assert c.chunk_elements_for(1 << 28) * 4 == 4 << 20  # 4 GiB: 1024 chunks of the largest size
    assert c.chunk_elements_for(1000) * 4 == 256 << 10  # tiny: one chunk per part


def test_a_broken_stream_is_retried_before_its_donor_is_dropped() -> None:
    a = state(1)
    plan = ChunkPlan({"a": manifest(a), "b": manifest(a)}, ["a", "b"])
    for attempt in range(c.STRIKES - 1):
        index = plan.take("a")
        assert index is not None and not plan.fail("a", index, "stream broke", fatal=False)
        assert "a" in plan.live and index not in plan.fetching.get(index, set())
        if attempt == 0:  # a success in between starts the count again
            ok = plan.take("a")
            span = c.layout(NUMEL, CHUNK)[ok]
            assert plan.accept("a", ok, c.digest(a[span.part][span.start : span.stop]))
    index = plan.take("a")
    assert not plan.fail("a", index, "stream broke", fatal=False) and "a" in plan.live
    assert plan.fail("a", plan.take("a"), "stream broke", fatal=False) and plan.target == "b"
    assert plan.fail("b", plan.take("b"), "refused", fatal=True) and plan.failed
