"""`noloco join` without a run id: the open runs on the DHT, and with `--auto` the run and stage that
need a peer most among those this machine can host (the memory check of `noloco doctor`).

The chosen run's config is its manifest's (peer/catalog.py gives it as values); this machine's own
settings (device, network, deadlines) stay the volunteer's. `choose` is pure: it takes the catalog
and a fit check, and says why it took one run and passed over each other one.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace

from rich.console import Console

from noloco_swarm.cli.doctor_local import Check, memory_check
from noloco_swarm.cli.flags import resolve_args
from noloco_swarm.cli.runs import Unreachable, fetch_catalog, render_runs
from noloco_swarm.peer.catalog import Catalog, RunSummary
from noloco_swarm.train.layering import ConfigError, Layer, Resolved


@dataclass(frozen=True)
class Choice:
    """The run and stage to join (None: no open run fits), and one line per run on why."""

    run: RunSummary | None
    stage: int
    reasons: tuple[str, ...]


def choose(catalog: Catalog, fits: Callable[[RunSummary, int], Check]) -> Choice:
    """Among the open runs whose neediest stage fits this machine, the one whose stage lacks the
    most peers (then has the fewest, then the lowest run id). Closed runs need a ticket: passed over."""
    reasons, fitting = [], []
    for run in catalog.runs:
        stage = run.neediest_stage()
        if run.closed:
            reasons.append(f"{run.run_id}: passed over: closed (a join ticket from its organiser is needed)")
            continue
        check = fits(run, stage)
        if not check.ok:
            reasons.append(f"{run.run_id}: passed over: stage {stage} does not fit: {check.detail}")
            continue
        fitting.append((run, stage, check))
    if not fitting:
        return Choice(None, 0, tuple(reasons) or ("no runs listed on this DHT",))
    run, stage, check = min(fitting, key=lambda f: (-f[0].need(f[1]), f[0].peers[f[1]], f[0].run_id))
    why = (
        f"{run.run_id}: chosen: stage {stage} has {run.peers[stage]} of the {run.wanted[stage]} peers it asks "
        f"for, the most needed stage of the {len(fitting)} open run(s) this machine can host ({check.detail})"
    )
    others = [
        f"{r.run_id}: passed over: its stage {s} has {r.peers[s]} of {r.wanted[s]}"
        for r, s, _ in fitting
        if r is not run
    ]
    return Choice(run, stage, (why, *others, *reasons))


def run_config(
    args: argparse.Namespace, defaults: dict[str, object], run: RunSummary, stage: int
) -> Resolved:
    """The config a peer of `run` on `stage` runs: the volunteer's settings, under the run's manifest
    (every run key) and the run id and stage."""
    top = [
        Layer(f"run {run.run_id}'s manifest", run.config, explicit=False),
        Layer("--auto", {"peer.run_id": run.run_id, "peer.stage": stage}),
    ]
    return resolve_args(args, defaults, top=top)


def join_target(args: argparse.Namespace, resolved: Resolved, defaults: dict[str, object]) -> Resolved | int:
    """For `noloco join` without a run id: list the open runs (exit status 2: nothing chosen), or
    with --auto the config of the run and stage to join, saying why."""
    console = Console(stderr=True)
    net = resolved.cfg.network
    if not net.initial_peers:
        raise ConfigError(
            "noloco join needs a run id: give --run-id NAME, or --initial-peers to list the runs"
        )
    if args.stage is not None and args.stage != "auto" and args.auto:
        raise ConfigError("noloco join --auto chooses the stage itself: drop --stage")
    try:
        catalog = fetch_catalog(net)
    except Unreachable as e:
        console.print(f"noloco join: {e}", highlight=False, soft_wrap=True)
        return 1
    if not args.auto:
        opened = replace(catalog, runs=tuple(r for r in catalog.runs if not r.closed))
        closed = len(catalog.runs) - len(opened.runs)
        if opened.runs:
            console.print(render_runs(opened), highlight=False, soft_wrap=True)
        if closed:
            console.print(
                f"({closed} closed run(s) not shown: they need a join ticket; `noloco runs` lists them)"
            )
        console.print(
            "noloco join: give --run-id RUN to join one of these, or --auto to join the one that needs a peer most"
            if opened.runs
            else "noloco join: no open run on this DHT"
        )
        return 2

    def fits(run: RunSummary, stage: int) -> Check:
        try:
            cfg = run_config(args, defaults, run, stage).cfg
        except ConfigError as e:
            return Check("config", False, f"its config does not resolve here: {e}")
        return memory_check(cfg, stage, None)

    choice = choose(catalog, fits)
    for line in choice.reasons:
        console.print(f"noloco join --auto: {line}", highlight=False, soft_wrap=True)
    if choice.run is None:
        console.print("noloco join --auto: no open run fits this machine; nothing joined")
        return 1
    return run_config(args, defaults, choice.run, choice.stage)
