"""The live terminal view: a pure function of a status snapshot, rendered with rich."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text


@dataclass(frozen=True)
class ReplicaStatus:
    """One stage replica as the view shows it."""

    stage: int
    replica: int
    partner: str = "-"  # outer-step partners of the last outer step
    state_hash: str = ""
    spread: float | None = None  # RMS distance to its group's mean before the last outer step


@dataclass(frozen=True)
class RunStatus:
    """Everything the view shows at one instant; produced by whoever runs the swarm."""

    title: str
    method: str
    step: int
    total_steps: int
    outer_steps: int
    train_loss: float | None = None
    val_ppl: float | None = None
    lr: float = 0.0
    tokens: int = 0
    tokens_per_second: float = 0.0
    weight_spread: float | None = None
    elapsed: float = 0.0
    loss_history: tuple[float, ...] = ()
    replicas: tuple[ReplicaStatus, ...] = field(default_factory=tuple)
    note: str = ""


def short_id(peer_id: str) -> str:
    """A peer id as the views show it: its last 8 characters."""
    return f"…{peer_id[-8:]}" if peer_id else "-"


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: tuple[float, ...], width: int = 40) -> str:
    """A one-line chart of the last `width` values (higher = taller)."""
    values = values[-width:]
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - low) / span * len(SPARK)))] for v in values)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(status: RunStatus) -> RenderableType:
    """The whole live view for a snapshot. Pure: the same snapshot always renders the same."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("run", Text(f"{status.title}  [{status.method}]"))  # Text: no markup parsing of [..]
    done = status.step / status.total_steps if status.total_steps else 0.0
    head.add_row(
        "step", f"{status.step}/{status.total_steps}  outer steps {status.outer_steps}  ({done:.0%})"
    )
    head.add_row("loss", f"{_fmt(status.train_loss, '.3f')}   {sparkline(status.loss_history)}")
    head.add_row("val ppl", _fmt(status.val_ppl, ".1f"))
    head.add_row("lr", f"{status.lr:.2e}")
    head.add_row("tokens", f"{status.tokens:,}  ({status.tokens_per_second:,.0f} tok/s)")
    head.add_row("spread", _fmt(status.weight_spread, ".2e"))
    head.add_row("elapsed", f"{status.elapsed:.0f} s")
    head.add_row("progress", ProgressBar(total=max(1, status.total_steps), completed=status.step, width=50))
    parts: list[RenderableType] = [head]
    if status.replicas:
        table = Table(title="replicas", title_justify="left", expand=False)
        for column in ("stage", "replica", "last partners", "spread to them", "state hash"):
            table.add_column(column)
        for r in status.replicas:
            table.add_row(str(r.stage), str(r.replica), r.partner, _fmt(r.spread, ".2e"), r.state_hash[:12])
        parts.append(table)
    if status.note:
        parts.append(Text(status.note, style="dim"))
    return Group(*parts)
