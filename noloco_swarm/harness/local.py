"""A whole swarm on this machine: a bootstrap DHT node and P x D `noloco join` peer processes.

Used by `noloco local`, the benches and the integration tests. Every peer runs in its own process group
(its p2pd inside it) and with a parent-death signal, so however this process ends, no peer or
daemon outlives it: on exit each group gets SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from noloco_swarm.harness.preload import Forked, command, fork_peer
from noloco_swarm.peer import tickets
from noloco_swarm.peer.directory import RunDirectory
from noloco_swarm.peer.events import Event, Final, of_kind, read
from noloco_swarm.peer.net import identity
from noloco_swarm.peer.net.lifetime import allocator_env, sweep_sockets
from noloco_swarm.peer.net.node import start_dht
from noloco_swarm.protocol.records import RunManifest
from noloco_swarm.train.config import NetworkConfig, RunConfig, format_cpus

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


@dataclass(frozen=True)
class Placement:
    """Where one peer process runs (the default: here, on loopback). `noloco testbed` puts each
    peer in a network namespace: `prefix` is then `ip netns exec NS`, and the addresses its own."""

    prefix: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = LOOPBACK
    announce_maddrs: tuple[str, ...] = ()
    # the namespace `prefix` enters: a peer forked from the preloader enters it itself
    netns: str | None = None


Place = Callable[[int | None, int], Placement]  # (stage or None for auto, replica index) -> Placement


@dataclass
class PeerProcess:
    stage: int | None  # None: it chose its stage itself (--stage auto)
    replica: int
    proc: subprocess.Popen[bytes] | Forked
    metrics: Path
    log: Path

    def events(self) -> list[Event]:
        """The peer's events so far, as typed records (a torn last line, mid-write, is skipped)."""
        return read(self.metrics)

    def log_tail(self, lines: int = 25) -> str:
        """The last `lines` lines of the peer's log without tracebacks' frames (indented), so that
        a failure's report shows what the peer said before the error, and the error itself."""
        if not self.log.exists():
            return ""
        said = [
            line
            for line in self.log.read_text(errors="replace").splitlines()
            if line.strip() and not line.startswith((" ", "\t", "Traceback ", "During handling"))
        ]
        return "\n".join(said[-lines:])


