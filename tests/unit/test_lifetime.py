"""peer/net/lifetime.py: an orphaned peer is gone in seconds, with its children, whatever hangs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from noloco_swarm.peer.net import lifetime
from tests.integration.helpers import alive

# A process with a child (standing in for p2pd) whose shutdown hangs (standing in for a gone
# report waiting on dying DHT nodes): exit_within must end both.
HUNG = """
import subprocess, sys, time
from noloco_swarm.peer.net.lifetime import exit_within
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
exit_within(0.5)
time.sleep(120)  # a shutdown that never finishes
"""


def test_exit_within_ends_a_hung_process_and_its_children_and_says_where_it_hung() -> None:
    done = subprocess.run(
        [sys.executable, "-c", HUNG], check=False, capture_output=True, text=True, timeout=60
    )
    child = int(done.stdout.split()[0])
    assert done.returncode == 1, done.stderr
    assert "shutdown took over 0.5 s; exiting now" in done.stderr
    assert 'File "<string>", line 7' in done.stderr  # the hung thread's stack: where it waited
    assert not alive({child}), "the child outlived its parent"


def test_the_sweep_removes_only_the_socket_folders_of_processes_that_are_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGKILLed peer cannot remove its p2pd's sockets; the next peer or launcher sweeps them."""
    monkeypatch.setattr(lifetime, "SOCKETS", tmp_path)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True, text=True
    )
    dead = tmp_path / f"{lifetime.SOCKETS_PREFIX}{int(gone.stdout)}"
    dead.mkdir()
    (dead / "hivemind-p2pd-x.sock").touch()
    odd = tmp_path / f"{lifetime.SOCKETS_PREFIX}not-a-pid"
    odd.mkdir()
    mine = lifetime.sockets_folder()  # sweeps first, then makes ours
    assert mine == tmp_path / f"{lifetime.SOCKETS_PREFIX}{os.getpid()}" and mine.is_dir()
    assert not dead.exists() and odd.is_dir()
    assert lifetime.sweep_sockets() == [] and mine.is_dir()  # a running process's folder stays
