"""`noloco runs`: the runs listed on the DHT reached through the initial peers, and what each needs.

It joins the DHT as a client (it stores nothing), reads the list of runs and every listed run's
manifest and announcements (peer/catalog.py), and prints one row per run; `--json` prints the
same as {"runs": [...], "skipped": n} for scripts.
"""

from __future__ import annotations

import json

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from noloco_swarm.peer.catalog import Catalog, RunSummary, read_catalog
from noloco_swarm.peer.directory import signed_dht_kwargs
from noloco_swarm.peer.net.lifetime import DHT
from noloco_swarm.train.config import NetworkConfig


def render_runs(catalog: Catalog) -> RenderableType:
    """The table of one read of the list. Pure: the same catalog always renders the same."""
    if not catalog.runs:
        text = "no runs listed on this DHT"
        return Text(
            text + (f" ({catalog.skipped} listings skipped: forged or malformed)" if catalog.skipped else "")
        )
    table = Table(expand=False, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for column in ("run", "model", "method", "peers/stage", "needs", "access", "round", "tokens"):
        table.add_column(column, no_wrap=True)
    notes = []
    for run in catalog.runs:
        table.add_row(
            run.run_id,
            f"{run.preset} {_count(run.parameters)}",
            run.method,
            " ".join(f"{have}/{want}" for have, want in zip(run.peers, run.wanted, strict=True)),
            _needs(run),
            "closed" if run.closed else "open",
            str(run.round),
            _count(run.tokens),
        )
        if run.description:
            notes.append(Text(f"{run.run_id}: {run.description}"))
    tail = [Text(f"{catalog.skipped} listings skipped: forged or malformed")] if catalog.skipped else []
    legend = Text(
        "peers/stage: announced/asked for, stage 0 first; closed: a join ticket is needed", style="dim"
    )
    return Group(table, *notes, *tail, legend)


def catalog_json(catalog: Catalog) -> str:
    return json.dumps({"runs": [r.as_json() for r in catalog.runs], "skipped": catalog.skipped}, indent=1)


class Unreachable(RuntimeError):
    """No initial peer answered: the DHT could not be joined."""


def fetch_catalog(net: NetworkConfig) -> Catalog:
    """One read of the list of runs through `net.initial_peers`, as a client node (it stores nothing)."""
    try:
        # every network.* setting but client_mode: we only read, so our node is a client
        dht = DHT(
            initial_peers=list(net.initial_peers),
            client_mode=True,
            start=True,
            **signed_dht_kwargs(None),
            **net.p2p_kwargs(),
        )
    except Exception as e:  # p2pd and hivemind fail to bootstrap with many kinds of error
        raise Unreachable(f"could not reach the DHT through {list(net.initial_peers)}: {e}") from e
    try:
        return read_catalog(dht)
    finally:
        dht.shutdown()


def run_runs(net: NetworkConfig, *, as_json: bool, console: Console | None = None) -> int:
    """Print the runs the DHT lists; exit 1 when no initial peer answered."""
    console = console or Console()
    try:
        catalog = fetch_catalog(net)
    except Unreachable as e:
        console.print(f"noloco runs: {e}", highlight=False, soft_wrap=True)
        return 1
    if as_json:
        print(catalog_json(catalog))
    else:
        console.print(render_runs(catalog), highlight=False, soft_wrap=True)
    return 0


def _needs(run: RunSummary) -> str:
    short = run.short
    return ", ".join(f"stage {s}" for s in short) if short else "-"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
