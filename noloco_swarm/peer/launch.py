"""Start one peer: its libp2p daemon and DHT node, the run's manifest check, its stage; then run it.

The DHT shares the transport's daemon (one libp2p identity and one p2pd per peer), and that daemon
dies with the peer process however it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from noloco_swarm.peer import checkpoint, events, tickets
from noloco_swarm.peer.directory import RunDirectory
from noloco_swarm.peer.liveness import ask_status_at
from noloco_swarm.peer.neighbourhood import find, stage_counts
from noloco_swarm.peer.net import identity
from noloco_swarm.peer.net.limits import caps_for
from noloco_swarm.peer.net.node import LoopDHT, reachability
from noloco_swarm.peer.net.streams import PeerUnavailable, RemoteRefused
from noloco_swarm.peer.net.transport import Transport
from noloco_swarm.peer.runtime import Peer
from noloco_swarm.protocol import codec, records
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.train.config import RunConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")


def run_on_loop(main: Coroutine[Any, Any, T], kind: str) -> T:
    """Run `main` to the end on a fresh event loop of `kind` (peer.event_loop: uvloop or asyncio)."""
    if kind == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    else:
        factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


async def run_peer(
    cfg: RunConfig,
    steps: int,
    *,
    new_run: bool = False,
    resume: bool = False,
    leave: asyncio.Event | None = None,
    watch: Callable[[Transport], events.Sink] | None = None,
) -> events.Final:
    """Start this peer's libp2p daemon and DHT node, join the run, train `steps` inner steps,
    and shut everything down. Settings come from `cfg.peer` and `cfg.network`. With `resume`,
    continue from the newest checkpoint in `cfg.peer.checkpoint_dir` (see peer/resume.py). When
    `leave` is set, the peer leaves the swarm at a boundary (`Peer.leave`), or stops at once if
    it does not train yet. `watch`, if given, makes one more event sink once the transport runs
    (`noloco join`'s live panel, which reads its byte counters)."""
    opts, net = cfg.peer, cfg.network
    if not opts.run_id:
        raise ValueError("a peer needs a run id: --run-id or peer.run_id")
    if resume and not opts.checkpoint_dir:
        raise ValueError("--resume needs the checkpoint directory the peer wrote: --checkpoint-dir")
    with identity.identity_file(net.identity_path) as (key_path, fresh):
        me = identity.load(key_path)  # also signs our DHT records: read before the daemon starts
        transport = await Transport.create(
            host_maddrs=net.host_maddrs,
            initial_peers=net.initial_peers,
            identity_path=key_path,
            check_if_identity_free=not fresh,
            announce_maddrs=list(net.announce_maddrs) or None,
            use_relay=net.use_relay,
            use_auto_relay=net.use_auto_relay,
            config=caps_for(cfg.inner.microbatches),
            startup_timeout=opts.daemon_start_timeout,
        )
    dht = None
    sink = events.Events([events.JsonLines(opts.metrics)] if opts.metrics else [])
    try:
        if opts.metrics_port is not None:
            sink.sinks.append(_prometheus(cfg, transport))
        if watch is not None:
            sink.sinks.append(watch(transport))
        # The DHT node runs on this loop and shares the transport's daemon: one process, one
        # libp2p identity and one p2pd per peer (node.py: LoopDHT).
        dht = await LoopDHT.create(transport.p2p, net.initial_peers, me)
        directory = RunDirectory(dht, opts.run_id, ttl=opts.heartbeat_ttl, identity=me)
        manifest = records.RunManifest.create(opts.run_id, cfg.manifest())
        await _join_manifest(directory, manifest, new_run, opts.start_timeout)
        ticket = own_ticket(cfg, transport.peer_id) if cfg.authority else b""
        stage = opts.stage
        ckpt = None
        if resume:
            ckpt = await asyncio.to_thread(
                checkpoint.load, Path(opts.checkpoint_dir), opts.run_id, manifest.config_hash, stage
            )
            if ckpt is None:
                logger.warning("no usable checkpoint in %s: joining without one", opts.checkpoint_dir)
            else:
                stage = ckpt.stage
        if stage is None:  # --stage auto: the stage furthest below its share, joiners included
            stage = await _least_served_stage(transport, directory, cfg)
        if not 0 <= stage < cfg.num_stages:
            raise ValueError(f"--stage {stage} is outside 0..{cfg.num_stages - 1} for this run")
        addresses = tuple(await transport.visible_addresses())
        for line in reachability(addresses):
            logger.warning("reachable as %s", line)  # warning: shown by default, once, at start
        sink.emit(events.Started(peer_id=transport.peer_id, stage=stage, addresses=list(addresses)))
        peer = Peer(
            cfg,
            steps,
            transport,
            directory,
            stage,
            sink,
            addresses,
            config_hash=manifest.config_hash,
            ticket=ticket,
        )
        if leave is None:
            return await peer.run(ckpt)
        return await _run_until_left(peer, ckpt, leave)
    finally:
        sink.close()
        if dht is not None:
            await dht.shutdown()
        await transport.shutdown()


def own_ticket(cfg: RunConfig, peer_id: str) -> bytes:
    """This peer's join ticket for a closed run, checked (encoded, for its announcement); a
    ValueError that says what to do if it has none or it would not admit us."""
    run_id, path = cfg.peer.run_id, cfg.peer.ticket
    if not path:
        raise ValueError(
            f"run {run_id!r} is closed (its config names an authority): ask its organiser for a join "
            f"ticket for your peer id {peer_id} and pass it with --set peer.ticket=FILE (keep the "
            "--identity it was issued for)"
        )
    try:
        ticket = tickets.read(path)
        tickets.check(ticket, cfg.authority, run_id, peer_id, time.time())
    except tickets.TicketError as e:
        raise ValueError(f"{path}: {e}; ask the run's organiser for a new ticket") from e
    return codec.encode(ticket)


def _prometheus(cfg: RunConfig, transport: Transport) -> events.Sink:
    """The metrics endpoint (peer/metrics.py); a port in use fails the start, saying which."""
    from noloco_swarm.peer.metrics import Prometheus

    opts = cfg.peer
    assert opts.metrics_port is not None
    try:
        sink = Prometheus(
            opts.metrics_port,
            opts.metrics_host,
            linger=opts.metrics_linger,
            run_id=opts.run_id,
            bytes_source=transport.byte_counts,
        )
    except OSError as e:
        raise OSError(
            f"cannot serve metrics at {opts.metrics_host}:{opts.metrics_port} ({e.strerror}): "
            "choose another --metrics-port, or stop what uses it"
        ) from e
    logger.warning("metrics at http://%s:%d/metrics", opts.metrics_host, sink.port)
    return sink


async def _run_until_left(
    peer: Peer, ckpt: checkpoint.Checkpoint | None, leave: asyncio.Event
) -> events.Final:
    """Run `peer`; when `leave` is set, leave gracefully, or stop at once if it does not train yet."""
    running = asyncio.ensure_future(peer.run(ckpt))
    asked = asyncio.ensure_future(leave.wait())
    try:
        await asyncio.wait({running, asked}, return_when=asyncio.FIRST_COMPLETED)
        if not running.done() and not await peer.leave():
            running.cancel()
        return await running
    finally:
        for task in (running, asked):
            task.cancel()
        await asyncio.gather(running, asked, return_exceptions=True)


async def _join_manifest(
    directory: RunDirectory, manifest: records.RunManifest, new_run: bool, timeout: float
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


async def _least_served_stage(transport: Transport, directory: RunDirectory, cfg: RunConfig) -> int:
    """The stage furthest below its share of replicas, counting the announced peers that answer
    and that no member reported gone since they joined: a dead peer's announcement outlives it
    by up to a heartbeat ttl, and must not hold its stage's place. Or, when a member answers
    (peer/neighbourhood.py), its view's members and the joiners it holds: no directory read."""
    found = await find(transport, directory, cfg, 0, own_stage=False)
    if found is not None:
        view = MembershipView.from_announcements(found.view.round, cfg.num_stages, stage_counts(found))
        return view.least_served_stage(cfg.replica_counts)
    announcements = (await asyncio.to_thread(directory.read_peers)).announcements
    gone = await asyncio.to_thread(directory.read_gone, {a.peer_id for a in announcements})
    candidates = [
        a
        for a in announcements
        if a.stage < cfg.num_stages and not any(r >= a.joined_round for r in gone.get(a.peer_id, ()))
    ]

    async def answers(a: records.PeerAnnouncement) -> bool:
        try:
            await ask_status_at(transport, a.peer_id, a.addresses, directory.run_id)
        except RemoteRefused:
            return True  # it refused: it runs
        except (PeerUnavailable, codec.MessageError):
            return False
        return True

    async with asyncio.TaskGroup() as group:
        probes = [group.create_task(answers(a)) for a in candidates]
    pairs = [(a.peer_id, a.stage) for a, probe in zip(candidates, probes, strict=True) if probe.result()]
    return MembershipView.from_announcements(0, cfg.num_stages, pairs).least_served_stage(cfg.replica_counts)
