"""Process helpers for integration tests: start real daemons, always end them, find leftovers."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from noloco_swarm.harness.local import end_group
from noloco_swarm.peer.net.lifetime import parent_death_signal

MADDR = re.compile(r"(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)")
# For a swarm that only has to stay up and train while a test looks at it (lists it, runs commands
# beside it): every round of its inner steps lasts at least e^MU seconds (the straggle failpoint,
# peer/failpoints.py, with SIGMA 0), and its peers leave the CPU to the other lane meanwhile.
# Trained flat out, such swarms took most of two cores for a minute or more.
PACED_1S = {"NOLOCO_STRAGGLE": "0,0"}
PACED_2S = {"NOLOCO_STRAGGLE": "0.7,0"}


def unused_port() -> int:
    """A port nothing listens on (bound once to find it, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live descendant of `pid` (from /proc), so tests can prove they leave no daemons."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":  # zombies are dead already
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` that still run (zombies and vanished processes are dead), wherever they
    were reparented to."""
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            out.add(pid)
    return out


def rss_mib(pid: int) -> float:
    """The resident memory of process `pid` now, in MiB (/proc/<pid>/status VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"process {pid} reports no VmRSS")


def p2pd_descendants(pid: int | None = None) -> set[int]:
    out = set()
    for child in descendants(os.getpid() if pid is None else pid):
        try:
            if Path(f"/proc/{child}/comm").read_text().strip() == "p2pd":
                out.add(child)
        except OSError:
            continue
    return out


@contextmanager
def process_group(
    argv: list[str], *, ready: re.Pattern[str] = MADDR, timeout: float = 60.0
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start argv in its own process group, wait for `ready` in its output, kill the group at the end.

    If the test process dies first (killed: no `finally` runs), the kernel sends the program
    SIGINT: hivemind's `hivemind-dht` shuts down on it (with its DHT process), not on SIGTERM, and
    `noloco dht` on both. Without it, a killed pytest left hivemind-dht running under init."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=parent_death_signal(signal.SIGINT),  # noqa: PLW1509 - only a prctl, looked up before the fork
    )
    try:
        deadline = time.monotonic() + timeout
        seen = []
        match = None
        while match is None:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} did not become ready:\n{''.join(seen)}")
            line = proc.stdout.readline()  # type: ignore[union-attr]
            seen.append(line)
            match = ready.search(line)
        yield proc, match.group(1)
    finally:
        # Both bootstraps shut down cleanly on SIGINT, their DHT process and its sockets with them
        # (a group's SIGTERM kills that process before it removes them); what remains is ended.
        with suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=15)
        end_group(proc)


def unread_output(proc: subprocess.Popen[str]) -> str:
    """What `proc` (started by process_group) has written since its ready line and nobody has
    read yet, without waiting for more; for a failing test's message."""
    fd = proc.stdout.fileno()  # type: ignore[union-attr]
    chunks = []
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


WARNED = re.compile(r"\b(WARN|WARNING|ERROR|Traceback)\b")
TROUBLE = ("dropped", "refused", "retried", "view_mismatch", "slow_peer", "peer_gone", "excluded")


def troubles(swarm) -> str:
    """Everything in a swarm's events and logs that can explain a replica that differs from the
    simulator (lost rows, refusals, retries, failed exchanges, warnings), one line each."""
    lines = []
    for p in swarm.peers:
        who = f"stage {p.stage} replica {p.replica}"
        for e in p.events():
            if e.KIND in TROUBLE or (e.KIND == "outer" and e.failed):
                lines.append(f"{who}: {e}")
        if p.log.exists():
            for line in p.log.read_text(errors="replace").splitlines():
                if WARNED.search(line) and "reachable as" not in line:  # that one is always there
                    lines.append(f"{who} log: {line}")
    return "\n".join(lines) or "no dropped, refused or retried rows, no failed exchange, no warning"
