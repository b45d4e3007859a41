"""A local swarm with every peer, and the bootstrap node, in its own network namespace (`noloco testbed`).

The hosts share one bridge (`noloco_swarm.testbed`): `boot` runs `noloco dht`, host `s{stage}r{i}`
runs replica i of that stage. Peers listen on their host's address only, so every byte between two
peers crosses both their links, which can be shaped (`--shape s1r0=10mbit`), cut for a while
(`--cut s1r0@30+20`: at 30 s after the peers started, for 20 s) and delayed (`--delay-ms` for every
peer, `--delay s1r1=40` for one, by a user-space relay in the root namespace that each delayed peer
announces instead of its own address). A shape and a delay per host make a link profile, such as
one volunteer behind a slower, longer link than the others.
Everything is torn down at exit, Ctrl-C included.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from noloco_swarm.harness.local import LocalSwarm, Placement, local_swarm
from noloco_swarm.harness.preload import command
from noloco_swarm.testbed import DelayRelay, Route, Testbed
from noloco_swarm.testbed.bed import TransportKind
from noloco_swarm.testbed.schedule import Shape, check_delays
from noloco_swarm.train.config import RunConfig

BOOT = "boot"
PEER_PORT = 31337  # each peer is alone in its namespace, so one fixed port fits all (the relays need it)


def peer_host(stage: int, replica: int) -> str:
    return f"s{stage}r{replica}"


def host_names(cfg: RunConfig, spares: Mapping[int, int] | None = None) -> list[str]:
    """The testbed's hosts for `cfg`: the bootstrap node, then one per replica of every stage, and
    `spares[stage]` more of a stage for peers started later (`LocalSwarm.start_peer(stage)`)."""
    extra = spares or {}
    return [BOOT] + [
        peer_host(s, d) for s, count in enumerate(cfg.replica_counts) for d in range(count + extra.get(s, 0))
    ]


@dataclass
class NamespaceSwarm:
    """A running testbed swarm: the bed, the swarm and, per peer host, the delay relay's port."""

    bed: Testbed
    swarm: LocalSwarm
    bootstrap: str
    relay_ports: dict[str, int] = field(default_factory=dict)
    relay: DelayRelay | None = None
    relayed: list[str] = field(default_factory=list)  # the hosts of the relay's routes, in order

    def host_of(self, stage: int, replica: int) -> str:
        return peer_host(stage, replica)

    def set_delay(self, host: str, delay_ms: float) -> None:
        """From now on, delay `host`'s relayed connections by `delay_ms` each way (a spike, or its
        end). Only a host that started with a delay has a relay to change."""
        if self.relay is None or host not in self.relayed:
            raise ValueError(f"host {host!r} has no delay relay; give it a delay at the start")
        self.relay.set_delay(self.relayed.index(host), delay_ms / 1000, delay_ms / 1000)


def _start_bootstrap(bed: Testbed, workdir: Path, timeout: float = 60.0) -> str:
    """`noloco dht` on host `boot`; returns its --initial-peers address."""
    address_file, log = workdir / "boot.addr", workdir / "boot.log"
    argv = command(["dht", "--identity", str(workdir / "boot.key")])
    argv += ["--host-maddrs", bed.hosts[BOOT].maddr(), "--address-file", str(address_file)]
    with log.open("wb") as out:
        proc = bed.popen(BOOT, argv, stdout=out, stderr=out)
    deadline = time.monotonic() + timeout
    while not address_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(
                f"the bootstrap node in namespace {bed.hosts[BOOT].netns} did not start:\n{tail}"
            )
        time.sleep(0.2)
    return address_file.read_text().strip()


@contextmanager
def namespace_swarm(
    cfg: RunConfig,
    steps: int,
    *,
    step_timeout: float | None = None,
    delay_ms: float = 0.0,
    delays: Mapping[str, float] | None = None,
    shapes: Sequence[Shape] = (),
    workdir: Path | None = None,
    threads: int = 1,
    transport: TransportKind = "tcp",
    pin: bool = False,
    spares: Mapping[int, int] | None = None,
) -> Iterator[NamespaceSwarm]:
    """Build the testbed, start the bootstrap and the peers in it; yields while they run; always
    ends every process and removes every namespace, link and relay it made. `pin`: each peer and
    its p2pd run on their own share of this machine's CPUs, as under `noloco local`.

    A link profile is `shapes` (a rate per host) and the one-way delays: `delay_ms` for every
    peer's host, or per host in `delays` (a host it does not name gets `delay_ms`), so one peer
    can sit behind a slower, longer link than the others. `transport`: what the peers listen on
    (TCP, or QUIC; the delay relay carries TCP only, so QUIC takes no delay). `spares`: hosts
    made ready for that many peers per stage started later (each with the delay of its host)."""
    check_delays(transport, delay_ms, delays)
    with ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="noloco-testbed-")))
        bed = stack.enter_context(Testbed(host_names(cfg, spares)))
        for shape in shapes:
            if shape.host not in bed.hosts:
                raise ValueError(f"--shape names host {shape.host!r}; the hosts are {', '.join(bed.hosts)}")
            bed.shape(shape.host, shape.rate_mbit, burst_kbit=shape.burst_kbit, latency_ms=shape.queue_ms)
        peers = [name for name in bed.hosts if name != BOOT]
        unknown = set(delays or {}) - set(peers)
        if unknown:
            raise ValueError(
                f"--delay names hosts {sorted(unknown)}; the peers' hosts are {', '.join(peers)}"
            )
        one_way = {h: (delays or {}).get(h, delay_ms) / 1000 for h in peers}
        delayed = [h for h in peers if one_way[h] > 0]
        ports: dict[str, int] = {}
        relay = None
        if delayed:
            routes = [
                Route(bed.gateway, 0, bed.hosts[h].address, PEER_PORT, one_way[h], one_way[h])
                for h in delayed
            ]
            relay = stack.enter_context(DelayRelay(routes))
            ports = dict(zip(delayed, relay.ports, strict=True))

        def place(stage: int | None, replica: int) -> Placement:
            if stage is None:
                raise ValueError("the testbed places peers by stage: --stage auto is not supported")
            name = peer_host(stage, replica)
            host = bed.hosts[name]
            announce = (f"/ip4/{bed.gateway}/tcp/{ports[name]}",) if name in ports else ()
            port = PEER_PORT if name in ports else 0
            return Placement(tuple(bed.argv(name, [])), (host.maddr(port, transport),), announce, host.netns)

        bootstrap = _start_bootstrap(bed, workdir)
        swarm = stack.enter_context(
            local_swarm(
                cfg,
                steps,
                workdir=workdir,
                step_timeout=step_timeout,
                threads=threads,
                initial_peers=(bootstrap,),
                place=place,
                host_maddrs=(f"/ip4/{bed.gateway}/tcp/0",),
                pin=pin,
            )
        )
        yield NamespaceSwarm(bed, swarm, bootstrap, ports, relay, delayed)
