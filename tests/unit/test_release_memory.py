"""peer.release_memory: how a peer process hands freed memory back to the system (glibc)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from noloco_swarm.peer.net.lifetime import release_memory, trim_heap

# In a child process: mallopt changes how the whole process allocates.
CHILD = """
from noloco_swarm.peer.net.lifetime import release_memory
assert release_memory("map") is True  # glibc's mallopt said yes
print("ok")
"""


def test_map_sets_glibc_s_threshold_and_the_others_set_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert release_memory("off") is False and release_memory("trim") is False
    trim_heap()  # callable at any time, from any thread


def test_an_unknown_mode_is_refused_with_the_choices() -> None:
    from noloco_swarm.train.config import PeerConfig

    with pytest.raises(ValueError, match="map, thp, trim, off"):
        PeerConfig(release_memory="sometimes")
