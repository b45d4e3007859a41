"""`noloco local` as a user runs it: real peers, and a killed launcher leaves nothing behind.

(Ctrl-C in a real terminal is tests/integration/test_terminal.py; a whole run to its summary and
charts, tests/integration/test_plot.py.)"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.helpers import alive, descendants, p2pd_descendants
from tests.small import SMALL_RUN

pytestmark = pytest.mark.integration


def local_dirs(tmp: Path) -> set[str]:
    return set(glob.glob(str(tmp / "noloco-local-*")))


def start_local(*flags: str, tmp: Path) -> subprocess.Popen[str]:
    """`noloco local` on the small test run, its output readable line by line. Its run folder
    goes under `tmp` (TMPDIR), so the test finds (and removes) only its own, never a folder of a
    `noloco local` that runs beside it (another test lane, a user's run)."""
    argv = [
        sys.executable,
        "-m",
        "noloco_swarm.cli.main",
        "local",
        "--plain",
        "--replicas",
        "2",
        *flags,
        *SMALL_RUN,
    ]
    env = os.environ | {"TMPDIR": str(tmp)}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_for_a_step(proc: subprocess.Popen[str], timeout: float = 180) -> list[str]:
    """Until `noloco local` prints its first step line (the swarm trains); the lines it printed."""
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while not any(line.startswith("step") for line in seen):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
        seen.append(proc.stdout.readline())  # type: ignore[union-attr]
    return seen


def survivors(pids: set[int], run_dirs: set[str]) -> str:
    """What outlived the launcher, and the tail of every peer's log: where a peer hung."""
    lines = ["processes outlived the launcher:"]
    for pid in sorted(pids):
        try:
            lines.append(f"  {pid}: {Path(f'/proc/{pid}/cmdline').read_text().replace(chr(0), ' ')[:200]}")
        except OSError:
            lines.append(f"  {pid}: (gone)")
    for log in sorted(p for d in run_dirs for p in Path(d).glob("*.log")):
        lines += [f"--- {log.name}:", *log.read_text(errors="replace").splitlines()[-40:]]
    return "\n".join(lines)


def test_a_killed_launcher_takes_its_peers_and_their_daemons_with_it(cache: Path, tmp_path: Path) -> None:
    """`noloco local` SIGKILLed (an OOM kill, a CI runner's timeout) cannot end its peers itself:
    each peer learns from the kernel that its parent died and stops at once, with its p2pd,
    instead of leaving gracefully for minutes with nobody to report to."""
    # Outer steps 2000 inner steps apart: a graceful leave (at the boundary after next) would take
    # minutes, so only peers that stop at once are gone by the deadline below.
    proc = start_local("--steps", "5000", "--set", "outer.inner_steps=2000", tmp=tmp_path)
    family: set[int] = set()
    try:
        wait_for_a_step(proc)
        family = descendants(proc.pid)
        assert len(p2pd_descendants(proc.pid)) >= 4, "the peers should be running their daemons"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 45
        while alive(family) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(family), survivors(alive(family), local_dirs(tmp_path))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in alive(family):  # never leave them running, whatever failed above
            os.kill(pid, signal.SIGKILL)
        for folder in local_dirs(tmp_path):  # a killed launcher cannot remove its own
            shutil.rmtree(folder, ignore_errors=True)


def affinity(pid: int) -> set[tuple[int, ...]]:
    """The CPU sets of every thread of `pid` (one set when they all agree)."""
    return {tuple(sorted(os.sched_getaffinity(int(task)))) for task in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_local_runs_each_peer_and_its_daemon_on_its_own_share_of_the_cpus(
    cache: Path, tmp_path: Path
) -> None:
    """`noloco local` pins each peer, every thread of it and its p2pd to the CPUs cpu_share gives
    its place in the start order (stage by stage), and says so; its own bootstrap node stays free."""
    from noloco_swarm.harness.local import cpu_share
    from noloco_swarm.train.config import format_cpus

    allowed = sorted(os.sched_getaffinity(0))
    # A run that outlasts the checks below by far: peers found training are still there to look at.
    proc = start_local("--steps", "5000", "--set", "outer.inner_steps=2000", tmp=tmp_path)
    family: set[int] = set()
    try:
        said = "".join(wait_for_a_step(proc))
        family = descendants(proc.pid)
        peers = {}
        for pid in family:
            # A peer forked by the preloader shows its command as one title (setproctitle).
            argv = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").split()
            if "join" in argv:
                stage, metrics = argv[argv.index("--stage") + 1], argv[argv.index("--metrics") + 1]
                replica = Path(metrics).stem.rsplit("-", 1)[1]  # peer-STAGE-REPLICA.jsonl
                peers[int(stage) * 2 + int(replica)] = pid  # 2 replicas per stage, started in order
        assert sorted(peers) == [0, 1, 2, 3], peers
        for index, pid in peers.items():
            share = tuple(cpu_share(allowed, 4, index))
            daemons = p2pd_descendants(pid)
            assert len(daemons) == 1, f"peer {index} should run one p2pd, has {daemons}"
            assert affinity(pid) == {share}, f"peer {index}'s threads run on {affinity(pid)}, not {share}"
            assert affinity(daemons.pop()) == {share}, f"peer {index}'s p2pd is not on {share}"
        assert affinity(proc.pid) == {tuple(allowed)}  # the launcher itself is not pinned
    finally:
        proc.send_signal(signal.SIGINT)  # the launcher ends its swarm
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        deadline = time.monotonic() + 45  # the peers' daemons stop with them, not at once
        while alive(family) and time.monotonic() < deadline:
            time.sleep(0.2)
        ended = not alive(family)
        for pid in alive(family):  # never leave them running, whatever failed above
            os.kill(pid, signal.SIGKILL)
    shares = " ".join(format_cpus(cpu_share(allowed, 4, i)) for i in range(4))
    assert f"each peer and its p2pd on its own CPUs, in start order: {shares} (--no-pin" in said, said
    assert ended, "the launcher's swarm outlived it"
