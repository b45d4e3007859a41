"""Start one peer: its libp2p daemon and DHT node, the run's manifest check, its stage; then run it.

The DHT shares the transport's daemon (one libp2p identity and one p2pd per peer), and that daemon
dies with the peer process however it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from hivemind import DHT

from noloco_swarm.peer.directory import RunDirectory
from noloco_swarm.peer.node import reachability
from noloco_swarm.peer.runtime import Peer, PeerOptions
from noloco_swarm.peer.transport import Transport
from noloco_swarm.protocol import messages
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.train.config import RunConfig

logger = logging.getLogger(__name__)


async def run_peer(cfg: RunConfig, steps: int, *, new_run: bool = False) -> dict[str, Any]:
    """Start this peer's libp2p daemon and DHT node, join the run, train, and shut everything down."""
    # config-cli shim until the peer reads cfg.peer and cfg.network itself: the old arguments.
    net, p = cfg.network, cfg.peer
    metrics = Path(p.metrics) if p.metrics else None
    opts = PeerOptions(
        run_id=p.run_id, stage=p.stage, steps=steps, metrics_path=metrics, step_timeout=p.step_timeout,
        exchange_timeout=p.exchange_timeout, start_timeout=p.start_timeout, join_timeout=p.join_timeout,
        heartbeat_ttl=p.heartbeat_ttl, device=p.device,
    )  # fmt: skip
    transport = await Transport.create(
        host_maddrs=net.host_maddrs,
        initial_peers=net.initial_peers,
        identity_path=net.identity_path,
        announce_maddrs=list(net.announce_maddrs) or None,
        use_relay=net.use_relay,
        use_auto_relay=net.use_auto_relay,
    )
    dht = None
    try:
        # The DHT shares the transport's daemon: one libp2p identity and one p2pd per peer.
        dht = await asyncio.to_thread(
            DHT, initial_peers=list(net.initial_peers), p2p=transport.p2p, start=True
        )
        directory = RunDirectory(dht, opts.run_id, ttl=opts.heartbeat_ttl)
        manifest = messages.RunManifest.create(opts.run_id, cfg.manifest())
        await _join_manifest(directory, manifest, new_run, opts.start_timeout)
        stage = opts.stage
        if stage is None:  # --stage auto: the stage with the fewest live peers, joiners included
            announcements = (await asyncio.to_thread(directory.read_peers)).announcements
            pairs = [(a.peer_id, a.stage) for a in announcements if a.stage < cfg.num_stages]
            stage = MembershipView.from_announcements(0, cfg.num_stages, pairs).least_served_stage()
        if not 0 <= stage < cfg.num_stages:
            raise ValueError(f"--stage {stage} is outside 0..{cfg.num_stages - 1} for this run")
        addresses = tuple(await transport.visible_addresses())
        for line in reachability(addresses):
            logger.warning("reachable as %s", line)  # warning: shown by default, once, at start
        peer = Peer(cfg, opts, transport, directory, stage, addresses)
        try:
            return await peer.run()
        finally:
            peer.metrics.close()
    finally:
        if dht is not None:
            await asyncio.to_thread(dht.shutdown)
        await transport.shutdown()


async def _join_manifest(
    directory: RunDirectory, manifest: messages.RunManifest, new_run: bool, timeout: float
) -> None:
    """Check the run's manifest; a joiner that arrives before the starter waits for it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await asyncio.to_thread(directory.join_manifest, manifest, new_run=new_run)
            return
        except LookupError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