@dataclass
class LocalSwarm:
    cfg: RunConfig
    steps: int
    run_id: str
    workdir: Path
    bootstrap: str = ""
    peers: list[PeerProcess] = field(default_factory=list)
    threads: int = 1
    durable: bool = False  # each peer keeps an identity and checkpoints in the workdir
    resume: bool = False  # ... and starts from them (`noloco join --resume`)
    place: Place | None = None  # where each peer runs; None: every peer here, on loopback
    authority: Path | None = None  # a closed run's authority key: each peer gets an identity and a ticket
    # Environment variables of one peer, by (stage, replica): e.g. a test's failpoints in one peer.
    peer_env: Callable[[int | None, int], Mapping[str, str]] | None = None
    pin: bool = False  # each peer (and its p2pd) runs on its own share of our CPUs (cpu_share)
    preload: bool = True  # fork peers here from one process that has imported torch etc. (preload.py)

    @property
    def config_path(self) -> Path:
        return self.workdir / "run-config.json"

    def start_peer(self, stage: int | None, *, again: PeerProcess | None = None) -> PeerProcess:
        """Start one `noloco join` peer of `stage` (None: `--stage auto`); once round 0 is full it
        joins the running swarm two rounds ahead, so this also adds a peer to a swarm that trains.
        `again` (a durable swarm's peer that has stopped) restarts that peer with `--resume`: the
        same identity and checkpoint folder."""
        resume = self.resume or again is not None
        if again is not None and (not self.durable or again.proc.poll() is None):
            raise ValueError("only a durable swarm's stopped peer can be restarted")
        d = again.replica if again is not None else sum(1 for p in self.peers if p.stage == stage)
        name = "auto" if stage is None else stage
        restarts = sum(1 for p in self.peers if p.stage == stage and p.replica == d) - 1
        run = f"peer-{name}-{d}" + ("-resumed" if resume else "") + (f"-{restarts}" if restarts > 0 else "")
        metrics, log = self.workdir / f"{run}.jsonl", self.workdir / f"{run}.log"
        where = self.place(stage, d) if self.place is not None else Placement()
        argv = self.join_argv(stage, metrics, where)
        if self.cfg.peer.metrics_port is not None:  # the first peer's port; the others follow it
            argv += ["--metrics-port", str(self.metrics_port(len(self.peers)))]
        key = self.workdir / f"peer-{name}-{d}.key"
        if self.durable or self.authority is not None:  # the same key at every start: the same peer
            argv += ["--identity", str(key)]
        if self.durable:
            argv += ["--checkpoint-dir", str(self.checkpoints(stage, d))]
            argv += ["--resume"] if resume else []
        if self.pin:
            argv += ["--set", f"peer.cpus={format_cpus(planned_cpus(self.cfg, len(self.peers)))}"]
        if self.authority is not None:  # a closed run: a day's ticket for the key's peer id
            ticket = key.with_suffix(".ticket")
            if not key.exists():
                identity.generate(key)
            peer_id = identity.load(key).peer_id
            tickets.write(
                tickets.issue(identity.load(self.authority).key, self.run_id, peer_id, time.time() + 86400),
                ticket,
            )
            argv += ["--set", f"peer.ticket={ticket}"]
        # The run config already holds what NOLOCO_SET said; inherited, it would also override the
        # run config in every peer (a mismatched manifest) and hand them one shared identity file.
        env = {k: v for k, v in os.environ.items() if k != "NOLOCO_SET"}
        env |= self.peer_env(stage, d) if self.peer_env is not None else {}
        # glibc reads its tunables at start: a thp peer is forked from a preloader that started
        # with them, or started with them (peer/net/lifetime.py).
        env = allocator_env(self.cfg.peer.release_memory, env)
        forkable = self.preload and (not where.prefix or where.netns is not None)
        proc = fork_peer(argv, env, log, where.netns) if forkable else None
        if proc is None:
            argv = [*where.prefix, *command(argv)]
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
                )
        peer = PeerProcess(stage, d, proc, metrics, log)
        self.peers.append(peer)
        return peer

    def metrics_port(self, index: int) -> int:
        """The metrics port of the `index`-th peer started (cfg.peer.metrics_port + index)."""
        base = self.cfg.peer.metrics_port
        if base is None:
            raise ValueError("this swarm's peers serve no metrics (peer.metrics_port is not set)")
        return base + index if base else 0  # 0: each peer picks a free port

    def checkpoints(self, stage: int | None, replica: int) -> Path:
        """The checkpoint folder of a durable swarm's peer."""
        return self.workdir / f"checkpoints-{'auto' if stage is None else stage}-{replica}"

    def join_argv(self, stage: int | None, metrics: Path, where: Placement = Placement()) -> list[str]:
        """`noloco join` arguments of one peer: the run config file (the run's keys), the peer
        settings this swarm resolved (cfg.peer), and what differs per peer as named flags."""
        p = self.cfg.peer
        announce = ["--announce-maddrs", *where.announce_maddrs] if where.announce_maddrs else []
        settings = [
            arg
            for f in dataclasses.fields(p)
            if f.name not in PER_PEER and getattr(p, f.name) is not None
            for arg in ("--set", f"peer.{f.name}={setting(getattr(p, f.name))}")
        ]
        return [
            "join", "--initial-peers", self.bootstrap, "--host-maddrs", *where.host_maddrs, *announce,
            "--run-id", self.run_id, "--stage", "auto" if stage is None else str(stage), "--metrics", str(metrics),
            "--steps", str(self.steps), "--run-config", str(self.config_path), "--threads", str(self.threads),
            *settings, "--die-with-parent",
        ]  # fmt: skip

    def failed(self) -> list[PeerProcess]:
        return [p for p in self.peers if p.proc.poll() not in (None, 0)]

    def finished(self) -> bool:
        return all(p.proc.poll() == 0 for p in self.peers)

    def summaries(self) -> list[Final]:
        """The summary of every peer that has finished so far."""
        return [f for p in self.peers for f in of_kind(p.events(), Final)]


