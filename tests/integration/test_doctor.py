"""`noloco doctor` as a volunteer runs it: it names each broken part with a fix, and passes a healthy set-up."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
import pytest
from hivemind.utils import get_dht_time

from noloco_swarm.cli.flags import resolve_args
from noloco_swarm.cli.main import JOIN_DEFAULTS, parser
from noloco_swarm.peer.directory import MANIFEST_TTL, RunDirectory, manifest_key
from noloco_swarm.peer.net.node import start_dht
from noloco_swarm.protocol.records import RunManifest
from noloco_swarm.train.config import NetworkConfig
from tests.integration.helpers import p2pd_descendants, process_group, unread_output, unused_port

pytestmark = pytest.mark.integration
# A well-formed peer id whose node is nowhere near this machine.
SOMEONE = "QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"


def doctor(*flags: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "noloco_swarm.cli.main", "doctor", "--timeout", "15", *flags]
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=240)


@contextmanager
def listening() -> Iterator[int]:
    """A port this test holds with a listening socket, as another program would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def lines_of(out: str, prefix: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(prefix)]


def test_a_broken_setup_names_each_problem_and_its_fix(cache) -> None:
    before = p2pd_descendants()
    dead = f"/ip4/127.0.0.1/tcp/{unused_port()}/p2p/{SOMEONE}"
    with listening() as taken:
        result = doctor("--initial-peers", dead, "--port", str(taken), "--set", "inner.batch_size=200000")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    failed = lines_of(out, "FAIL")
    assert any(f"bootstrap {dead}" in line for line in failed), out
    assert any(f"port {taken}" in line and "not free" in line for line in failed), out
    assert any(line.startswith("FAIL  memory (cpu)") for line in failed), out
    assert len(failed) == 3, out
    lines = out.splitlines()
    for i, line in enumerate(lines):  # every failure is followed by its one-line fix
        if line.startswith("FAIL"):
            assert lines[i + 1].strip().startswith("fix: "), out
    assert lines_of(out, "ok    p2pd"), out
    assert "3 of" in out and "checks failed" in out
    assert p2pd_descendants() <= before, "doctor left a p2pd behind"


def test_a_healthy_setup_passes_and_a_used_identity_fails(cache, tmp_path) -> None:
    before = p2pd_descendants()
    key = tmp_path / "dht.key"
    argv = [sys.executable, "-m", "noloco_swarm.cli.main", "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    with process_group([*argv, "--identity", str(key)]) as (node, bootstrap):
        port = unused_port()
        result = doctor("--initial-peers", bootstrap, "--port", str(port), "--run-id", "doctor-test")
        twin = doctor("--initial-peers", bootstrap, "--identity", str(key))
        # Listening on one port but announcing another that nothing forwards: the bootstrap's
        # fresh connection to the announced address fails, as it would behind a NAT.
        hidden = unused_port()
        behind = doctor(
            "--initial-peers", bootstrap, "--port", str(unused_port()),
            "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{hidden}",
        )  # fmt: skip
        # The bootstrap's log, shown with any failure: the dial-back's other side is there.
        node_log = f"\n--- the bootstrap's log since it was up:\n{unread_output(node)}"
    out = result.stdout + result.stderr
    assert result.returncode == 0, out + node_log
    assert not lines_of(out, "FAIL"), out + node_log
    for name in (
        "config",
        "p2pd",
        f"bootstrap {bootstrap}",
        f"clock vs {bootstrap}",  # the bootstrap's DHT time, measured over a real DHT ping
        f"port {port}",
        f"dial-back from {bootstrap}",  # a fresh connection from the bootstrap reached our port
        "run doctor-test",
        "memory",
        "versions",
    ):
        assert lines_of(out, f"ok    {name}"), f"{name} not checked:\n{out}"
    assert "checks passed" in out
    # The bootstrap's own key: a second process with it would be refused by the swarm.
    twin_out = twin.stdout + twin.stderr
    assert twin.returncode == 1, twin_out
    assert [line for line in lines_of(twin_out, "FAIL") if "identity" in line], twin_out
    behind_out = behind.stdout + behind.stderr
    assert behind.returncode == 1, behind_out + node_log
    failed = lines_of(behind_out, "FAIL")
    from_node = failed[0].startswith(f"FAIL  dial-back from {bootstrap}") if failed else False
    assert len(failed) == 1 and from_node, behind_out + node_log
    assert f"/ip4/127.0.0.1/tcp/{hidden}" in behind_out, behind_out + node_log
    assert "forward TCP port" in behind_out, behind_out + node_log
    assert p2pd_descendants() <= before


def test_a_config_that_differs_from_the_runs_manifest_is_named(cache, tmp_path) -> None:
    """The run's manifest, published in a real DHT, against doctor's config: the same config
    passes, another seed fails with the differing key, and a manifest of another protocol version
    is named as such (a peer's directory would just not see it)."""
    argv = [sys.executable, "-m", "noloco_swarm.cli.main", "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    with process_group([*argv, "--identity", str(tmp_path / "dht.key")]) as (_, bootstrap):
        flags = ["--initial-peers", bootstrap, "--run-id", "doctor-run"]
        cfg = resolve_args(parser().parse_args(["doctor", *flags]), JOIN_DEFAULTS).cfg
        publisher = start_dht(
            NetworkConfig(initial_peers=(bootstrap,), host_maddrs=("/ip4/127.0.0.1/tcp/0",))
        )
        try:
            RunDirectory(publisher, "doctor-run").publish_manifest(
                RunManifest.create("doctor-run", cfg.manifest())
            )
            same = doctor(*flags)
            other = doctor(*flags, "--seed", "7")
            # A manifest written by a client of another protocol version, stored later: it wins.
            alien = msgpack.packb({"v": 99, "t": "manifest", "b": {}}, use_bin_type=True)
            assert publisher.store(
                manifest_key("doctor-run"),
                alien,
                get_dht_time() + MANIFEST_TTL + 600,
                subkey=publisher.identity.mark,  # the creator's own record, replaced
            )
            newer = doctor(*flags)
        finally:
            publisher.shutdown()
    out = same.stdout + same.stderr
    assert same.returncode == 0 and lines_of(out, "ok    run doctor-run: your config matches"), out
    out = other.stdout + other.stderr
    assert other.returncode == 1, out
    failed = lines_of(out, "FAIL")
    assert (
        len(failed) == 1 and failed[0].startswith("FAIL  run doctor-run") and "seed: 0 != 7" in failed[0]
    ), out
    out = newer.stdout + newer.stderr
    assert newer.returncode == 1, out
    failed = lines_of(out, "FAIL")
    assert len(failed) == 1 and "its manifest cannot be read: protocol version 99" in failed[0], out


def test_a_bootstrap_without_dial_back_leaves_it_unchecked_and_says_so(cache) -> None:
    """hivemind's own bootstrap tool answers DHT requests but offers no dial-back: doctor passes
    and says reachability was not checked, instead of failing or claiming it was."""
    exe = shutil.which("hivemind-dht", path=str(Path(sys.executable).parent))
    assert exe
    with process_group([exe, "--host_maddrs", "/ip4/127.0.0.1/tcp/0"]) as (_, bootstrap):
        result = doctor("--initial-peers", bootstrap, "--port", str(unused_port()))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert lines_of(out, "ok    dial-back: not checked: no answering bootstrap offers it"), out
