"""`noloco join`'s live panel: the snapshot folded from the peer's own events, and its rendering."""

from __future__ import annotations

import io

from rich.console import Console

from noloco_swarm.cli.panel import PeerPanel, PeerSnapshot, fold, render_peer
from noloco_swarm.peer import events
from noloco_swarm.peer.net.node import reachability_kind
from noloco_swarm.train.layering import build_config

ME, PARTNER = (
    "12D3KooWme000000000000000000000000000000000abcdefgh",
    "12D3KooWpartner00000000000000000000000000012345678",
)


def text(snapshot: PeerSnapshot) -> str:
    console = Console(width=110, color_system=None, record=True, file=io.StringIO())
    console.print(render_peer(snapshot))
    return console.export_text()


def trained() -> PeerSnapshot:
    s = PeerSnapshot(run_id="run-7", method="noloco", stage=None, total_steps=40, inner_steps=10)
    stream: list[events.Event] = [
        events.Started(peer_id=ME, stage=1, addresses=["/ip4/10.0.0.2/tcp/4100", "/ip4/127.0.0.1/tcp/4100"]),
        events.Membership(round=0, stages=[["a", "b", "c"], [ME, "d", "e"]], rank=0, peer_id=ME),
        *(
            events.Step(step=k, loss=9.0 - k * 0.1, lr=1e-3, seconds=0.5, tokens=0, tokens_per_second=0.0)
            for k in range(1, 14)
        ),
        events.Outer(
            step=10,
            group=[0, 2],
            partners=[PARTNER],
            failed=[],
            sent_bytes=10,
            received_bytes=10,
            seconds=1.25,
            state_hash="x",
        ),
        events.Dropped(step=12, hop=0, samples=3, side="receiver", senders=[1]),
        events.Refused(step=12, peer="d", reason="late"),
    ]
    for event in stream:
        s = fold(s, event, tokens_per_step=4 * 32)
    return s


def test_the_snapshot_follows_the_peer_s_events() -> None:
    s = trained()
    assert (s.peer_id, s.stage, s.rank, s.round, s.phase) == (ME, 1, 0, 0, "training")
    assert s.step == 13 and s.outer_steps == 1 and s.partners == (PARTNER,)
    assert s.loss is not None and abs(s.loss - 7.7) < 1e-9 and len(s.losses) == 13
    assert s.tokens_per_second == 4 * 32 / 0.5
    assert s.swarm == (3, 3) and s.dropped == 3 and s.problems == 1
    assert s.reachable.startswith("direct (2 addresses")
    s = fold(s, events.Step(step=14, loss=None, lr=1e-3, seconds=0.5, tokens=0, tokens_per_second=0.0), 128)
    assert s.loss is not None and len(s.losses) == 13  # a step whose loss did not come back keeps the last


def test_the_panel_shows_place_progress_partner_and_trouble() -> None:
    out = text(trained())
    assert out == text(trained())  # pure
    for expected in (
        "…abcdefgh",
        "run-7",
        "[noloco]",
        "stage 1, replica 0, round 0",
        "13/40",
        "next outer step in 7",
        "7.700",
        "256 tok/s",
        "…12345678",
        "last exchange 1.2 s",
        "6 peers (3 + 3 per stage)",
        "3 samples dropped, 1 refusals",
    ):
        assert expected in out, expected


def test_reachability_in_one_line() -> None:
    assert reachability_kind([]).startswith("not reachable")
    assert reachability_kind(["/ip4/127.0.0.1/tcp/1"]).startswith("loopback only")
    relayed = "/ip4/1.2.3.4/tcp/1/p2p/QmRelay/p2p-circuit"
    assert reachability_kind([relayed]).startswith("through a relay only")
    assert reachability_kind(["/ip4/1.2.3.4/tcp/1", relayed]) == "direct (1 addresses, relays too)"


def test_the_panel_sink_draws_on_a_terminal_and_counts_bytes() -> None:
    out = io.StringIO()
    console = Console(width=110, color_system=None, file=out, force_terminal=True)
    cfg = build_config("tiny", "noloco", env={})
    panel = PeerPanel(cfg, 30, console).attach(
        lambda: {"a": {"sent_total": 3 * 2**20, "received_total": 512}}
    )
    panel.emit(events.Started(peer_id=ME, stage=0, addresses=["/ip4/127.0.0.1/tcp/1"]))
    panel.close()
    assert panel.snapshot.sent_bytes == 3 * 2**20 and panel.snapshot.received_bytes == 512
    assert "sent 3.0 MiB, received 512 B" in out.getvalue()