_SWARMS = itertools.count()  # this process's swarms, for their run ids

# Peer settings a launcher gives each of its peers itself, by flags of their own (start_peer,
# join_argv), rather than passing on the value it resolved for the swarm.
PER_PEER = ("run_id", "stage", "metrics", "metrics_port", "checkpoint_dir", "cpus", "ticket")


def setting(value: object) -> str:
    """A peer setting's value as `--set` takes it."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def cpu_share(cpus: list[int], peers: int, index: int) -> list[int]:
    """The CPUs of the `index`-th peer started (0, 1, ...) when `peers` peers share `cpus`.

    With at least as many CPUs as peers, each peer gets its own block of len(cpus) // peers.
    With fewer, peers take one CPU each in turn: peers start stage by stage, so a stage's replicas
    (which compute at the same time) land on different CPUs, and each CPU hosts one replica of
    every stage (which take turns along the pipeline). A peer added later shares the block or CPU
    of the peer `index` wraps round to. Pinned so, a peer and its p2pd hand each message over on
    one CPU: on 2 cores the 2x2 swarm of bench/swarm_throughput.py ran about 11% faster
    (docs/benchmarks.md, "Swarm: the cost of real transport"; 2026-12-04, 670e009)."""
    if not cpus or peers < 1:
        raise ValueError("cpu_share needs at least one CPU and one peer")
    size = len(cpus) // peers
    if size >= 1:
        block = index % peers
        return cpus[block * size : (block + 1) * size]
    return [cpus[index % len(cpus)]]


def planned_cpus(cfg: RunConfig, index: int) -> list[int]:
    """The CPUs of the `index`-th peer a pinning launcher starts for `cfg` (cpu_share of this
    process's CPUs among the run's starting peers; Linux)."""
    return cpu_share(sorted(os.sched_getaffinity(0)), sum(cfg.replica_counts), index)


@contextmanager
def local_swarm(
    cfg: RunConfig,
    steps: int,
    *,
    workdir: Path | None = None,
    step_timeout: float | None = None,
    threads: int = 1,
    initial_peers: tuple[str, ...] = (),
    run_id: str | None = None,
    durable: bool = False,
    resume: bool = False,
    place: Place | None = None,
    host_maddrs: tuple[str, ...] = LOOPBACK,
    authority: Path | None = None,
    peer_env: Callable[[int | None, int], Mapping[str, str]] | None = None,
    pin: bool = False,
    preload: bool = True,
) -> Iterator[LocalSwarm]:
    """Start the swarm; yields while the peers run; always ends every process it started.

    Every peer runs `cfg` (its run keys through the run config file, `cfg.peer`'s deadlines and
    device as flags); `step_timeout`, if given, replaces both of cfg.peer's step and exchange deadlines.
    With `initial_peers` (e.g. a `hivemind-dht` node) our own node joins through them and the peers
    are given the first of them as their entry point; otherwise our node is the bootstrap.
    `durable` peers keep their identity and checkpoints in `workdir`; with `resume` they restart
    from them (give the stopped swarm's `workdir` and `run_id`). `place` says where each peer
    runs and `host_maddrs` where our own node listens (`noloco testbed`: namespaces on a bridge).
    A closed run (`cfg.authority`) needs its `authority` key file: every peer gets a ticket.
    `peer_env(stage, replica)` adds environment variables to one peer (a test's failpoints).
    `pin` runs each peer and its daemon on its own share of this process's CPUs (cpu_share; Linux).
    `preload` forks peers from one process that has imported torch, transformers and hivemind
    (harness/preload.py) rather than starting each from scratch: about 4 s of CPU less per peer.
    """
    if pin and not hasattr(os, "sched_getaffinity"):
        raise ValueError(f"pinning peers to CPUs needs Linux's CPU affinity, which {sys.platform} lacks")
    if bool(cfg.authority) != (authority is not None):
        raise ValueError("a closed run (cfg.authority) needs its authority key file, and only it")
    if resume and (workdir is None or run_id is None or not durable):
        raise ValueError("resuming needs a durable swarm's workdir and run id")
    if step_timeout is not None:
        cfg = cfg.replace(
            peer=dataclasses.replace(cfg.peer, step_timeout=step_timeout, exchange_timeout=step_timeout)
        )
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="noloco-local-")
        workdir = Path(tmp.name)
    # Unique per swarm: two swarms of one process started within a second once shared a run id,
    # and each counted the other's peers (tests/integration/test_runs.py, 2026-12-06).
    run_id = run_id or f"local-{os.getpid()}-{int(time.time())}-{next(_SWARMS)}"
    swarm = LocalSwarm(
        cfg,
        steps,
        run_id,
        workdir,
        threads=threads,
        durable=durable,
        resume=resume,
        place=place,
        authority=authority,
        peer_env=peer_env,
        pin=pin,
        preload=preload,
    )
    dht = start_dht(NetworkConfig(initial_peers=initial_peers, host_maddrs=host_maddrs))
    try:
        swarm.bootstrap = initial_peers[0] if initial_peers else str(dht.get_visible_maddrs()[0])
        RunDirectory(dht, run_id).publish_manifest(RunManifest.create(run_id, cfg.manifest()))
        swarm.config_path.write_text(json.dumps(cfg.manifest()))
        for s, count in enumerate(cfg.replica_counts):
            for _ in range(count):
                swarm.start_peer(s)
        yield swarm
    finally:
        end_groups([peer.proc for peer in swarm.peers])
        sweep_sockets()  # of the peers that were killed (a test's victims) or cut short
        dht.shutdown()
        if tmp is not None:
            tmp.cleanup()


def until(check: Callable[[], bool], timeout: float, what: str, poll: float = 0.2) -> None:
    """Poll `check` until it holds; TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(poll)


def wait(
    swarm: LocalSwarm, timeout: float, poll: float = 0.1, on_poll=None, ignore: Sequence[PeerProcess] = ()
) -> None:
    """Until every peer (but those in `ignore`, e.g. killed on purpose) exited 0; raise with the
    failing peer's log if one fails or time runs out."""
    deadline = time.monotonic() + timeout
    watched = [p for p in swarm.peers if p not in ignore]
    while not all(p.proc.poll() == 0 for p in watched):
        if on_poll is not None:
            on_poll(swarm)
        watched = [p for p in swarm.peers if p not in ignore]  # on_poll may start peers
        bad = [p for p in watched if p.proc.poll() not in (None, 0)]
        if bad:
            p = bad[0]
            others = "".join(
                f"\n--- stage {o.stage} replica {o.replica}:\n{o.log_tail(10)}" for o in watched if o is not p
            )
            raise RuntimeError(
                f"peer stage {p.stage} replica {p.replica} exited {p.proc.returncode}:\n{p.log_tail()}{others}"
            )
        if time.monotonic() > deadline:
            running = [p for p in swarm.peers if p.proc.poll() is None]
            tails = "\n".join(f"--- stage {p.stage} replica {p.replica}:\n{p.log_tail()}" for p in running)
            raise TimeoutError(f"the swarm did not finish in {timeout:.0f} s; still running:\n{tails}")
        time.sleep(poll)
    if on_poll is not None:
        on_poll(swarm)


def end_group(proc: subprocess.Popen | Forked, grace: float = 10.0) -> None:
    end_groups([proc], grace)


def end_groups(procs: Sequence[subprocess.Popen | Forked], grace: float = 10.0) -> None:
    """Stop process groups (a peer and its p2pd) at once, all together: SIGTERM
    twice (a peer takes the first as a request to leave gracefully, the second as "stop now"),
    then SIGKILL what remains after `grace` seconds; reap the leaders."""
    running = [p for p in procs if p.poll() is None]
    for sig_round in range(2):
        for proc in running:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        if sig_round == 0:
            time.sleep(0.5)  # two signals sent at once could merge into one
    deadline = time.monotonic() + grace
    for proc in running:
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace)
        if proc.stdout:
            proc.stdout.close()
