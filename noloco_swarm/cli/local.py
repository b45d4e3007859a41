"""`noloco local`: a whole swarm on this machine, with a live view and a final summary.

By default it starts a bootstrap DHT node and P x D real peer processes (`noloco join`, each with
its own p2pd on loopback). `--in-process` runs the same swarm inside this process with the
reference simulator instead (same routes, groups and outer steps, no transport).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.live import Live
from rich.table import Table

from noloco_swarm.cli.view import ReplicaStatus, RunStatus, render
from noloco_swarm.harness.local import LocalSwarm, local_swarm, planned_cpus, wait
from noloco_swarm.model.state import num_flat
from noloco_swarm.peer.events import Event, Final, Membership, Outer, Step, of_kind
from noloco_swarm.train.config import RunConfig, format_cpus

if TYPE_CHECKING:  # the launcher of a networked swarm runs no model: it starts without transformers
    from noloco_swarm.sim.engine import Simulator, StepStats


def outer_bytes_per_peer(sim: Simulator, stage: int) -> int:
    """Bytes one replica of `stage` sends per outer step: its fast weights (fp32), plus phi if gamma != beta."""
    tensors = 2 if sim.cfg.outer.sends_phi else 1
    return num_flat(sim.stages[stage][0]) * 4 * tensors


class _Tracker:
    """Turns simulator callbacks into RunStatus snapshots for the view."""

    def __init__(self, cfg: RunConfig, steps: int) -> None:
        self.cfg, self.steps = cfg, steps
        self.run_plan = cfg.run_plan()  # the simulator's own rules: it draws the groups we show
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
                replicas.append(ReplicaStatus(stage=s, replica=d, partner=self.partner(sim, d)))
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

    def partner(self, sim: Simulator, replica: int) -> str:
        """Whom `replica` averaged with at the last outer step, as the plan drew it ("all": DiLoCo)."""
        if not sim.outer_steps:
            return "-"
        last = sim.outer_steps * self.cfg.outer.inner_steps
        plan = self.run_plan.outer_plan(last, replica, self.cfg.num_replicas)
        if plan is None:
            return "-"
        if plan.update != "noloco":
            return "all"
        return ",".join(map(str, plan.partners)) or "(alone)"

    def on_eval(self, sim: Simulator, row: dict[str, float]) -> None:
        self.val_ppl, self.spread = row["val_ppl"], row["weight_spread"]


def run_local(cfg: RunConfig, steps: int, *, plain: bool = False) -> int:
    from noloco_swarm.sim.run import run_simulation

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


# ---------------------------------------------------------------------------------------------
# The real swarm: peer processes on loopback


def swarm_status(
    cfg: RunConfig,
    total_steps: int,
    peers: Mapping[tuple[int, int], Sequence[Event]],
    *,
    elapsed: float,
    note: str = "",
) -> RunStatus:
    """A view snapshot from the events each peer, keyed by (stage, replica), reported so far.

    Pure: the same events, elapsed time and note always give the same snapshot. The training loss
    is the last stage's (the only one that computes it), averaged over its replicas per step; a
    step whose loss did not come back (`Step.loss` None) leaves that replica out of the average.
    """
    steps = {key: of_kind(ev, Step) for key, ev in peers.items()}
    first = [e for (s, _), ev in steps.items() if s == 0 for e in ev]
    last_stage = sorted(
        (e for (s, _), ev in steps.items() if s == cfg.num_stages - 1 for e in ev), key=lambda e: e.step
    )
    by_step: dict[int, list[float]] = {}
    for e in last_stage:
        if e.loss is not None:
            by_step.setdefault(e.step, []).append(e.loss)
    history = tuple(sum(v) / len(v) for _, v in sorted(by_step.items()))
    done = min((max((e.step for e in ev), default=0) for ev in steps.values()), default=0)
    outer = min((len(of_kind(ev, Outer)) for ev in peers.values()), default=0)
    tokens = sum(max((e.tokens for e in ev), default=0) for (s, _), ev in steps.items() if s == 0)
    replicas = []
    for (s, d), ev in sorted(peers.items(), key=lambda item: item[0]):
        outers = of_kind(ev, Outer)
        finals = of_kind(ev, Final)
        ranks = [m.rank for m in of_kind(ev, Membership)]  # the view changes per round
        rank = ranks[-1] if ranks else d
        partner, spread = "-", None
        if outers:
            partner = ",".join(str(m) for m in outers[-1].group if m != rank) or "(alone)"
            spread = outers[-1].spread
        replicas.append(ReplicaStatus(s, rank, partner, finals[0].state_hash if finals else "", spread))
    replicas.sort(key=lambda r: (r.stage, r.replica))
    spreads = [r.spread for r in replicas if r.spread is not None]
    val = [f.val_loss for ev in peers.values() for f in of_kind(ev, Final) if f.val_loss]
    return RunStatus(
        title=f"local swarm {cfg.num_stages} stages x {cfg.num_replicas} replicas, {cfg.model.name} preset",
        method=cfg.outer.method,
        step=done,
        total_steps=total_steps,
        outer_steps=outer,
        train_loss=sum(history[-10:]) / len(history[-10:]) if history else None,
        val_ppl=math.exp(sum(val) / len(val)) if val else None,  # evaluated at the end
        lr=first[-1].lr if first else 0.0,
        tokens=tokens,
        tokens_per_second=tokens / elapsed if elapsed else 0.0,
        # NoLoCo: each replica's distance to its group's mean at its last outer step, RMS over
        # replicas (with pairs of a 2-replica stage, the simulator's spread to the stage mean)
        weight_spread=math.sqrt(sum(x * x for x in spreads) / len(spreads)) if spreads else None,
        elapsed=elapsed,
        loss_history=history,
        replicas=tuple(replicas),
        note=note,
    )


def run_local_swarm(
    cfg: RunConfig,
    steps: int,
    *,
    plain: bool = False,
    keep: Path | None = None,
    plot: bool = False,
    pin: bool = True,
) -> int:
    # Ctrl-C (SIGINT) must stop the swarm however this process was started: a non-interactive
    # shell's background job, or a harness, hands it SIGINT ignored, and Python then installs no
    # handler of its own, so the signal would be dropped and the run go on.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    console = Console()
    console.print(
        f"[bold]noloco local[/]: starting a bootstrap node and {cfg.num_stages * cfg.num_replicas} peers "
        f"({cfg.num_stages} stages x {cfg.num_replicas} replicas, {cfg.outer.method}, H={cfg.outer.inner_steps}, "
        f"{steps} inner steps, preset {cfg.model.name}, embedded corpus)"
    )
    if cfg.peer.metrics_port:
        last = cfg.peer.metrics_port + cfg.num_stages * cfg.num_replicas - 1
        console.print(
            f"Prometheus metrics at http://{cfg.peer.metrics_host}:{cfg.peer.metrics_port}..{last}/metrics"
        )
    start = time.perf_counter()
    live = None
    status: RunStatus | None = None
    last_print = [0]
    interrupted = False
    pin = pin and hasattr(os, "sched_getaffinity")  # Linux: elsewhere the peers run unpinned
    if pin:
        shares = " ".join(format_cpus(planned_cpus(cfg, i)) for i in range(sum(cfg.replica_counts)))
        console.print(
            f"each peer and its p2pd on its own CPUs, in start order: {shares} (--no-pin: anywhere)",
            soft_wrap=True,
        )
    with local_swarm(cfg, steps, workdir=keep, pin=pin) as swarm:
        console.print(
            f"watch it from another terminal: noloco status --run-id {swarm.run_id} "
            f"--initial-peers {swarm.bootstrap}",
            soft_wrap=True,
        )

        def on_poll(sw: LocalSwarm) -> None:
            nonlocal status
            note = f"{len(sw.peers)} peer processes on loopback; logs and metrics in {sw.workdir}" + (
                "" if keep is not None else " (removed at exit; keep them with --keep DIR)"
            )
            peers = {(p.stage, p.replica): p.events() for p in sw.peers}
            status = swarm_status(sw.cfg, sw.steps, peers, elapsed=time.perf_counter() - start, note=note)
            if live is not None:
                live.update(render(status))
            elif status.step >= last_print[0] + 10 or (status.step == steps and last_print[0] != steps):
                last_print[0] = status.step
                loss = "-" if status.train_loss is None else f"{status.train_loss:.3f}"
                console.print(f"step {status.step:5d}  loss {loss}  {status.tokens_per_second:,.0f} tok/s")

        live = None if plain else Live(console=console, refresh_per_second=4)
        try:
            if live is not None:
                live.start()
            wait(swarm, timeout=max(600.0, steps * 10.0), poll=0.5, on_poll=on_poll)
        except KeyboardInterrupt:
            interrupted = True
        except (RuntimeError, TimeoutError) as e:
            if live is not None:
                live.stop()
                live = None
            console.print(f"[red]the swarm failed:[/] {e}")
            return 1
        finally:
            if live is not None:
                live.stop()
        summaries = swarm.summaries()
        events = [e for p in swarm.peers for e in p.events()]
        charts = {}
        if plot:  # while the peers' event files exist (a temporary workdir goes at the end)
            from noloco_swarm.cli.plot import load, write_charts

            target = keep if keep is not None else Path("runs") / time.strftime("local-%Y%m%d-%H%M%S")
            charts = write_charts(load(swarm.workdir), target / "plots")
    console.print(_swarm_summary(status, summaries, events, interrupted))
    if charts:
        console.print("charts: " + ", ".join(str(p) for p in charts.values()), soft_wrap=True)
    return 130 if interrupted else 0


def _swarm_summary(
    status: RunStatus | None, summaries: Sequence[Final], events: Sequence[Event], interrupted: bool
) -> Table:
    table = Table(title="summary (interrupted)" if interrupted else "summary", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    if status is not None and status.loss_history:
        head, tail = status.loss_history[:20], status.loss_history[-20:]
        table.add_row("train loss (first 20 steps)", f"{sum(head) / len(head):.3f}")
        table.add_row("train loss (last 20 steps)", f"{sum(tail) / len(tail):.3f}")
    val = [s.val_loss for s in summaries if s.val_loss is not None]
    if val:
        mean = sum(val) / len(val)
        table.add_row("validation loss (each replica's own path)", f"{mean:.3f}")
        table.add_row("validation perplexity", f"{math.exp(mean):.1f}")
    if summaries:
        seconds = max(s.train_seconds for s in summaries)
        tokens = sum(s.tokens for s in summaries)
        table.add_row("tokens/s (training)", f"{tokens / seconds:,.0f}" if seconds else "-")
        table.add_row("outer steps", str(min(s.outer_steps for s in summaries)))
    outers = of_kind(events, Outer)
    if outers:
        sent = sum(e.sent_bytes for e in outers) / len(outers)
        recv = sum(e.received_bytes for e in outers) / len(outers)
        table.add_row(
            "bytes per outer step per peer", f"{sent / 2**20:.2f} MiB sent, {recv / 2**20:.2f} MiB received"
        )
    for s in sorted(summaries, key=lambda s: (s.stage, s.rank)):
        table.add_row(f"stage {s.stage} replica {s.rank} state", s.state_hash[:16])
    return table
