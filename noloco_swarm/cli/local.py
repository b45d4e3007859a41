"""`noloco local`: a whole swarm on this machine, with a live view and a final summary.

Until the networked peer lands (issue 4) this runs the swarm in one process with the reference
simulator: the same routes, groups and outer steps the peers will use, without the transport.
"""

from __future__ import annotations

import math
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from noloco_swarm.cli.view import ReplicaStatus, RunStatus, render
from noloco_swarm.model.state import num_flat
from noloco_swarm.protocol import gossip
from noloco_swarm.sim.config import RunConfig
from noloco_swarm.sim.engine import Simulator, StepStats
from noloco_swarm.sim.run import run_simulation


def outer_bytes_per_peer(sim: Simulator, stage: int) -> int:
    """Bytes one replica of `stage` sends per outer step: its fast weights (fp32), plus phi if gamma != beta."""
    tensors = 2 if sim.cfg.outer.sends_phi else 1
    return num_flat(sim.stages[stage][0]) * 4 * tensors


class _Tracker:
    """Turns simulator callbacks into RunStatus snapshots for the view."""

    def __init__(self, cfg: RunConfig, steps: int) -> None:
        self.cfg, self.steps = cfg, steps
        self.start = time.perf_counter()
        self.losses: list[float] = []
        self.val_ppl: float | None = None
        self.spread: float | None = None
        self.status = RunStatus(
            title="local", method=cfg.outer.method, step=0, total_steps=steps, outer_steps=0
        )

    def on_step(self, sim: Simulator, stats: StepStats) -> None:
        self.losses.append(stats.loss)
        elapsed = time.perf_counter() - self.start
        D = self.cfg.num_replicas
        replicas = []
        for s in range(self.cfg.num_stages):
            for d in range(D):
                partner = "-"
                if self.cfg.outer.method == "noloco" and sim.outer_steps:
                    last = sim.outer_steps * self.cfg.outer.inner_steps
                    others = gossip.partners_of(D, last, self.cfg.outer.group_size, d)
                    partner = ",".join(map(str, others)) or "(alone)"
                elif self.cfg.outer.method == "diloco" and sim.outer_steps:
                    partner = "all"
                replicas.append(ReplicaStatus(stage=s, replica=d, partner=partner))
        recent = self.losses[-20:]
        self.status = RunStatus(
            title=f"local {self.cfg.num_stages} stages x {D} replicas, {self.cfg.model.name} preset",
            method=self.cfg.outer.method,
            step=stats.step,
            total_steps=self.steps,
            outer_steps=sim.outer_steps,
            train_loss=sum(recent) / len(recent),
            val_ppl=self.val_ppl,
            lr=stats.lr,
            tokens=sim.tokens,
            tokens_per_second=sim.tokens / elapsed if elapsed else 0.0,
            weight_spread=self.spread,
            elapsed=elapsed,
            loss_history=tuple(self.losses),
            replicas=tuple(replicas),
            note="in-process swarm (the same routes, groups and outer steps as the networked peers)",
        )

    def on_eval(self, sim: Simulator, row: dict[str, float]) -> None:
        self.val_ppl, self.spread = row["val_ppl"], row["weight_spread"]


def run_local(cfg: RunConfig, steps: int, *, plain: bool = False) -> int:
    console = Console()
    console.print(
        f"[bold]noloco local[/]: {cfg.num_stages} stages x {cfg.num_replicas} replicas, method {cfg.outer.method}, "
        f"{steps} inner steps, H={cfg.outer.inner_steps}, preset {cfg.model.name} on the embedded corpus"
    )
    tracker = _Tracker(cfg, steps)
    sims: list[Simulator] = []
    interrupted = False

    def on_step(sim: Simulator, stats: StepStats) -> None:
        if not sims:
            sims.append(sim)
        tracker.on_step(sim, stats)
        if plain and (stats.step % 10 == 0 or stats.step == steps):
            s = tracker.status
            console.print(
                f"step {s.step:5d}  loss {s.train_loss:.3f}  lr {s.lr:.2e}  {s.tokens_per_second:,.0f} tok/s"
            )
        elif live is not None:
            live.update(render(tracker.status))

    live = None if plain else Live(render(tracker.status), console=console, refresh_per_second=4)
    try:
        if live is not None:
            live.start()
        result = run_simulation(cfg, steps, on_step=on_step, on_eval=tracker.on_eval)
    except KeyboardInterrupt:
        interrupted = True
        result = None
    finally:
        if live is not None:
            live.update(render(tracker.status))
            live.stop()
    console.print(_summary(tracker, sims[0] if sims else None, result, interrupted))
    return 130 if interrupted else 0


def _summary(tracker: _Tracker, sim: Simulator | None, result, interrupted: bool) -> Table:
    table = Table(title="summary (interrupted)" if interrupted else "summary", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    losses = tracker.losses
    if losses:
        head = losses[: min(20, len(losses))]
        tail = losses[-20:]
        table.add_row("train loss (first 20 steps)", f"{sum(head) / len(head):.3f}")
        table.add_row("train loss (last 20 steps)", f"{sum(tail) / len(tail):.3f}")
    if result is not None and result.evals:
        final = result.final
        table.add_row("validation loss", f"{final['val_loss']:.3f}")
        table.add_row("validation perplexity", f"{final['val_ppl']:.1f}")
        table.add_row("perplexity of the averaged model", f"{final['val_ppl_avg_model']:.1f}")
        table.add_row("weight spread", f"{final['weight_spread']:.2e}")
        table.add_row("tokens/s (training)", f"{result.tokens_per_second:,.0f}")
        table.add_row("state hash", result.state_hash[:16])
    if sim is not None:
        table.add_row("inner steps", str(sim.step))
        table.add_row("outer steps", str(sim.outer_steps))
        if sim.cfg.outer.method in ("noloco", "diloco"):
            for s in range(sim.cfg.num_stages):
                mib = outer_bytes_per_peer(sim, s) / 2**20
                table.add_row(f"bytes per outer step, stage {s} peer", f"{mib:.2f} MiB each way")
    if losses and not math.isfinite(losses[-1]):
        table.add_row("warning", "the loss is not finite: lower inner.lr")
    return table
