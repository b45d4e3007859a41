"""`noloco dht`: a bootstrap node that other peers join through; prints its --initial-peers address."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

from rich.console import Console

from noloco_swarm.peer.net.dialback import offer_on_dht
from noloco_swarm.peer.net.node import reachability, start_dht
from noloco_swarm.train.config import NetworkConfig


def run_dht(
    net: NetworkConfig,
    *,
    refresh: float = 30.0,
    stop: threading.Event | None = None,
    address_file: Path | None = None,
    swarm_file: Path | None = None,
    run: str | None = None,
) -> int:
    """Run until SIGINT/SIGTERM (or `stop` is set), printing how to join and, periodically, the node's state."""
    console = Console()
    if net.identity_path:
        Path(net.identity_path).expanduser().parent.mkdir(parents=True, exist_ok=True)
    dht = start_dht(net)
    offer_on_dht(dht)  # noloco doctor asks bootstraps whether they can reach it
    stop = stop or threading.Event()
    try:
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread (tests): rely on `stop`
        previous = {}
    try:
        addrs = [str(a) for a in dht.get_visible_maddrs()]
        if address_file is not None and addrs:
            # for scripted peers (docker-compose): written whole, then renamed, so never read half-done
            tmp = address_file.with_suffix(".tmp")
            tmp.write_text(addrs[0] + "\n")
            tmp.replace(address_file)
        if swarm_file is not None:
            swarm_file.write_text(swarm_file_text(addrs, run))
        console.print(f"[bold]noloco dht[/]: bootstrap node {dht.peer_id} is up.")
        console.print("Other peers join with:")
        console.print(
            f"  --initial-peers {addrs[0] if addrs else '<no address>'}", highlight=False, soft_wrap=True
        )
        console.print("Reachable as:")
        for line in reachability(addrs):
            console.print(f"  {line}", highlight=False, soft_wrap=True)
        if net.identity_path:
            console.print(f"Identity kept in {net.identity_path} (the peer id survives restarts).")
        if swarm_file is not None:
            console.print(
                f"Swarm file for volunteers (--initial-peers {swarm_file}) written to {swarm_file}."
            )
        while not stop.wait(refresh):
            console.print(f"[dim]{len(dht.get_visible_maddrs())} visible addresses; still serving[/]")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        dht.shutdown()
    return 0


def swarm_file_text(addresses: list[str], run: str | None) -> str:
    """A swarm file (train/layering.py, SwarmFile) of these addresses, loopback ones last (they
    reach this node only from its own machine), naming `run` if given."""
    ordered = sorted(addresses, key=lambda a: "/127.0.0.1/" in a or "/::1/" in a)
    lines = [
        "# noloco swarm file: give it as --initial-peers FILE (noloco join, runs, status, doctor)",
        "initial_peers = [" + ", ".join(json.dumps(a) for a in ordered) + "]",
    ]
    if run:
        lines.append(f"run = {json.dumps(run)}")
    return "\n".join(lines) + "\n"
