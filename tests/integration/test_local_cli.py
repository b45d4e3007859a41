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


def wait_for_a_step(proc: subprocess.Popen[str], timeout: float = 180) -> None:
    """Until `noloco local` prints its first step line: the swarm trains."""
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while not any(line.startswith("step") for line in seen):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
        seen.append(proc.stdout.readline())  # type: ignore[union-attr]


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
