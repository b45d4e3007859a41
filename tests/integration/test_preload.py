"""Peers forked from the preloader: each is `noloco ARGS` in its own session, directory,
environment and log, its exit status comes back like subprocess.Popen's, and a peer whose
environment the preloaded modules would have read differently is not forked."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from noloco_swarm.harness.local import end_group
from noloco_swarm.harness.preload import Forked, Preloader, command, fork_peer, shared
from noloco_swarm.peer.net.lifetime import HUGE_PAGES, ONE_ARENA, allocator_env

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def preloader() -> Preloader:
    ours = Preloader()
    yield ours
    ours.close()
    assert ours.process.returncode == 0, "the preloader ends cleanly when its launcher closes it"


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_forked_command_writes_its_log_and_returns_its_exit_code(
    preloader: Preloader, tmp_path: Path
) -> None:
    env = dict(preloader.env)
    presets = preloader.spawn(["presets"], env, tmp_path / "presets.log")
    assert presets.wait(timeout=60) == 0 and presets.poll() == 0
    assert "tiny" in (tmp_path / "presets.log").read_text()
    bad = preloader.spawn(["keys", "--no-such-flag"], env, tmp_path / "bad.log")
    assert bad.wait(timeout=60) == 2
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "bad.log").read_text()


def test_a_forked_process_has_its_own_session_directory_and_environment(
    preloader: Preloader, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    env = preloader.env | {"NOLOCO_PRELOAD_TEST": "marked"}
    log = tmp_path / "dht.log"
    dht = preloader.spawn(["dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], env, log)
    try:
        wait_for(lambda: "/p2p/" in log.read_text() or dht.poll() is not None)
        assert dht.poll() is None, log.read_text()
        assert os.getsid(dht.pid) == dht.pid  # a session (and process group) of its own
        assert Path(f"/proc/{dht.pid}/cwd").resolve() == tmp_path.resolve()
        # ps shows the command it runs, not the preloader's.
        shown = Path(f"/proc/{dht.pid}/cmdline").read_text().replace("\0", " ")
        assert "-m noloco_swarm.cli.main dht --host-maddrs /ip4/127.0.0.1/tcp/0" in shown, shown
        # Its environment is the one asked for: the p2pd it started (exec'd) inherited it.
        wait_for(lambda: Path(f"/proc/{dht.pid}/task/{dht.pid}/children").read_text().split())
        daemon = Path(f"/proc/{dht.pid}/task/{dht.pid}/children").read_text().split()[0]
        assert b"NOLOCO_PRELOAD_TEST=marked" in Path(f"/proc/{daemon}/environ").read_bytes().split(b"\0")
        with pytest.raises(subprocess.TimeoutExpired):
            dht.wait(timeout=0.2)
    finally:
        end_group(dht)  # SIGTERM to its group (the DHT node and its p2pd), then SIGKILL
    assert dht.returncode is not None and dht.poll() == dht.returncode


def test_a_signal_that_ends_a_forked_process_comes_back_as_minus_its_number(
    preloader: Preloader, tmp_path: Path
) -> None:
    log = tmp_path / "dht.log"
    # Killed, it cannot remove its temporary files (multiprocessing's pymp-*): they go to tmp_path.
    env = dict(preloader.env) | {"TMPDIR": str(tmp_path)}
    dht = preloader.spawn(["dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], env, log)
    try:
        wait_for(lambda: "/p2p/" in log.read_text() or dht.poll() is not None)
        dht.kill()
        assert dht.wait(timeout=30) == -signal.SIGKILL
    finally:
        end_group(dht)


def test_only_an_environment_the_preloaded_modules_agree_with_is_forked(tmp_path: Path) -> None:
    """NOLOCO_* variables may differ (only our modules read them, and the preloader imports
    none); any other difference makes the launcher start the peer from scratch."""
    env = dict(os.environ)
    forked = fork_peer(["presets"], env | {"NOLOCO_FAILPOINTS": ""}, tmp_path / "a.log")
    assert isinstance(forked, Forked) and forked.wait(timeout=60) == 0
    assert fork_peer(["presets"], env | {"HIVEMIND_LOGLEVEL": "DEBUG"}, tmp_path / "b.log") is None
    assert not (tmp_path / "b.log").exists()


THP_SAID = "peer.release_memory = thp: huge pages on"


def test_a_thp_peer_starts_with_glibcs_huge_page_tunable_whether_started_or_forked(tmp_path: Path) -> None:
    """glibc reads GLIBC_TUNABLES once, as a process starts: `noloco join` with
    peer.release_memory=thp starts itself again with the tunable (once), and a launcher forks such
    a peer from a preloader that started with it, so the fork has its malloc."""
    argv = ["join", "--run-id", "thp-test", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    argv += ["--set", "peer.release_memory=thp", "--set", "peer.start_timeout=60", "--steps", "5"]
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    with (tmp_path / "a.log").open("wb") as out:
        started = subprocess.Popen(
            command(argv), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    forked = fork_peer(argv, allocator_env("thp", env), tmp_path / "b.log")
    try:
        assert isinstance(forked, Forked), "a thp peer is forked from a preloader that has its tunable"
        for peer, log in ((started, tmp_path / "a.log"), (forked, tmp_path / "b.log")):
            wait_for(lambda log=log, peer=peer: THP_SAID in log.read_text() or peer.poll() is not None)
            assert THP_SAID in log.read_text(), log.read_text()
        # The restarted process's own environment (its exec's) holds the tunable, as does the
        # preloader's that the other was forked from.
        preloader = shared(allocator_env("thp", env))
        # (glibc writes a NUL over each ':' of GLIBC_TUNABLES in the process's first copy of its
        # environment, the one /proc shows, as it parses them: read them back joined.)
        for pid in (started.pid, preloader.process.pid):
            tunables = f"\0GLIBC_TUNABLES={ONE_ARENA}:{HUGE_PAGES}\0".encode()
            assert tunables in b"\0" + Path(f"/proc/{pid}/environ").read_bytes().replace(
                b"\0glibc.", b":glibc."
            )
    finally:
        end_group(started)
        if forked is not None:
            end_group(forked)


def test_huge_pages_join_the_tunables_already_set() -> None:
    env = allocator_env(
        "thp", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2", "A": "b"}
    )
    assert env == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGE_PAGES}", "A": "b"}  # theirs kept
    assert allocator_env("thp", {"A": "b"}) == {"GLIBC_TUNABLES": f"{ONE_ARENA}:{HUGE_PAGES}", "A": "b"}
    assert allocator_env("map", {"A": "b"}) == {"A": "b"}
