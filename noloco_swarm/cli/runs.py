"""`noloco runs`: the runs listed on the DHT reached through the initial peers, and what each needs.

It joins the DHT as a client (it stores nothing), reads the list of runs and every listed run's
manifest and announcements (peer/catalog.py), and prints one row per run; `--json` prints the
same as {"runs": [...], "skipped": n} for scripts.
"""

from __future__ import annotations

import json

from rich.console import Console, Group, RenderableType
from rich.text import Text

from noloco_swarm.peer.catalog import Catalog, RunSummary, read_catalog
from noloco_swarm.peer.directory import signed_dht_kwargs
from noloco_swarm.peer.net.lifetime import DHT
from noloco_swarm.train.config import NetworkConfig


def render_runs(catalog: Catalog) -> RenderableType:
    """The list of one read, three lines per run (they fit an 80-column terminal; a longer line
    wraps, nothing is cut). Pure: the same catalog always renders the same."""
    skipped = f"{catalog.skipped} listings skipped: forged or malformed" if catalog.skipped else ""
    if not catalog.runs:
        return Text("no runs listed on this DHT" + (f" ({skipped})" if skipped else ""))
    lines = []
    for run in catalog.runs:
        head = Text(run.run_id, style="bold")
        head.append(f"  [{'closed: a join ticket is needed' if run.closed else 'open'}]")
        if run.description:
            head.append(f"  {run.description}")
        lines.append(head)
        lines.append(
            Text(
                f"  {run.preset} {_count(run.parameters)} parameters, {run.method}, "
                f"{run.stages} stage{'s' if run.stages > 1 else ''}, round {run.round}, "
                f"{_count(run.tokens)} tokens"
            )
        )
        peers = " ".join(f"{have}/{want}" for have, want in zip(run.peers, run.wanted, strict=True))
        lines.append(Text(f"  peers per stage {peers}: {_needs(run)}"))
    lines += [Text(skipped)] if skipped else []
    lines.append(Text("peers per stage: announced/asked for, from stage 0", style="dim"))
    return Group(*lines)


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
    if not short:
        return "every stage has its peers"
    return f"stage{'s' if len(short) > 1 else ''} {', '.join(str(s) for s in short)} short of peers"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
