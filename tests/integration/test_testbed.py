"""The network-namespace testbed with real packets: links cut, restored and shaped, and a whole
swarm in namespaces reproducing the simulator. (A 20 s link cut in the middle of a run is one of
the chaos test's faults: test_chaos.py.)"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from noloco_swarm.harness.local import cpu_share, end_group, wait
from noloco_swarm.harness.namespaces import BOOT, namespace_swarm, peer_host
from noloco_swarm.harness.preload import fork_peer
from noloco_swarm.peer.events import Outer, of_kind
from noloco_swarm.peer.net.uplink import CAP_SHARE, CLIMB
from noloco_swarm.testbed import Testbed, namespaces_permitted
from noloco_swarm.testbed.bed import LINK, NAME, TransportKind, forward_rules, owned_names
from noloco_swarm.testbed.schedule import Shape
from noloco_swarm.train.config import format_cpus
from tests.integration.helpers import troubles
from tests.integration.test_swarm import STEPS, simulate, small

PERMITTED, WHY = namespaces_permitted()
pytestmark = pytest.mark.integration
PROBE = [sys.executable, "-m", "tests.integration.netprobe"]
ROOT = str(Path(__file__).resolve().parents[2])


def ours() -> tuple[set[str], set[str]]:
    """The testbed namespaces and links this process made (another process's testbed, running
    meanwhile on the same machine, is none of this test's business)."""
    spaces, links = owned_names()
    mine = f"{os.getpid():x}"
    return (
        {n for n in spaces if (m := NAME.match(n)) and m.group(1) == mine},
        {n for n in links if (m := LINK.match(n)) and m.group(1) == mine},
    )


@pytest.fixture(autouse=True)
def testbed_here() -> None:
    """A machine that could run the testbed fails these tests when it lacks a tool or root; only
    one whose kernel will not make a network namespace (not Linux, a container without
    CAP_NET_ADMIN) skips them."""
    if not os.path.exists("/proc/self/ns/net"):
        pytest.skip("testbed: network namespaces are Linux-only")
    missing = [tool for tool in ("ip", "tc", "nft") if shutil.which(tool) is None]
    if missing:
        pytest.fail(
            f"the testbed needs {', '.join(missing)}: sudo apt-get install -y iproute2 nftables"
            " (scripts/setup_tools.sh installs them as root)",
            pytrace=False,
        )
    if os.geteuid() != 0:
        pytest.fail(
            "the testbed makes network namespaces, which needs root: sudo bash scripts/test.sh", pytrace=False
        )
    if not PERMITTED:
        pytest.skip(f"testbed: {WHY}")


@pytest.fixture
def nothing_left() -> Iterator[None]:
    """Every namespace and link a test's testbed made is gone afterwards."""
    before = ours()
    yield
    spaces, links = ours()
    assert spaces <= before[0] and links <= before[1], (spaces, links)


class Lines:
    """A process's stdout lines, read on a thread, taken with a deadline."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            self.queue.put(line.strip())

    def next(self, timeout: float) -> str | None:
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None


def start(bed: Testbed, host: str, *args: str, stdin: bool = False) -> tuple[subprocess.Popen[str], Lines]:
    proc = bed.popen(
        host,
        [*PROBE, *args],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
    )
    return proc, Lines(proc)


def say(proc: subprocess.Popen[str], text: str) -> None:
    proc.stdin.write(text + "\n")  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]


def received_in(bed: Testbed, port: int, seconds: float) -> int:
    """Bytes host b receives from host a in `seconds` of a bulk send."""
    sink, out = start(bed, "b", "sink", bed.hosts["b"].address, str(port), str(seconds))
    assert out.next(30) == "listening"
    source = bed.popen("a", [*PROBE, "source", bed.hosts["b"].address, str(port)], cwd=ROOT)
    line = out.next(seconds + 60)
    source.kill()
    sink.wait(timeout=30)
    assert line is not None and line.isdigit(), f"the sink printed {line!r}"
    return int(line)


@pytest.mark.parametrize("mode", ["drop", "down"])
def test_links_connect_cut_restore_and_shape(mode: str, nothing_left: None) -> None:
    with Testbed(["a", "b"]) as bed:
        a, b = bed.hosts["a"], bed.hosts["b"]
        assert a.address != b.address and a.netns != b.netns
        if shutil.which("iptables"):  # a dockerd started while we run must not cut our hosts apart
            assert len(bed.forwarding_rules()) == 1, bed.forwarding_rules()
        echo, out = start(bed, "b", "echo", b.address, "7000")
        assert out.next(30) == "listening"
        chat, back = start(bed, "a", "chat", b.address, "7000", stdin=True)
        assert back.next(30) == "connected"
        say(chat, "before")
        assert back.next(30) == "before"

        bed.cut("a", mode)
        say(chat, "during")  # sent into the cut: must not arrive while it lasts
        assert back.next(3) is None
        late, late_out = start(bed, "a", "chat", b.address, "7000")
        assert (late_out.next(30) or "").startswith("failed"), "a new connection crossed a cut link"
        bed.restore("a")
        # TCP retransmits what the cut swallowed; the same connection carries on.
        assert back.next(60) == "during"
        say(chat, "after")
        assert back.next(30) == "after"
        again, again_out = start(bed, "a", "chat", b.address, "7000")
        assert again_out.next(30) == "connected"

        # Shaping: 8 Mbit/s is 1 MB/s; allow twice that (plus the burst) against tens of MB unshaped.
        seconds = 3.0
        free = received_in(bed, 7001, seconds)
        bed.shape("a", 8, qdisc="tbf" if mode == "drop" else "htb")
        shaped = received_in(bed, 7002, seconds)
        assert shaped < 2 * seconds * 1e6 + 1e6, f"{shaped} bytes in {seconds} s through an 8 Mbit/s link"
        assert free > 5 * shaped, f"unshaped {free} bytes vs shaped {shaped}: shaping had no effect"
        assert bed.counters("a")[1] > shaped
        procs = [echo, chat, late, again]
    assert all(p.poll() is not None for p in procs), "the testbed must end what it started"
    assert bed.leftovers() == []


KILLED = """
import sys
from noloco_swarm.testbed import Testbed
bed = Testbed(["a", "b"]).__enter__()
print(bed.bridge, flush=True)
sys.stdin.read()  # until the test has looked, then SIGKILLed: no cleanup runs
"""


def test_a_peer_forked_from_the_preloader_runs_in_its_hosts_namespace(
    nothing_left: None, tmp_path: Path
) -> None:
    """The testbed forks its peers from the preloader (one import for all): the child enters its
    host's network namespace before it runs, so it and the p2pd it starts live there and listen
    on the host's address, as under `ip netns exec`."""
    with Testbed(["a"]) as bed:
        host = bed.hosts["a"]
        log = tmp_path / "dht.log"
        env = {k: v for k, v in os.environ.items() if k != "NOLOCO_SET"}
        dht = fork_peer(["dht", "--host-maddrs", host.maddr()], env, log, host.netns)
        assert dht is not None, "the testbed's peers are forked"
        try:
            deadline = time.monotonic() + 60
            while "/p2p/" not in log.read_text() and dht.poll() is None:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            assert dht.poll() is None, log.read_text()
            assert f"/ip4/{host.address}/tcp/" in log.read_text()
            daemon = Path(f"/proc/{dht.pid}/task/{dht.pid}/children").read_text().split()[0]
            space = os.stat(f"/run/netns/{host.netns}").st_ino
            assert os.stat(f"/proc/{dht.pid}/ns/net").st_ino == space
            assert os.stat(f"/proc/{daemon}/ns/net").st_ino == space
            assert os.stat("/proc/self/ns/net").st_ino != space
        finally:
            end_group(dht)


def test_a_sigkilled_testbed_is_swept_by_the_next_one(nothing_left: None) -> None:
    """A testbed's process SIGKILLed cannot remove what it made; the next testbed to start sweeps
    its namespaces, links and forwarding rule, and nothing of it is left."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        bridge = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert bridge, "the testbed did not start"
        owner = f"{proc.pid:x}"
        spaces, links = owned_names()
        assert any(NAME.match(n)[1] == owner for n in spaces) and bridge in links  # type: ignore[index]
        assert any(bridge in rule for rule in forward_rules()) or not shutil.which("iptables")
    finally:
        proc.kill()
        proc.wait()
    with Testbed(["c"]):  # its start sweeps what the dead one left
        spaces, links = owned_names()
        assert not [n for n in spaces if NAME.match(n)[1] == owner], spaces  # type: ignore[index]
        assert bridge not in links
        assert not [rule for rule in forward_rules() if bridge in rule], forward_rules()


@pytest.mark.parametrize("transport", ["tcp", "quic"])
def test_swarm_in_namespaces_ends_with_the_simulators_weights(
    transport: TransportKind, cache: Path, one_thread: None, nothing_left: None, tmp_path: Path
) -> None:
    """Over TCP (the peers' default) and over QUIC (`noloco testbed --transport quic`)."""
    cfg = small("noloco")
    with namespace_swarm(cfg, STEPS, step_timeout=60, workdir=tmp_path, transport=transport) as ns:
        peers = {peer_host(p.stage, p.replica): p for p in ns.swarm.peers}
        time.sleep(2)  # `ip netns exec` has entered the namespace and exec'd the peer by now
        where = {
            name: subprocess.run(
                ["ip", "netns", "identify", str(p.proc.pid)], capture_output=True, text=True, check=True
            ).stdout.strip()
            for name, p in peers.items()
        }
        wait(ns.swarm, timeout=400)
        summaries = ns.swarm.summaries()
        traffic = {name: ns.bed.counters(name) for name in peers}
        hosts = ns.bed.hosts
        assert ns.bootstrap.startswith(f"/ip4/{hosts[BOOT].address}/tcp/")
    expected, _ = simulate(cfg, STEPS)
    got = {(s.stage, s.rank): s.state_hash for s in summaries}
    assert got == {(s, r): expected[s][r] for s in range(2) for r in range(2)}
    # Each peer ran in its own namespace, and the outer exchanges (4 MB of fp32 weights each way
    # per peer and outer step) crossed its link: the peers talked over namespace addresses.
    assert where == {name: hosts[name].netns for name in peers}
    for name, (rx, tx) in traffic.items():
        assert rx > 4_000_000 and tx > 4_000_000, f"{name}: {rx} bytes in, {tx} out"
        listens = {"tcp": "/tcp/", "quic": "/udp/"}[transport]  # then the port, then /quic-v1
        assert f"/ip4/{hosts[name].address}{listens}" in peers[name].log.read_text()


def test_a_link_profile_with_one_slow_far_peer_keeps_the_simulators_weights(
    cache: Path, one_thread: None, nothing_left: None, tmp_path: Path
) -> None:
    """A link profile: every peer's link shaped to 50 Mbit/s with 10 ms each way, and one volunteer
    (s1r1) behind 10 Mbit/s and 40 ms each way. With two microbatches in flight and bf16 rows,
    the swarm still ends with the simulator's exact weights, and every peer was reached through
    its own delayed path (each announced its relay) and moved its traffic over its shaped link.
    The peers are pinned to CPUs, as `noloco testbed` and bench/wan_throughput.py's pinned
    variants run them: where a process runs must not change what it computes.

    The exchange caps itself (peer.exchange_max_mbit = auto): the first exchange goes uncapped,
    its partner times it arriving (a rate the shaped link bounds: 50 Mbit/s; 10 between s1r0 and
    s1r1, whose link is the slower), and the second probes above it: at 97% of that rate plus
    CLIMB, since both partners' unpaced sends shared the link (peer/net/uplink.py)."""
    cfg = small("noloco", **{"inner.batch_size": "4", "inner.microbatches": "2", "wire.activations": "bf16"})
    hosts = [peer_host(s, r) for s in range(2) for r in range(2)]
    shapes = [Shape(h, 10.0 if h == "s1r1" else 50.0) for h in hosts]
    with namespace_swarm(
        cfg,
        STEPS,
        step_timeout=60,
        workdir=tmp_path,
        delay_ms=10.0,
        delays={"s1r1": 40.0},
        shapes=shapes,
        pin=True,
    ) as ns:
        wait(ns.swarm, timeout=600)
        summaries, trouble = ns.swarm.summaries(), troubles(ns.swarm)
        traffic = {name: ns.bed.counters(name) for name in hosts}
        logs = {peer_host(p.stage, p.replica): p.log.read_text() for p in ns.swarm.peers}
        outers = {peer_host(p.stage, p.replica): list(of_kind(p.events(), Outer)) for p in ns.swarm.peers}
        relays, gateway = ns.relay_ports, ns.bed.gateway
    expected, _ = simulate(cfg, STEPS)
    got = {(s.stage, s.rank): s.state_hash for s in summaries}
    assert got == {(s, r): expected[s][r] for s in range(2) for r in range(2)}, trouble
    assert sorted(relays) == hosts
    allowed = sorted(os.sched_getaffinity(0))
    for index, name in enumerate(hosts):  # started stage by stage, as hosts lists them
        assert f"/ip4/{gateway}/tcp/{relays[name]}" in logs[name], f"{name} did not announce its relay"
        said = " ".join(logs[name].split())  # as one line: the console may wrap its own
        assert f"steps, on CPUs {format_cpus(cpu_share(allowed, 4, index))} " in said, said[:300]
        rx, tx = traffic[name]
        assert rx > 4_000_000 and tx > 4_000_000, f"{name}: {rx} bytes in, {tx} out"
        first, second = outers[name]
        link = (10.0 if name.startswith("s1") else 50.0) * 1e6 / 8  # bytes/s, the pair's slower
        assert first.pace == 0.0 and 0.2 * link < second.uplink <= 1.1 * link, (name, outers[name])
        assert second.pace == pytest.approx(CAP_SHARE * (1 + CLIMB) * second.uplink), (name, outers[name])


def test_a_delay_for_a_host_that_is_not_a_peer_is_refused(tmp_path: Path, nothing_left: None) -> None:
    swarm = namespace_swarm(small("noloco"), STEPS, workdir=tmp_path, delays={"s9r9": 10.0})
    with pytest.raises(ValueError, match="--delay names hosts"), swarm:
        pass


def test_a_delay_on_a_quic_testbed_is_refused(tmp_path: Path, nothing_left: None) -> None:
    """The delay relay carries TCP only: a QUIC testbed with a delay would run undelayed."""
    swarm = namespace_swarm(small("noloco"), STEPS, workdir=tmp_path, delay_ms=10.0, transport="quic")
    with pytest.raises(ValueError, match="carries TCP only"), swarm:
        pass
