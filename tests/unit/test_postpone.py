"""A joiner whose download would outlast the round it announced moves its round further off, and
its donors keep the snapshot it downloads until then (peer/postpone.py, peer/snapshots.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from noloco_swarm.peer import events
from noloco_swarm.peer.postpone import (
    MAX_LEAD_ROUNDS,
    NOTICE_SECONDS,
    DownloadWatch,
    Pace,
    later_round,
)
from noloco_swarm.peer.snapshots import StateServer
from noloco_swarm.protocol import rpc
from noloco_swarm.protocol.membership import Listing, MembershipView

H = 5
SWARM = Pace((0.0, 0), (4.0, 4))  # one step a second: step 15 (round 3) at t = 15 s


def chunks(done: int, seconds: float = 4.0) -> Pace:
    return Pace((0.0, 1), (seconds, done))


def test_a_download_that_ends_in_time_keeps_its_round() -> None:
    # 59 chunks left at 2.25 a second: about 29 s, against the swarm's 40 s to round 9.
    assert (
        later_round(
            target=9, snapshot_round=8, inner_steps=H, chunks=chunks(10), total_chunks=69, steps=SWARM
        )
        is None
    )


def test_a_download_that_ends_late_moves_to_the_first_round_after_it() -> None:
    # 50 chunks left at 2.25 a second: ready at 4 + 22.2 + 10% of 26.2 = 28.8 s; the swarm reaches
    # round 3 at 15 s, and each round takes 5 s more: round 6 (30 s) is the first after.
    later = later_round(
        target=3, snapshot_round=2, inner_steps=H, chunks=chunks(10), total_chunks=60, steps=SWARM
    )
    assert later is not None and later.to == 6
    assert later.download_seconds == pytest.approx(24.8, abs=0.1) and later.swarm_seconds == pytest.approx(
        11.0
    )


def test_never_further_than_the_donors_keep_a_snapshot() -> None:
    later = later_round(
        target=3, snapshot_round=2, inner_steps=H, chunks=chunks(2), total_chunks=10_000, steps=SWARM
    )
    assert later is not None and later.to == 2 + MAX_LEAD_ROUNDS


def test_no_move_the_swarm_would_hear_of_too_late_nor_before_both_paces_are_measured() -> None:
    near = Pace((0.0, 0), (4.0, 13))  # 13 steps in 4 s: step 15 in 0.6 s
    assert NOTICE_SECONDS > 15 / (13 / 4) - 4
    assert (
        later_round(
            target=3, snapshot_round=2, inner_steps=H, chunks=chunks(10), total_chunks=600, steps=near
        )
        is None
    )
    assert (
        later_round(
            target=3, snapshot_round=2, inner_steps=H, chunks=chunks(10, 0.5), total_chunks=600, steps=SWARM
        )
        is None
    )
    still = Pace((0.0, 4), (4.0, 4))  # the swarm did not move (a boundary's outer step)
    assert (
        later_round(
            target=3, snapshot_round=2, inner_steps=H, chunks=chunks(10), total_chunks=600, steps=still
        )
        is None
    )


def test_the_watch_counts_distinct_chunks_and_stops_once_all_are_in() -> None:
    watch = DownloadWatch()
    watch.seen(events.StateFetch(round=3, target="QmA", donors=["QmA"], snapshot="ab", snapshot_round=2))
    for index in (0, 1, 1, 2):  # a chunk fetched again (its donor failed) counts once
        watch.seen(events.ChunkFetched(round=3, donor="QmA", index=index, part="phi", of=4))
    pace = watch.pace()
    assert watch.snapshot_round == 2 and pace is not None and pace.last[1] == 3 and watch.total == 4
    watch.seen(events.ChunkFetched(round=3, donor="QmA", index=3, part="phi", of=4))
    assert watch.pace() is None


# ---------------------------------------------------------------- the donor's side

ME, OTHER, JOINER = "QmDonor", "QmOther", "QmJoiner"
STAGES = 2


def view(round_: int, joiner: bool) -> MembershipView:
    return MembershipView(
        round_, (tuple(sorted((ME, OTHER, JOINER) if joiner else (ME, OTHER))), ("QmNext",))
    )


def server() -> tuple[StateServer, list[events.Event]]:
    said: list[events.Event] = []
    parts = {p: torch.arange(8, dtype=torch.float32) for p in rpc.STATE_PARTS}
    replica = SimpleNamespace(state_parts=lambda: (dict(parts), 3), state_hash=lambda: "ab" * 32)
    cfg = SimpleNamespace(peer=SimpleNamespace(state_serve_rate=0.0), outer=SimpleNamespace(overlap_steps=0))
    ctx = SimpleNamespace(
        cfg=cfg,
        stage=0,
        step=0,
        replica=replica,
        transport=SimpleNamespace(register=lambda *a, **k: None),
        events=SimpleNamespace(emit=said.append),
    )
    return StateServer(ctx, ledger=None), said  # type: ignore[arg-type]


def boundary(srv: StateServer, round_: int, joined_round: int, admitted_from: int) -> None:
    """Our boundary into `round_`, the joiner listed for `joined_round`, in the views from `admitted_from`."""
    listings = [Listing(JOINER, 0, joined_round, entered=False)]
    previous, now = view(round_ - 1, round_ - 1 >= admitted_from), view(round_, round_ >= admitted_from)
    srv.ctx.step = round_ * H
    asyncio.run(srv.keep_for_joiners(previous, now, (listings, [])))


def test_a_donor_keeps_the_snapshot_for_a_joiner_that_moved_its_round_and_takes_no_other() -> None:
    srv, said = server()
    boundary(srv, 2, joined_round=3, admitted_from=3)  # the joiner of round 3: kept at 2's boundary
    kept = srv.snapshots[2]
    assert JOINER in kept.pending
    for round_ in (3, 4, 5):  # it moved to round 6: nothing new is taken, the snapshot stays
        boundary(srv, round_, joined_round=6, admitted_from=6)
        assert list(srv.snapshots) == [2] and srv.snapshots[2] is kept
    boundary(srv, 6, joined_round=6, admitted_from=6)  # admitted: it asks for its view during round 6
    assert list(srv.snapshots) == [2]
    boundary(srv, 7, joined_round=6, admitted_from=6)
    assert srv.snapshots == {}
    assert [(e.round, e.peers) for e in said if isinstance(e, events.Joiners)] == [(3, [JOINER])]


def test_a_donor_drops_a_snapshot_past_the_longest_lead() -> None:
    srv, _ = server()
    boundary(srv, 2, joined_round=3, admitted_from=99)
    far = 2 + MAX_LEAD_ROUNDS + 5
    for round_ in range(3, 2 + MAX_LEAD_ROUNDS + 2):
        boundary(srv, round_, joined_round=far, admitted_from=99)
    assert srv.snapshots == {}
