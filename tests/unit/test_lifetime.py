"""peer/lifetime.py: an orphaned peer is gone in seconds, with its children, whatever hangs."""

from __future__ import annotations

import subprocess
import sys

from tests.integration.helpers import alive

# A process with a child (standing in for p2pd) whose shutdown hangs (standing in for a gone
# report waiting on dying DHT nodes): exit_within must end both.
HUNG = """
import subprocess, sys, time
from noloco_swarm.peer.lifetime import exit_within
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
