"""Hosts in network namespaces on one bridge: links that can be cut, restored and shaped.

`Testbed` builds, for each named host, a namespace with a veth pair whose other end is a port of
one Linux bridge; the hosts and the root namespace (the bridge's own address) share one private
/24. A link is cut by dropping every packet on the host's interface inside its namespace (nftables:
the interface stays up, as when a path on the internet fails) or by taking the link down (the host
sees no carrier), and restored by undoing that. It is shaped with a token bucket (`tbf`) or an
`htb` class on each end of the veth: the root end's egress is the host's download, the host end's
egress its upload. Latency is not a kernel feature here (`netem` is missing on these machines); see
`delay.py` for the user-space relay.

Everything a testbed creates is named after the creating process (`nltb-<pid hex>-<n>`) so that two
runs never clash, is removed on exit, on an exception, on SIGINT and on SIGTERM, and anything left
by a process that was SIGKILLed is removed by the next testbed that starts (`sweep_leftovers`).
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Literal

PREFIX = "nltb"  # namespaces: nltb-<pid hex>-<n>-<host>
LINK_PREFIX = "nt"  # links: nt<pid hex>x<n>b (bridge), nt<pid hex>x<n>v<i> (host i's root end)
NAME = re.compile(rf"^{PREFIX}-([0-9a-f]+)-([0-9a-f]+)(?:-|$)")
LINK = re.compile(rf"^{LINK_PREFIX}([0-9a-f]+)x[0-9a-f]+[bv]")
CutMode = Literal["drop", "down"]
TransportKind = Literal["tcp", "quic"]  # what a peer on the testbed listens on
_SEQUENCE = itertools.count()
_CUT_TABLE = "nltb_cut"


class TestbedError(RuntimeError):
    """A testbed command failed; the message holds the command and what it printed."""

    __test__ = False  # not a pytest test class


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one `ip`/`tc`/`nft` command; raise TestbedError with its output if it fails."""
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def namespaces_permitted() -> tuple[bool, str]:
    """Whether this process may build a testbed here, and if not, why (a test's skip reason)."""
    if not hasattr(os, "geteuid") or not os.path.exists("/proc/self/ns/net"):
        return False, "network namespaces are Linux-only"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"the testbed needs iproute2 ({', '.join(missing)} not found); install iproute2"
    if os.geteuid() != 0:
        return False, "the testbed needs root (CAP_NET_ADMIN) to create network namespaces; run as root"
    probe = f"{PREFIX}-{os.getpid():x}-probe"
    done = sh("ip", "netns", "add", probe, check=False)
    sh("ip", "netns", "del", probe, check=False)
    if done.returncode != 0:
        return False, f"creating a network namespace failed here: {done.stderr.strip()}"
    return True, ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owned_names() -> tuple[list[str], list[str]]:
    """Every testbed namespace and link on this machine (any owner): (namespaces, links)."""
    spaces = [line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines() if line.strip()]
    links = [
        line.split(":")[1].strip().split("@")[0]
        for line in sh("ip", "-o", "link", "show").stdout.splitlines()
        if line.count(":") >= 2
    ]
    return [n for n in spaces if NAME.match(n)], [n for n in links if LINK.match(n)]


