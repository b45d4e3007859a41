"""`noloco testbed`: a local swarm with every peer in its own network namespace, with the fault schedule
applied as it runs and one row of results per peer at the end (the swarm itself: harness/namespaces.py)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from noloco_swarm.harness.local import LocalSwarm, wait
from noloco_swarm.harness.namespaces import NamespaceSwarm, host_names, namespace_swarm, peer_host
from noloco_swarm.peer.events import Final, of_kind
from noloco_swarm.testbed import Testbed
from noloco_swarm.testbed.bed import CutMode, TransportKind
from noloco_swarm.testbed.schedule import Shape, Timeline
from noloco_swarm.train.config import RunConfig


def apply_due(bed: Testbed, timeline: Timeline, elapsed: float, mode: CutMode, log: Console | None) -> None:
    """Cut or restore the links whose time has come."""
    for action in timeline.due(elapsed):
        if action.kind == "cut":
            bed.cut(action.host, mode)
        else:
            bed.restore(action.host)
        if log is not None:
            log.print(f"[yellow]{elapsed:6.1f} s[/]: {action.kind} {action.host}")


def results_table(ns: NamespaceSwarm) -> Table:
    """One row per peer: where it ran, how it ended, what it did, what crossed its link."""
    table = Table(title="testbed peers")
    for column in ("host", "address", "exit", "steps", "outer", "dropped", "state", "link MiB in/out"):
        table.add_column(column, justify="right")
    for p in ns.swarm.peers:
        name = peer_host(p.stage or 0, p.replica)  # placed by stage: never None here
        finals = of_kind(p.events(), Final)
        final = finals[-1] if finals else None
        rx, tx = ns.bed.counters(name)
        table.add_row(
            name,
            ns.bed.hosts[name].address,
            str(p.proc.poll()),
            str(final.steps) if final else "-",
            str(final.outer_steps) if final else "-",
            str(final.dropped_samples) if final else "-",
            final.state_hash[:12] if final else "-",
            f"{rx / 2**20:.1f} / {tx / 2**20:.1f}",
        )
    return table


def run_testbed(
    cfg: RunConfig,
    steps: int,
    *,
    shapes: Sequence[Shape] = (),
    cuts: Sequence[str] = (),
    cut_mode: CutMode = "drop",
    delay_ms: float = 0.0,
    delays: Mapping[str, float] | None = None,
    step_timeout: float | None = None,
    keep: Path | None = None,
    threads: int = 1,
    transport: TransportKind = "tcp",
    pin: bool = False,
) -> int:
    """Run the swarm on a testbed, apply the fault schedule, print per-peer results. `pin`: each
    peer and its p2pd on their own share of the CPUs (Linux), as under `noloco local`."""
    console = Console()
    timeline = Timeline.of_cuts(cuts)
    unknown = timeline.hosts() - set(host_names(cfg))
    if unknown:
        console.print(f"[red]noloco testbed:[/] --cut names {sorted(unknown)}; hosts: {host_names(cfg)}")
        return 2
    console.print(
        f"[bold]noloco testbed[/]: {len(host_names(cfg))} namespaces on one bridge "
        f"({cfg.num_stages} stages x {cfg.num_replicas} replicas + bootstrap), {steps} inner steps"
    )
    code = 0
    try:
        with namespace_swarm(
            cfg,
            steps,
            step_timeout=step_timeout,
            delay_ms=delay_ms,
            delays=delays,
            shapes=shapes,
            workdir=keep,
            threads=threads,
            transport=transport,
            pin=pin,  # namespaces are Linux's: so is CPU affinity
        ) as ns:
            start = time.monotonic()

            def on_poll(sw: LocalSwarm) -> None:
                apply_due(ns.bed, timeline, time.monotonic() - start, cut_mode, console)

            try:
                wait(ns.swarm, timeout=max(600.0, steps * 10.0), poll=0.5, on_poll=on_poll)
            except (RuntimeError, TimeoutError) as e:
                console.print(f"[red]the swarm failed:[/] {e}")
                code = 1
            console.print(results_table(ns))
    except KeyboardInterrupt:
        console.print("interrupted: the testbed was torn down")
        return 130
    return code
