"""peer.release_memory: how a peer process hands freed memory back to the system (glibc)."""

from __future__ import annotations

import os
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


# In a child process started with or without glibc's huge-page tunable: which blocks get a
# mapping of their own after release_memory("thp") (glibc's mallinfo2 counts mapped blocks).
THP_CHILD = """
import ctypes
from noloco_swarm.peer.net.lifetime import release_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
assert release_memory("thp") is True

def mapped(nbytes):
    before = libc.mallinfo2().hblks
    block = libc.malloc(nbytes)
    after = libc.mallinfo2().hblks
    libc.free(block)
    return after > before

print(mapped(3 << 20), mapped(6 << 20))
"""


@pytest.mark.parametrize(
    ("tunables", "expected"),
    [
        ("glibc.malloc.hugetlb=1", "False True"),  # 3 MiB stays in the heap, 6 MiB is mapped
        ("", "True True"),  # no huge pages: as map, both are mapped
    ],
)
def test_thp_maps_blocks_of_4_mib_on_huge_pages_and_is_map_without_them(tunables: str, expected: str) -> None:
    from noloco_swarm.peer.net.lifetime import huge_pages_unavailable

    if tunables and (why := huge_pages_unavailable()):
        pytest.skip(f"glibc's huge pages do not work here: {why}")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    done = subprocess.run(
        [sys.executable, "-c", THP_CHILD],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env | ({"GLIBC_TUNABLES": tunables} if tunables else {}),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected
