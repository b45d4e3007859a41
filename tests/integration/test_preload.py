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
from noloco_swarm.harness.preload import Forked, Preloader, fork_peer

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
    dht = preloader.spawn(["dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], dict(preloader.env), log)
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
