"""`noloco join`'s live panel: the volunteer's own peer, kept from the typed events it emits.

`PeerPanel` is an event sink like `JsonLines` or `Prometheus` (peer/events.py): the peer emits the
same records to all of them, and this one keeps a `PeerSnapshot` and redraws it on the terminal.
`render_peer` is a pure function of the snapshot (tested by rendering to a fixed-width console).
It is shown only on a terminal, with `--log-format text` and without `--quiet`: a service's logs
get one JSON object per line instead (`--log-format json`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from noloco_swarm.cli.view import short_id, sparkline
from noloco_swarm.peer import events
from noloco_swarm.peer.net.node import reachability_kind
from noloco_swarm.train.config import RunConfig

ByteCounts = Callable[[], dict[str, dict[str, int]]]  # Transport.byte_counts
HISTORY = 60  # losses kept for the sparkline


@dataclass(frozen=True)
class PeerSnapshot:
    """Everything the panel shows at one instant."""

    run_id: str
    method: str
    stage: int | None  # None: --stage auto, not chosen yet
    total_steps: int
    inner_steps: int  # H: inner steps per outer step
    phase: str = "starting"  # starting, joining, training, leaving, done
    peer_id: str = ""
    rank: int | None = None
    round: int | None = None
    step: int = 0
    outer_steps: int = 0
    loss: float | None = None
    losses: tuple[float, ...] = ()
    tokens_per_second: float = 0.0  # tokens through this stage
    partners: tuple[str, ...] = ()  # of the last outer step
    exchange_seconds: float | None = None
    sent_bytes: int = 0
    received_bytes: int = 0
    reachable: str = "-"
    swarm: tuple[int, ...] = ()  # replicas per stage in the current round
    dropped: int = 0  # samples dropped (sent or expected) over the run
    problems: int = 0  # refusals, rejected tensors, failed exchange partners
    elapsed: float = 0.0


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def render_peer(s: PeerSnapshot) -> RenderableType:
    """The panel for one snapshot. Pure: the same snapshot always renders the same."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    stage = "auto" if s.stage is None else str(s.stage)
    rank = "-" if s.rank is None else str(s.rank)
    grid.add_row("peer", Text(f"{short_id(s.peer_id)}  run {s.run_id}  [{s.method}]  {s.phase}"))
    grid.add_row("place", f"stage {stage}, replica {rank}, round {'-' if s.round is None else s.round}")
    grid.add_row(
        "step",
        f"{s.step}/{s.total_steps}  outer steps {s.outer_steps}  (next outer step in "
        f"{s.inner_steps - s.step % s.inner_steps if s.step < s.total_steps else 0})",
    )
    into = s.step % s.inner_steps if s.step < s.total_steps else s.inner_steps
    grid.add_row("to outer", ProgressBar(total=s.inner_steps, completed=into, width=30))
    loss = "-" if s.loss is None else f"{s.loss:.3f}"
    grid.add_row("loss", f"{loss}   {sparkline(s.losses)}")
    grid.add_row("speed", f"{s.tokens_per_second:,.0f} tok/s through this stage")
    exchange = "" if s.exchange_seconds is None else f"  (last exchange {s.exchange_seconds:.1f} s)"
    partners = ", ".join(short_id(p) for p in s.partners) or "-"
    grid.add_row("partner", Text(partners + exchange))
    grid.add_row("bytes", f"sent {_bytes(s.sent_bytes)}, received {_bytes(s.received_bytes)}")
    grid.add_row("reachable", Text(s.reachable))
    swarm = " + ".join(str(n) for n in s.swarm) if s.swarm else "-"
    grid.add_row("swarm", f"{sum(s.swarm)} peers ({swarm} per stage)" if s.swarm else "-")
    trouble = f"{s.dropped} samples dropped, {s.problems} refusals or failed partners"
    grid.add_row("trouble", Text(trouble, style="yellow" if s.dropped or s.problems else ""))
    grid.add_row("elapsed", f"{s.elapsed:.0f} s")
    return Group(grid)


def fold(s: PeerSnapshot, event: events.Event, tokens_per_step: int) -> PeerSnapshot:
    """The snapshot after one event (pure)."""
    match event:
        case events.Started(peer_id=peer_id, stage=stage, addresses=addresses):
            return replace(s, peer_id=peer_id, stage=stage, reachable=reachability_kind(addresses))
        case events.Joining(round=r):
            return replace(s, phase="joining", round=r)
        case events.Joined(round=r):
            return replace(s, phase="training", round=r)
        case events.Membership(round=r, stages=stages, rank=rank):
            phase = "training" if s.phase in ("starting", "joining") else s.phase
            return replace(s, round=r, rank=rank, swarm=tuple(len(x) for x in stages), phase=phase)
        case events.Step(step=step, loss=loss, seconds=seconds):
            losses = s.losses if loss is None else (*s.losses, loss)[-HISTORY:]
            speed = tokens_per_step / seconds if seconds > 0 else s.tokens_per_second
            last = loss if loss is not None else s.loss
            return replace(s, step=step, loss=last, losses=losses, tokens_per_second=speed)
        case events.Outer(partners=partners, failed=failed, seconds=seconds):
            return replace(
                s,
                outer_steps=s.outer_steps + 1,
                partners=tuple(partners),
                exchange_seconds=seconds,
                problems=s.problems + len(failed),
            )
        case events.Dropped(samples=samples):
            return replace(s, dropped=s.dropped + samples)
        case events.Refused() | events.Rejected():
            return replace(s, problems=s.problems + 1)
        case events.Left():
            return replace(s, phase="leaving")
        case events.Final(steps=steps, outer_steps=outer_steps):
            return replace(s, phase="done", step=steps, outer_steps=outer_steps)
    return s


class PeerPanel:
    """An event sink that shows the peer's own panel on `console` (a terminal), redrawn on every
    event and four times a second. `attach` gives it the transport's byte counters."""

    def __init__(self, cfg: RunConfig, steps: int, console: Console) -> None:
        self.snapshot = PeerSnapshot(
            run_id=cfg.peer.run_id,
            method=cfg.outer.method,
            stage=cfg.peer.stage,
            total_steps=steps,
            inner_steps=cfg.outer.inner_steps,
        )
        self._tokens_per_step = cfg.inner.batch_size * cfg.model.seq_len
        self._bytes: ByteCounts | None = None
        self._started = time.monotonic()
        self._live = Live(render_peer(self.snapshot), console=console, refresh_per_second=4)
        self._live.start()

    def attach(self, byte_counts: ByteCounts) -> PeerPanel:
        self._bytes = byte_counts
        return self

    def emit(self, event: events.Event) -> None:
        s = fold(self.snapshot, event, self._tokens_per_step)
        if self._bytes is not None:
            counts = self._bytes().values()
            s = replace(
                s,
                sent_bytes=sum(c.get("sent_total", 0) for c in counts),
                received_bytes=sum(c.get("received_total", 0) for c in counts),
            )
        self.snapshot = replace(s, elapsed=time.monotonic() - self._started)
        self._live.update(render_peer(self.snapshot))

    def close(self) -> None:
        self._live.update(render_peer(self.snapshot))
        self._live.stop()
