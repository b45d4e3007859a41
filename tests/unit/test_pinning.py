"""Peers pinned to CPUs: the CPU-list syntax of peer.cpus, how `noloco local` shares the CPUs
among its peers, and that a pinned process's threads and children (torch's pool, p2pd) stay there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from noloco_swarm.harness.local import cpu_share
from noloco_swarm.peer.net.lifetime import pin_to_cpus
from noloco_swarm.train.config import PeerConfig, format_cpus, parse_cpus


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("", []), ("0", [0]), ("0-3,8", [0, 1, 2, 3, 8]), (" 5 , 1-2,2", [1, 2, 5]), ("3-3", [3])],
)
def test_cpu_lists_read_as_linux_writes_them(text: str, cpus: list[int]) -> None:
    assert parse_cpus(text) == cpus


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a", "'a' is not a CPU number or a range"),
        ("1-", "'1-' is not a CPU number"),
        ("-1", "'-1' is not a CPU number"),
        ("0,2.5", "'2.5' is not a CPU number"),
        ("3-1", "the range '3-1' ends before it starts"),
        ("0-99999999999", "'0-99999999999' names a CPU beyond Linux's 8192"),
        (" , ", "names no CPU"),
    ],
)
def test_a_malformed_cpu_list_is_refused_with_the_part_at_fault(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"peer\.cpus") as refused:
        PeerConfig(cpus=text)
    assert message in str(refused.value)


@given(st.sets(st.integers(0, 300), max_size=40))
def test_a_written_cpu_list_reads_back_as_the_same_cpus(cpus: set[int]) -> None:
    text = format_cpus(sorted(cpus))
    assert parse_cpus(text) == sorted(cpus)
    assert len(text.split(",")) <= max(1, len(cpus))  # runs of neighbours are written as ranges


def test_cpus_are_shared_in_blocks_or_in_turn() -> None:
    # 2x2 on 2 CPUs: a stage's two replicas on different CPUs, each CPU one replica of each stage.
    assert [cpu_share([0, 1], 4, i) for i in range(4)] == [[0], [1], [0], [1]]
    # 4 peers on 8 CPUs: a block of 2 each; a fifth peer (a joiner) shares the first block.
    assert [cpu_share(list(range(8)), 4, i) for i in range(5)] == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1]]
    # Stages of 3 and 2 replicas on CPUs 4 and 6 (a restricted set): 3 peers on one, 2 on the other.
    assert [cpu_share([4, 6], 5, i) for i in range(5)] == [[4], [6], [4], [6], [4]]
    with pytest.raises(ValueError, match="at least one CPU and one peer"):
        cpu_share([], 2, 0)


@given(st.lists(st.integers(0, 64), min_size=1, max_size=16, unique=True), st.integers(1, 24))
def test_every_peer_gets_cpus_and_no_cpu_carries_more_than_its_share(cpus: list[int], peers: int) -> None:
    cpus = sorted(cpus)
    shares = [cpu_share(cpus, peers, i) for i in range(peers)]
    assert all(share and set(share) <= set(cpus) for share in shares)
    load = [sum(cpu in share for share in shares) for cpu in cpus]
    if len(cpus) >= peers:  # blocks: disjoint and of one size
        assert max(load) == 1 and len({len(share) for share in shares}) == 1
    else:  # in turn: every CPU used, the loads within one peer of each other
        assert min(load) >= 1 and max(load) - min(load) <= 1


# A process with a thread started before it pins itself, one started after, and a child started
# after: all three must run on the pinned CPU only.
PINNED = """
import os, subprocess, sys, threading
from noloco_swarm.peer.net.lifetime import pin_to_cpus
cpu, done = int(sys.argv[1]), threading.Event()
early = threading.Thread(target=done.wait)
early.start()
pin_to_cpus([cpu])
late = threading.Thread(target=done.wait)
late.start()
tasks = sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")})
child = subprocess.run(
    [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
    check=True, capture_output=True, text=True,
).stdout.strip()
done.set()
print(len(os.listdir("/proc/self/task")), tasks, child)
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_a_pinned_process_keeps_its_threads_and_children_on_its_cpus() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one CPU only: pinning to it cannot be told from not pinning")
    cpu = allowed[-1]
    done = subprocess.run(
        [sys.executable, "-c", PINNED, str(cpu)], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(" ", 1)[1].strip() == f"[({cpu},)] [{cpu}]", done.stdout
    assert int(done.stdout.split()[0]) >= 3  # the main thread and both others were looked at


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_pinning_to_a_cpu_this_process_may_not_use_is_refused_and_changes_nothing() -> None:
    before = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match=r"names CPUs \[4095\] that this process may not run on"):
        pin_to_cpus([min(before), 4095])
    assert os.sched_getaffinity(0) == before
