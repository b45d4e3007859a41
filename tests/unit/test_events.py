"""Typed events: every kind survives the JSON-lines sink, and `noloco local` reads the records."""

from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path

import pytest
from rich.console import Console

from noloco_swarm.cli.local import _swarm_summary, swarm_status
from noloco_swarm.cli.options import build_config
from noloco_swarm.cli.swarm import LocalSwarm, PeerProcess
from noloco_swarm.cli.view import ReplicaStatus
from noloco_swarm.peer.events import (
    KINDS,
    Carried,
    Checkpointed,
    ChunkFetched,
    DonorLost,
    Dropped,
    Event,
    Events,
    Excluded,
    FalseReport,
    Final,
    Joined,
    Joiners,
    Joining,
    JsonLines,
    Left,
    Membership,
    Outer,
    PeerGone,
    Refused,
    Rejected,
    Rerouted,
    Resumed,
    Retried,
    ServedState,
    SlowPeer,
    Started,
    StateFetch,
    Step,
    StoodIn,
    Unsent,
    ViewMismatch,
    from_dict,
    of_kind,
    read,
    to_dict,
)

VIEW = [["12D3KooWa0", "12D3KooWa1"], ["12D3KooWb0", "12D3KooWb1"]]


def one_of_each() -> list[Event]:
    final = Final(
        stage=1,
        rank=0,
        peer_id="12D3KooWb0",
        joined_round=0,
        steps=6,
        outer_steps=2,
        dropped_partners=1,
        dropped_samples=3,
        gone=["12D3KooWb1"],
        final_view=[["12D3KooWa0", "12D3KooWa1"], ["12D3KooWb0"]],
        train_seconds=12.25,
        tokens=0,
        val_loss=None,
        state_hash="ab" * 32,
        bytes={"12D3KooWb1": {"sent": 4096, "received": 4100, "bad_messages": 0}},
        time=1700000015.0,
    )
    return [
        Step(step=3, loss=5.125, lr=1e-3, seconds=0.25, tokens=192, tokens_per_second=256.0, time=1.5),
        Step(step=4, loss=None, lr=1e-3, seconds=0.25, tokens=0, tokens_per_second=256.0, time=2.5),
        Outer(
            step=3,
            group=[0, 1],
            partners=["12D3KooWa1"],
            failed=[],
            sent_bytes=4096,
            received_bytes=4100,
            seconds=0.5,
            state_hash="cd" * 32,
            time=3.0,
        ),
        Membership(round=1, stages=VIEW, rank=0, peer_id="12D3KooWa0", time=4.0),
        Joining(round=3, step=9, time=5.0),
        Joined(
            round=3,
            step=9,
            server="12D3KooWa1",
            state_hash="ef" * 32,
            peer_id="12D3KooWa2",
            snapshot="ab" * 32,
            sent={"12D3KooWa1": 3, "12D3KooWa0": 1},
            time=6.0,
        ),
        Joiners(round=3, peers=["12D3KooWa2"], snapshot="ab" * 32, time=7.0),
        ServedState(round=3, peer="12D3KooWa2", chunk=5, time=8.0),
        StateFetch(
            round=3, target="12D3KooWa1", donors=["12D3KooWa1", "12D3KooWa0"], snapshot="ab" * 32, time=8.1
        ),
        ChunkFetched(round=3, donor="12D3KooWa1", index=5, part="delta", time=8.2),
        DonorLost(round=3, donor="12D3KooWa0", reason="peer is unreachable", time=8.4),
        Started(peer_id="12D3KooWa2", stage=1, addresses=["/ip4/127.0.0.1/tcp/4100"], time=8.5),
        Excluded(step=9, reason="the view of round 3 leaves this peer out", time=9.0),
        Dropped(step=5, hop=0, samples=2, side="sender", reasons=["peer B: the stream broke"], time=10.0),
        Dropped(step=5, hop=0, samples=2, side="receiver", senders=[1], time=10.5),
        Rerouted(step=6, hop=0, samples=3, around=[1], to=[0], time=10.7),
        StoodIn(step=7, samples=4, replicas=[1], time=10.8),
        Carried(step=8, samples=2, time=10.9),
        Unsent(step=8, peer="12D3KooWb1", at=11, samples=2, time=10.95),
        Unsent(step=9, peer="12D3KooWa1", at=13, call="exchange", time=10.96),
        Refused(step=5, peer="12D3KooWb1", reason="views of round 1 differ", time=11.0),
        Retried(step=5, peer="12D3KooWb1", reason="stream reset", time=12.0),
        Rejected(step=6, peer="12D3KooWb1", reason="distance", ratio=3.2e4, avoid_until=12, time=12.5),
        ViewMismatch(step=5, peer="12D3KooWa1", time=13.0),
        SlowPeer(peer="12D3KooWb1", reason="no gradient within 10 s", time=14.0),
        PeerGone(peer="12D3KooWb1", round=2, reason="does not answer a probe", time=14.5),
        FalseReport(reporter="12D3KooWc2", peer="12D3KooWb1", round=2, ignored_until=23, time=14.6),
        Left(step=12, announced_round=2, time=14.6),
        Checkpointed(step=12, round=4, path="/ckpt/step-000000012.pt", time=14.7),
        Resumed(step=12, round=4, state_hash="ab" * 32, time=14.8),
        final,
    ]