def sweep_leftovers() -> list[str]:
    """Remove the namespaces, links and forwarding rules of testbeds whose process is gone (it
    was SIGKILLed)."""
    removed = []
    spaces, links = owned_names()
    for name in spaces:
        match = NAME.match(name)
        if match and not _alive(int(match.group(1), 16)):
            sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    for name in links:
        match = LINK.match(name)
        if match and not _alive(int(match.group(1), 16)):
            sh("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed + _sweep_forwarding()


def forward_rules() -> list[str]:
    """iptables' FORWARD chain, one rule per line as `iptables -S` prints it (none without iptables)."""
    iptables = shutil.which("iptables")
    return [] if iptables is None else sh(iptables, "-w", "-S", "FORWARD", check=False).stdout.splitlines()


def _sweep_forwarding() -> list[str]:
    """Remove the FORWARD rules (`-A FORWARD -i BRIDGE -o BRIDGE -j ACCEPT`) of testbeds whose
    process is gone."""
    removed = []
    for rule in forward_rules():
        words = rule.split()
        match = LINK.match(words[3]) if len(words) > 3 and words[2] == "-i" else None
        if match and not _alive(int(match.group(1), 16)):
            sh("iptables", "-w", "-D", *words[1:], check=False)
            removed.append(f"FORWARD rule for {words[3]}")
    return removed


@dataclass(frozen=True)
class Host:
    """One host: its namespace, its link (root end on the bridge, `eth0` inside) and address."""

    name: str
    netns: str
    veth: str
    address: str

    def maddr(self, port: int = 0, transport: TransportKind = "tcp") -> str:
        """A libp2p listen multiaddr on this host's address: TCP (noise and yamux over it), or
        QUIC over UDP."""
        if transport == "quic":
            return f"/ip4/{self.address}/udp/{port}/quic-v1"
        return f"/ip4/{self.address}/tcp/{port}"


def free_subnet(start: int) -> ipaddress.IPv4Network:
    """A 10.77.X.0/24 that no route on this machine uses yet, trying X from `start` on."""
    used = sh("ip", "-4", "route", "show").stdout
    for k in range(250):
        net = ipaddress.IPv4Network(f"10.77.{(start + k) % 250 + 1}.0/24")
        if f"{net.network_address}/24" not in used:
            return net
    raise TestbedError("no free 10.77.X.0/24 subnet is left: remove old testbeds with `ip netns list`")


@dataclass
class Testbed:
    """A bridge and one namespace per host; use `with Testbed([...]) as bed:`.

    `subnet` defaults to a free 10.77.X.0/24; the bridge is .1, host i is .(i + 2).
    """

    __test__ = False  # not a pytest test class

    names: Sequence[str]
    subnet: ipaddress.IPv4Network | None = None
    hosts: dict[str, Host] = field(default_factory=dict, init=False)
    tag: str = field(default="", init=False)
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list, init=False)
    _iptables_rule: list[str] | None = field(default=None, init=False)
    _cut: dict[str, CutMode] = field(default_factory=dict, init=False)
    _restore_signals: Callable[[], object] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if len(set(self.names)) != len(self.names) or not self.names:
            raise ValueError(f"host names must be distinct and at least one: {list(self.names)}")
        if len(self.names) > 200:
            raise ValueError("a testbed holds at most 200 hosts (one /24)")
        pid, seq = os.getpid(), next(_SEQUENCE)
        self.tag = f"{pid:x}-{seq:x}"
        link = f"{LINK_PREFIX}{pid:x}x{seq:x}"  # interface names are at most 15 characters
        if len(link) + 4 > 15:
            raise ValueError(f"process id {pid} too large for interface names")
        self.bridge = f"{link}b"
        self.subnet = self.subnet or free_subnet(pid % 250)
        base = self.subnet.network_address
        self.gateway = str(base + 1)
        for i, name in enumerate(self.names):
            self.hosts[name] = Host(name, f"{PREFIX}-{self.tag}-{name}", f"{link}v{i}", str(base + i + 2))

    # ---- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Testbed:
        sweep_leftovers()
        self._restore_signals = _raise_on_sigterm()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for host in self.hosts.values():
            sh("ip", "netns", "add", host.netns)
            sh("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            sh("ip", "link", "set", host.veth, "master", self.bridge, "up")
            sh("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            sh("ip", "-n", host.netns, "link", "set", "eth0", "up")
            sh("ip", "-n", host.netns, "link", "set", "lo", "up")
        self._open_forwarding()

    def _open_forwarding(self) -> None:
        """With bridge netfilter on and a DROP forward policy (dockerd sets both), bridged frames
        between hosts would be dropped: accept this bridge's traffic for our lifetime. The rule
        goes in whenever iptables works, not only when dockerd runs now: a dockerd started while
        we run (the compose testbed, beside us in the test suite) would cut our hosts apart."""
        iptables = shutil.which("iptables")
        if iptables is None:
            return
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        if sh(iptables, "-w", "-I", *rule, check=False).returncode == 0:  # -w: dockerd may hold the lock
            self._iptables_rule = [iptables, "-w", "-D", *rule]

    def close(self) -> None:
        """End our processes, then remove the rule, namespaces, links and bridge; idempotent."""
        for proc in self._procs:
            _end_group(proc)
        self._procs.clear()
        if self._iptables_rule:
            sh(*self._iptables_rule, check=False)
            self._iptables_rule = None
        for host in self.hosts.values():
            sh("ip", "netns", "del", host.netns, check=False)  # takes the veth pair with it
            sh("ip", "link", "del", host.veth, check=False)
        sh("ip", "link", "del", self.bridge, check=False)
        if self._restore_signals is not None:
            self._restore_signals()
            self._restore_signals = None

    def leftovers(self) -> list[str]:
        """What of this testbed still exists (empty after close)."""
        spaces, links = owned_names()
        ours = {h.netns for h in self.hosts.values()} | {h.veth for h in self.hosts.values()} | {self.bridge}
        return sorted(ours & set(spaces + links)) + self.forwarding_rules()

    def forwarding_rules(self) -> list[str]:
        """Our bridge's rules in iptables' FORWARD chain (one while we run, where iptables works)."""
        return [rule for rule in forward_rules() if f"-i {self.bridge} " in rule]

    # ---- processes -------------------------------------------------------------------------------

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def run(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run a command inside `host` to completion (kwargs as for subprocess.run)."""
        kwargs.setdefault("timeout", 60)
        kwargs.setdefault("check", False)
        return subprocess.run(self.argv(host, argv), **kwargs)  # noqa: PLW1510 (check is in kwargs)

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a command inside `host` in its own process group; the testbed ends it on close."""
        proc = subprocess.Popen(self.argv(host, argv), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    # ---- links -----------------------------------------------------------------------------------

    def cut(self, host: str, mode: CutMode = "drop") -> None:
        """Cut `host`'s link: "drop" discards every packet on its interface (silently, as a failed
        path); "down" takes the link down (the host sees no carrier)."""
        h = self.hosts[host]
        if host in self._cut:
            return
        if mode == "down":
            sh("ip", "link", "set", h.veth, "down")
        elif mode == "drop":
            nft = ["ip", "netns", "exec", h.netns, "nft"]
            if shutil.which("nft") is None:
                raise TestbedError("cutting with mode 'drop' needs nftables (nft); use mode 'down'")
            sh(*nft, "add", "table", "inet", _CUT_TABLE)
            for chain, hook, match in (("in", "input", "iifname"), ("out", "output", "oifname")):
                spec = f"{{ type filter hook {hook} priority -300; policy accept; }}"
                sh(*nft, "add", "chain", "inet", _CUT_TABLE, chain, spec)
                sh(*nft, "add", "rule", "inet", _CUT_TABLE, chain, match, "eth0", "drop")
        else:
            raise ValueError(f"unknown cut mode {mode!r}: use 'drop' or 'down'")
        self._cut[host] = mode

    def restore(self, host: str) -> None:
        """Undo `cut(host)`; a no-op if the link is not cut."""
        h = self.hosts[host]
        mode = self._cut.pop(host, None)
        if mode == "down":
            sh("ip", "link", "set", h.veth, "up")
        elif mode == "drop":
            sh("ip", "netns", "exec", h.netns, "nft", "delete", "table", "inet", _CUT_TABLE)

    def is_cut(self, host: str) -> bool:
        return host in self._cut

    def shape(
        self,
        host: str,
        rate_mbit: float,
        *,
        up_mbit: float | None = None,
        burst_kbit: float | None = None,
        latency_ms: float = 100.0,
        qdisc: Literal["tbf", "htb"] = "tbf",
    ) -> None:
        """Limit `host`'s link to `rate_mbit` down and `up_mbit` (default: the same) up. The
        bucket (`burst_kbit`) defaults to 10 ms of the rate, at least 256 kbit (32 kB): a bucket
        that the shaper must refill more often than the kernel's timers fire holds a TCP flow
        below the rate (see docs/benchmarks.md, "The outer step alone")."""
        h = self.hosts[host]
        # The host's end sends what the host uploads; the root end sends what it downloads.
        ends = ((["tc", "-n", h.netns], "eth0", up_mbit or rate_mbit), (["tc"], h.veth, rate_mbit))
        for tc, dev, rate in ends:
            burst = burst_kbit if burst_kbit is not None else default_burst_kbit(rate)
            for argv in shaping_commands(dev, rate, burst_kbit=burst, latency_ms=latency_ms, qdisc=qdisc):
                sh(*tc, *argv)

    def unshape(self, host: str) -> None:
        h = self.hosts[host]
        sh("tc", "-n", h.netns, "qdisc", "del", "dev", "eth0", "root", check=False)
        sh("tc", "qdisc", "del", "dev", h.veth, "root", check=False)

    def counters(self, host: str) -> tuple[int, int]:
        """Bytes (received, sent) by `host` on its link so far."""
        stats = Path(f"/sys/class/net/{self.hosts[host].veth}/statistics")
        # The root end's tx is what the host received, and its rx what the host sent.
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def default_burst_kbit(rate_mbit: float) -> float:
    """A token bucket of 10 ms at `rate_mbit`, at least 256 kbit (32 kB)."""
    return max(rate_mbit * 10.0, 256.0)


def shaping_commands(
    dev: str, rate_mbit: float, *, burst_kbit: float, latency_ms: float, qdisc: str
) -> list[list[str]]:
    """`tc` arguments that limit `dev`'s egress to `rate_mbit` (tbf, or one htb class for all)."""
    if rate_mbit <= 0:
        raise ValueError(f"rate must be positive, got {rate_mbit} Mbit/s")
    rate, burst = f"{rate_mbit:g}mbit", f"{burst_kbit:g}kbit"
    if qdisc == "tbf":
        return [["qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                 "latency", f"{latency_ms:g}ms"]]  # fmt: skip
    if qdisc == "htb":
        return [
            ["qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
            ["class", "replace", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", rate,
             "ceil", rate, "burst", burst],
        ]  # fmt: skip
    raise ValueError(f"unknown qdisc {qdisc!r}: use 'tbf' or 'htb'")


def _raise_on_sigterm() -> Callable[[], object]:
    """Turn SIGTERM into SystemExit (SIGINT already raises KeyboardInterrupt) so that `with` blocks
    unwind and tear down; returns the function that puts the old handler back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _end_group(proc: subprocess.Popen[Any], grace: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL what is left of it after `grace` seconds, reap the leader."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=grace)
