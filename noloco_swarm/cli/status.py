"""`noloco status`: a live terminal view of a running swarm, from any machine that can reach it.

It joins the DHT as a client (it stores nothing and hosts no stage), reads the run's manifest,
announcements and gone reports, and asks every announced peer where it is (rpc_status). The
snapshot is plain data; `render_swarm` turns it into the view (a pure function, tested by
rendering to a fixed-width console).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field, replace

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from noloco_swarm.cli.view import short_id
from noloco_swarm.peer.directory import RunDirectory, signed_dht_kwargs
from noloco_swarm.peer.liveness import ask_status
from noloco_swarm.peer.net.lifetime import DHT
from noloco_swarm.peer.net.streams import PeerUnavailable, RemoteRefused, relayed
from noloco_swarm.peer.net.transport import Transport
from noloco_swarm.protocol import codec, records, rpc
from noloco_swarm.train.config import NetworkConfig

STATUS_TIMEOUT = 3.0
MANIFEST_KEYS = (
    "model.name",
    "num_stages",
    "num_replicas",
    "outer.method",
    "outer.inner_steps",
    "inner.total_steps",
)


@dataclass(frozen=True)
class PeerRow:
    """One announced peer as the view shows it (`status` None: it did not answer)."""

    peer_id: str
    stage: int
    joined_round: int
    device: str
    status: rpc.PeerStatus | None = None
    error: str = ""
    relayed: bool = False  # every address it announced goes through a relay (/p2p-circuit)


@dataclass(frozen=True)
class SwarmStatus:
    """What one look at a run found."""

    run_id: str
    manifest: dict[str, str] = field(default_factory=dict)  # a few keys of the run's config
    peers: tuple[PeerRow, ...] = ()
    gone: int = 0  # peers reported gone by members
    malformed: int = 0  # directory records that failed to decode
    found: bool = True  # False: no manifest for this run id


def render_swarm(status: SwarmStatus) -> RenderableType:
    """The view of one snapshot. Pure: the same snapshot always renders the same."""
    if not status.found:
        return Text(f"run {status.run_id!r}: no manifest in the DHT (check --run-id and --initial-peers)")
    m = status.manifest
    answered = [p.status for p in status.peers if p.status is not None]
    steps = [s.step for s in answered]
    losses = [s.loss for s in answered if s.loss is not None and math.isfinite(s.loss)]
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("run", Text(f"{status.run_id}  [{m.get('outer.method', '?')}]"))
    head.add_row(
        "model",
        f"{m.get('model.name', '?')}, {m.get('num_stages', '?')} stages, "
        f"H={m.get('outer.inner_steps', '?')}, {m.get('inner.total_steps', '?')} steps",
    )
    per_stage = {}
    for p in status.peers:
        per_stage[p.stage] = per_stage.get(p.stage, 0) + 1
    replicas = ", ".join(f"stage {s}: {n}" for s, n in sorted(per_stage.items())) or "none"
    head.add_row("peers", f"{len(status.peers)} announced ({replicas}), {len(answered)} answering")
    if steps:
        head.add_row("step", f"{min(steps)}..{max(steps)}")
    head.add_row("loss", f"{sum(losses) / len(losses):.3f} (mean over peers)" if losses else "-")
    head.add_row(
        "gone",
        f"{status.gone} reported" + (f", {status.malformed} malformed records" if status.malformed else ""),
    )
    # No vertical rules and no wrapping: the ten columns fit an 80-column terminal. Why a peer did
    # not answer goes below the table, where it cannot squeeze a column.
    table = Table(expand=False, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for column in ("stage", "rank", "peer", "step", "round", "joined", "outer", "tokens", "loss", "dev"):
        table.add_column(column, no_wrap=True)
    silent = []
    for p in sorted(status.peers, key=lambda p: (p.stage, p.status.rank if p.status else 1 << 30, p.peer_id)):
        s = p.status
        if s is None:
            table.add_row(
                str(p.stage), "-", short_id(p.peer_id), "?", "", str(p.joined_round), "", "", "", p.device
            )
            silent.append(Text(f"{short_id(p.peer_id)}: no answer: {p.error}"[:200]))
            continue
        loss = "-" if s.loss is None else f"{s.loss:.3f}"
        table.add_row(
            str(p.stage), str(s.rank), short_id(p.peer_id), str(s.step), str(s.round), str(p.joined_round),
            str(s.outer_steps), f"{s.tokens:,}", loss, p.device,
        )  # fmt: skip
    relayed = [
        Text(f"{short_id(p.peer_id)}: reachable only through a relay (every announced address is relayed)")
        for p in status.peers
        if p.relayed
    ]
    return Group(head, table, *silent, *relayed)


async def look(transport: Transport, directory: RunDirectory) -> SwarmStatus:
    """One snapshot of the run: manifest, announcements, gone reports, and every peer's answer."""
    manifest = await asyncio.to_thread(directory.fetch_manifest)
    if manifest is None:
        return SwarmStatus(directory.run_id, found=False)
    config = dict(manifest.config)
    readout = await asyncio.to_thread(directory.read_peers)
    announced = {a.peer_id for a in readout.announcements}  # a stranger's reports count for nothing
    gone = await asyncio.to_thread(directory.read_gone, announced)

    async def ask(a: records.PeerAnnouncement) -> PeerRow:
        only_relayed = bool(a.addresses) and all(relayed(address) for address in a.addresses)
        row = PeerRow(a.peer_id, a.stage, a.joined_round, a.device, relayed=only_relayed)
        try:
            await transport.connect(a.peer_id, a.addresses, timeout=STATUS_TIMEOUT)
            status = await ask_status(transport, a.peer_id, directory.run_id, STATUS_TIMEOUT)
        except (PeerUnavailable, RemoteRefused, codec.MessageError) as e:
            return replace(row, error=str(e))
        return replace(row, status=status)

    rows = await asyncio.gather(*(ask(a) for a in readout.announcements))
    return SwarmStatus(
        run_id=directory.run_id,
        manifest={k: config[k].strip("'") for k in MANIFEST_KEYS if k in config},
        peers=tuple(rows),
        gone=len(gone),
        malformed=readout.malformed,
    )