def test_every_kind_round_trips_through_json_lines(tmp_path: Path) -> None:
    records = one_of_each()
    assert {type(e) for e in records} == set(KINDS.values()), "a kind has no example here"
    sink = JsonLines(tmp_path / "m.jsonl")
    for e in records:
        sink.emit(e)
    sink.close()
    assert read(tmp_path / "m.jsonl") == records  # time included
    first = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])
    assert first == {
        "event": "step",
        "time": 1.5,
        "step": 3,
        "loss": 5.125,
        "lr": 1e-3,
        "seconds": 0.25,
        "tokens": 192,
        "tokens_per_second": 256.0,
    }
    assert all(from_dict(to_dict(e)) == e for e in records)


def test_read_skips_a_torn_last_line_and_unknown_kinds(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    a, b = one_of_each()[:2]
    sink = JsonLines(path)
    sink.emit(a)
    sink.close()
    with path.open("a") as f:
        f.write(json.dumps({"event": "from_a_newer_peer", "time": 2.0, "x": 1}) + "\n")
    sink = JsonLines(path)
    sink.emit(b)
    sink.close()
    with path.open("a") as f:
        f.write(json.dumps(to_dict(a))[:25])  # a writer caught mid-line
    assert read(path) == [a, b]
    assert read(tmp_path / "not-written-yet.jsonl") == []


@pytest.mark.parametrize(
    "obj",
    [
        {"event": "outer", "time": 1.0, "step": 3},  # fields missing
        {"time": 1.0, "step": 3, "round": 0},  # no kind
        {"event": "no_such_kind", "time": 1.0},
        {"event": ["step"], "time": 1.0},
        [1, 2, 3],  # a JSON line that is not an object
    ],
)
def test_from_dict_rejects_a_malformed_record(obj: object) -> None:
    with pytest.raises(ValueError):
        from_dict(obj)  # type: ignore[arg-type]


def test_a_line_that_is_not_an_object_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    good = one_of_each()[0]
    path.write_text("[1, 2]\n42\n" + json.dumps(to_dict(good)) + "\n")
    assert read(path) == [good]


class ListSink:
    def __init__(self) -> None:
        self.got: list[Event] = []
        self.closed = False

    def emit(self, event: Event) -> None:
        self.got.append(event)

    def close(self) -> None:
        self.closed = True


def test_events_stamp_the_time_and_fan_out_to_every_sink(tmp_path: Path) -> None:
    first, second = ListSink(), ListSink()
    events = Events([first, second, JsonLines(tmp_path / "m.jsonl")])
    record = Joining(round=2, step=6)
    before = time.time()
    events.emit(record)
    after = time.time()
    events.close()
    assert record.time == 0.0, "the record handed in is not changed"
    [stamped] = first.got
    assert before <= stamped.time <= after
    assert stamped == Joining(round=2, step=6, time=stamped.time)
    assert second.got == [stamped] and read(tmp_path / "m.jsonl") == [stamped]
    assert first.closed and second.closed
    assert of_kind([stamped, *one_of_each()], Joining) == [stamped, one_of_each()[4]]


# ---------------------------------------------------------------------------------------------
# `noloco local` reads a fake 2x2 swarm's event files

B, T, H = 2, 32, 2
HASH = {(s, d): f"{s}{d}" * 32 for s in range(2) for d in range(2)}
LAST_STAGE_LOSS = {0: [5.0, 4.0, 3.0, 2.0], 1: [6.0, 5.0, None, 3.0]}  # replica 1 got no rows at step 3
VAL_LOSS = {(0, 0): 2.0, (0, 1): 2.4}
# Stage 1's replicas swap ranks in round 1 (the view is re-sorted): the view shows the latest rank.
RANKS = {(0, 0): [0, 0], (0, 1): [1, 1], (1, 0): [0, 1], (1, 1): [1, 0]}


def peer_events(s: int, d: int, steps: range) -> list[Event]:
    """What peer (stage s, replica d) reports for `steps` of a 2x2 NoLoCo run with H = 2."""
    out: list[Event] = []
    for step in steps:
        if step % H == 1:  # a round starts
            rank = RANKS[s, d][step // H]
            out.append(Membership(round=step // H, stages=VIEW, rank=rank, peer_id=VIEW[s][d]))
        loss = LAST_STAGE_LOSS[d][step - 1] if s == 1 else None
        tokens = step * B * T if s == 0 else 0
        out.append(
            Step(step=step, loss=loss, lr=1e-3 * step, seconds=0.5, tokens=tokens, tokens_per_second=128.0)
        )
        if step % H == 0:
            partner = VIEW[s][1 - d]
            sent = (s + 1) * 2**20  # MiB: 1 from stage 0, 2 from stage 1
            out.append(
                Outer(
                    step=step,
                    group=[0, 1],
                    partners=[partner],
                    failed=[],
                    sent_bytes=sent,
                    received_bytes=sent + 2**19,
                    seconds=0.1,
                    state_hash=f"{step}" * 64,
                )
            )
    return out


def final(s: int, d: int) -> Final:
    return Final(
        stage=s,
        rank=RANKS[s, d][-1],
        peer_id=VIEW[s][d],
        joined_round=0,
        steps=4,
        outer_steps=2,
        dropped_partners=0,
        dropped_samples=0,
        gone=[],
        final_view=VIEW,
        train_seconds=3.2 if (s, d) == (0, 1) else 2.0,
        tokens=4 * B * T if s == 0 else 0,
        val_loss=VAL_LOSS.get((s, d)),
        state_hash=HASH[s, d],
        bytes={},
    )


def write(path: Path, records: list[Event]) -> None:
    sink = JsonLines(path)
    for e in records:
        sink.emit(e)
    sink.close()


def test_swarm_status_and_summary_from_a_fake_2x2_swarms_event_files(tmp_path: Path) -> None:
    cfg = build_config(
        "tiny",
        "noloco",
        assignments={"num_stages": "2", "num_replicas": "2", "outer.inner_steps": str(H)},
        env={},
    )
    # PeerProcess.proc is not used to read events: no process is started here.
    peers = [
        PeerProcess(s, d, None, tmp_path / f"peer-{s}-{d}.jsonl", tmp_path / f"peer-{s}-{d}.log")  # type: ignore[arg-type]
        for s in range(2)
        for d in range(2)
    ]
    swarm = LocalSwarm(cfg, 4, "run-x", tmp_path, peers=peers)

    def status(elapsed: float):
        events = {(p.stage, p.replica): p.events() for p in swarm.peers}
        return swarm_status(cfg, swarm.steps, events, elapsed=elapsed, note="fake")

    # Mid-run: everyone has done 3 steps and one outer step; stage 0 replica 1 is mid-line on step 4.
    for p in peers:
        write(p.metrics, peer_events(p.stage, p.replica, range(1, 4)))
    written = peers[1].metrics.read_text()
    with peers[1].metrics.open("a") as f:
        f.write('{"event": "step", "time": 17')
    mid = status(elapsed=2.0)
    assert (mid.step, mid.total_steps, mid.outer_steps) == (3, 4, 1)
    assert mid.loss_history == (5.5, 4.5, 3.0)  # step 3: replica 1's loss did not come back
    assert mid.train_loss == pytest.approx(13.0 / 3)
    assert mid.val_ppl is None
    assert mid.tokens == 2 * 3 * B * T and mid.tokens_per_second == mid.tokens / 2.0
    assert mid.lr == pytest.approx(3e-3) and mid.note == "fake" and mid.method == "noloco"
    assert mid.title == "local swarm 2 stages x 2 replicas, tiny preset"
    assert mid.replicas == (
        ReplicaStatus(0, 0, "1", ""),
        ReplicaStatus(0, 1, "0", ""),
        ReplicaStatus(1, 0, "1", ""),
        ReplicaStatus(1, 1, "0", ""),
    )

    # The end: step 4 (with the second outer step) and every peer's final summary.
    peers[1].metrics.write_text(written)  # its writer finishes the line below
    for p in peers:
        write(p.metrics, [*peer_events(p.stage, p.replica, range(4, 5)), final(p.stage, p.replica)])
    end = status(elapsed=8.0)
    assert (end.step, end.outer_steps) == (4, 2)
    assert end.loss_history == (5.5, 4.5, 3.0, 2.5) and end.train_loss == pytest.approx(3.875)
    assert end.val_ppl == pytest.approx(math.exp(2.2))
    assert end.tokens == 2 * 4 * B * T and end.lr == pytest.approx(4e-3)
    # Stage 1's replicas swapped ranks in round 1: rank 0 is now the peer started as replica 1.
    assert end.replicas == (
        ReplicaStatus(0, 0, "1", HASH[0, 0]),
        ReplicaStatus(0, 1, "0", HASH[0, 1]),
        ReplicaStatus(1, 0, "1", HASH[1, 1]),
        ReplicaStatus(1, 1, "0", HASH[1, 0]),
    )
    assert status(elapsed=8.0) == end, "the snapshot is a pure function of the events"

    summaries = swarm.summaries()
    assert sorted((f.stage, f.rank, f.state_hash) for f in summaries) == [
        (0, 0, HASH[0, 0]),
        (0, 1, HASH[0, 1]),
        (1, 0, HASH[1, 1]),
        (1, 1, HASH[1, 0]),
    ]
    console = Console(width=120, color_system=None, record=True, file=io.StringIO())
    console.print(_swarm_summary(end, summaries, [e for p in peers for e in p.events()], False))
    out = console.export_text()
    for expected in (
        "train loss (first 20 steps)",
        "3.875",
        "validation loss (each replica's own path)",
        "2.200",
        f"{math.exp(2.2):.1f}",
        "1.50 MiB sent, 2.00 MiB received",
    ):
        assert expected in out, (expected, out)
    cells = [[c.strip() for c in line.strip().strip("│").split("│")] for line in out.splitlines()]
    rows = {c[0]: c[1] for c in cells if len(c) == 2}
    assert rows["tokens/s (training)"] == "160"  # stage 0's tokens over the slowest peer's time
    assert rows["outer steps"] == "2"
    assert rows["stage 1 replica 0 state"] == HASH[1, 1][:16]
    assert out.index("stage 0 replica 0") < out.index("stage 1 replica 1")
