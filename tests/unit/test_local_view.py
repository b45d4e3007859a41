"""`noloco local`'s view of a real swarm: the snapshot and the summary it builds from a fake 2x2
swarm's event files (pure: the same events always give the same view)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
from rich.console import Console

from noloco_swarm.cli.local import _swarm_summary, swarm_status
from noloco_swarm.cli.view import ReplicaStatus
from noloco_swarm.harness.local import LocalSwarm, PeerProcess
from noloco_swarm.peer.events import Event, Final, JsonLines, Membership, Outer, Step
from noloco_swarm.train.layering import build_config

VIEW = [["12D3KooWa0", "12D3KooWa1"], ["12D3KooWb0", "12D3KooWb1"]]
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


@pytest.mark.parametrize("method", ["noloco", "diloco", "local"])
def test_the_in_process_view_shows_the_partners_the_plan_draws(method: str) -> None:
    from types import SimpleNamespace

    from noloco_swarm.cli.local import _Tracker
    from noloco_swarm.protocol import gossip

    cfg = build_config("tiny", method, assignments={"num_replicas": "6"}, env={})
    tracker = _Tracker(cfg, steps=10)
    assert [tracker.partner(SimpleNamespace(outer_steps=0), d) for d in range(6)] == ["-"] * 6
    shown = [tracker.partner(SimpleNamespace(outer_steps=2), d) for d in range(6)]
    step = 2 * cfg.outer.inner_steps
    if method == "noloco":
        drawn = [gossip.partners_of(6, step, cfg.outer.group_size, d, cfg.group_draw_seed) for d in range(6)]
        assert shown == [",".join(map(str, others)) for others in drawn]
    else:
        assert shown == ["all" if method == "diloco" else "-"] * 6
