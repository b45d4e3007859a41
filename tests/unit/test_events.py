"""Typed events: every kind survives the JSON-lines sink (`noloco local` reading them: test_local_view.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from noloco_swarm.peer.events import (
    KINDS,
    Carried,
    Checkpointed,
    ChunkFetched,
    Declined,
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
    JoinPostponed,
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
        dht={"stores": 12, "reads": 8, "bytes_stored": 13392, "bytes_read": 17856},
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
        JoinPostponed(round=3, to=5, download_seconds=80.5, swarm_seconds=40.0, time=5.5),
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
        Declined(step=6, peer="12D3KooWb1", time=12.5),
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