def run_status(
    net: NetworkConfig,
    run_id: str,
    *,
    once: bool,
    interval: float,
    until_announced: int = 0,
    until_answering: int = 0,
    wait: float = 60.0,
    console: Console | None = None,
) -> int:
    """Show the run's status once, or live until Ctrl-C. Exit 1 if the run is not found.

    With `until_announced` = N (or `until_answering` = N), look again every `interval` seconds
    until the run is found with at least N peers announced (that answer our status call), then
    show that snapshot once (exit 0); if `wait` seconds pass first, show the last one (exit 1).
    For scripts that wait for a swarm to form."""
    console = console or Console()

    async def main() -> int:
        # every network.* setting but client_mode: our DHT node below is a client whatever it says
        transport = await Transport.create(initial_peers=net.initial_peers, **net.p2p_kwargs())
        dht = None
        try:
            dht = await asyncio.to_thread(
                DHT,
                initial_peers=list(net.initial_peers),
                p2p=transport.p2p,
                client_mode=True,
                start=True,
                **signed_dht_kwargs(None),  # checks the records' signatures
            )
            directory = RunDirectory(dht, run_id)
            status = await look(transport, directory)
            if until_announced or until_answering:
                deadline = time.monotonic() + wait

                def enough(s: SwarmStatus) -> bool:
                    answering = sum(p.status is not None for p in s.peers)
                    return len(s.peers) >= until_announced and answering >= until_answering

                while not enough(status) and time.monotonic() < deadline:
                    await asyncio.sleep(interval)
                    status = await look(transport, directory)
                console.print(render_swarm(status))
                return 0 if enough(status) else 1
            if once or not status.found:
                console.print(render_swarm(status))
                return 0 if status.found else 1
            with Live(render_swarm(status), console=console, refresh_per_second=1) as live:
                while True:
                    await asyncio.sleep(interval)
                    started = time.monotonic()
                    live.update(render_swarm(await look(transport, directory)))
                    await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
        finally:
            if dht is not None:
                await asyncio.to_thread(dht.shutdown)
            await transport.shutdown()

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return 0
