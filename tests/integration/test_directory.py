"""The run directory on a real hivemind DHT, entered through hivemind's own `hivemind-dht` CLI."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hivemind import DHT
from hivemind.utils import get_dht_time

from noloco_swarm.peer import directory
from noloco_swarm.peer.directory import ManifestMismatchError, RunDirectory, gone_key, peers_key
from noloco_swarm.peer.node import NetworkConfig, reachability, start_dht
from noloco_swarm.protocol import messages
from noloco_swarm.protocol.membership import Listing, MembershipView, next_view
from noloco_swarm.train.config import RunConfig
from tests.integration.helpers import p2pd_descendants, process_group

pytestmark = pytest.mark.integration
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[str]:
    """hivemind's own bootstrap CLI: we must interoperate with the ecosystem, not only ourselves."""
    exe = shutil.which("hivemind-dht", path=str(Path(sys.executable).parent))
    assert exe, "hivemind-dht is installed with hivemind"
    with process_group([exe, "--host_maddrs", *LOOPBACK]) as (_, maddr):
        yield maddr


@pytest.fixture
def two_peers(bootstrap: str) -> Iterator[tuple[DHT, DHT]]:
    before = p2pd_descendants()
    a = start_dht(NetworkConfig(initial_peers=(bootstrap,), host_maddrs=LOOPBACK))
    b = None
    try:
        b = start_dht(NetworkConfig(initial_peers=(bootstrap,), host_maddrs=LOOPBACK))
        yield a, b
    finally:
        for dht in (a, b):
            if dht is not None:
                dht.shutdown()
    time.sleep(0.5)
    assert p2pd_descendants() <= before, "a DHT left its p2pd running"


def manifest(run_id: str, **overrides: object) -> messages.RunManifest:
    return messages.RunManifest.create(run_id, RunConfig.create("tiny", "noloco", **overrides).manifest())


def test_manifest_publish_join_and_mismatch(two_peers: tuple[DHT, DHT]) -> None:
    a, b = two_peers
    mine = manifest("run-m")
    starter, joiner = RunDirectory(a, "run-m"), RunDirectory(b, "run-m")
    with pytest.raises(LookupError, match="--new-run"):
        joiner.join_manifest(mine, new_run=False)
    assert starter.join_manifest(mine, new_run=True) == mine
    assert joiner.join_manifest(mine, new_run=False) == mine
    other = manifest("run-m", outer={"inner_steps": 20})
    with pytest.raises(ManifestMismatchError, match=r"outer\.inner_steps: 50 != 20"):
        joiner.join_manifest(other, new_run=True)


def test_announcements_build_the_same_view_everywhere(two_peers: tuple[DHT, DHT]) -> None:
    a, b = two_peers
    da, db = RunDirectory(a, "run-v"), RunDirectory(b, "run-v")
    assert da.announce(messages.PeerAnnouncement("run-v", str(a.peer_id), 1, 0))
    assert db.announce(messages.PeerAnnouncement("run-v", str(b.peer_id), 0, 0))
    assert db.announce(messages.PeerAnnouncement("run-v", "late-peer", 0, 3))
    # garbage under the peers key, and a record whose subkey lies about its peer id
    a.store(peers_key("run-v"), b"\x00garbage", get_dht_time() + 30, subkey="mallory")
    a.store(
        peers_key("run-v"),
        messages.encode(messages.PeerAnnouncement("run-v", "someone-else", 0, 0)),
        get_dht_time() + 30,
        subkey="liar",
    )

    def views(directory: RunDirectory) -> list[MembershipView]:
        """Rounds 0..3 as a peer builds them: round 0 from its announcements, then next_view."""
        listed = directory.read_peers().announcements
        pairs = [(x.peer_id, x.stage) for x in listed if x.joined_round == 0]
        out = [MembershipView.from_announcements(0, 2, pairs)]
        listings = [Listing(x.peer_id, x.stage, x.joined_round) for x in listed]
        while len(out) < 4:
            out.append(next_view(out[-1], listings, directory.read_gone(members=out[-1].members())))
        return out

    views_a, views_b = views(da), views(db)
    assert views_a == views_b
    assert views_a[2].stages == ((str(b.peer_id),), (str(a.peer_id),))  # late-peer joins at round 3
    assert "late-peer" in views_a[3].stages[0]
    assert da.read_peers().malformed == 2


def test_gone_reports_are_shared_and_only_members_count(two_peers: tuple[DHT, DHT]) -> None:
    a, b = two_peers
    da, db = RunDirectory(a, "run-g"), RunDirectory(b, "run-g")
    assert da.report_gone(messages.GoneReport("run-g", "crashed", str(a.peer_id), 4))
    # another member saw the same death a round later: both reports stay, neither replaces the other
    assert db.report_gone(messages.GoneReport("run-g", "crashed", str(b.peer_id), 5))
    assert da.report_gone(messages.GoneReport("run-g", "framed", "stranger", 4))
    a.store(gone_key("run-g"), b"\x01junk", get_dht_time() + 30, subkey="junk")
    # a report stored under a subkey that is not its own (peer/reporter/round) is not trusted
    lie = messages.GoneReport("run-g", "honest", str(a.peer_id), 4)
    a.store(gone_key("run-g"), messages.encode(lie), get_dht_time() + 30, subkey="honest")
    members = {str(a.peer_id), str(b.peer_id), "crashed"}
    assert db.read_gone() == {"crashed": {4, 5}, "framed": {4}}
    assert db.read_gone(members=members) == da.read_gone(members=members) == {"crashed": {4, 5}}
    assert db.read_peers().announcements == []  # reports are not announcements


def test_announcements_expire(two_peers: tuple[DHT, DHT]) -> None:
    a, b = two_peers
    short = RunDirectory(a, "run-x", ttl=2.0)
    assert short.announce(messages.PeerAnnouncement("run-x", "ephemeral", 0, 0))
    assert [x.peer_id for x in RunDirectory(b, "run-x").read_peers().announcements] == ["ephemeral"]
    time.sleep(3.0)
    assert RunDirectory(b, "run-x").read_peers().announcements == []


def test_reachability_reports_loopback(two_peers: tuple[DHT, DHT]) -> None:
    lines = reachability([str(a) for a in two_peers[0].get_visible_maddrs()])
    assert any("loopback only" in line for line in lines)
    assert "cannot reach" in lines[-1]


def test_noloco_dht_prints_address_and_keeps_identity(tmp_path: Path, bootstrap: str) -> None:
    exe = str(Path(sys.executable).parent / "noloco")
    key = tmp_path / "dht.key"
    address = tmp_path / "bootstrap.addr"
    argv = [exe, "dht", "--host-maddrs", *LOOPBACK, "--identity", str(key), "--address-file", str(address)]
    with process_group(argv) as (_, first):
        assert address.read_text().strip() == first
        # our bootstrap node serves hivemind's plain DHT clients too
        client = start_dht(NetworkConfig(initial_peers=(first,), host_maddrs=LOOPBACK))
        try:
            assert client.store("probe", b"ok", get_dht_time() + 30)
        finally:
            client.shutdown()
    assert key.exists()
    with process_group(argv) as (_, second):
        assert second.rsplit("/p2p/", 1)[1] == first.rsplit("/p2p/", 1)[1]  # same peer id after restart


def test_a_dht_call_gives_up_at_its_deadline_when_the_dht_process_cannot_answer(
    two_peers: tuple[DHT, DHT], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call pending when the DHT process stops answering (frozen, or shut down under it) fails
    with TimeoutError at the deadline instead of holding its worker thread, and the peer, forever."""
    a, _ = two_peers
    found = RunDirectory(a, "run-deadline")
    monkeypatch.setattr(directory, "DHT_CALL_TIMEOUT", 0.5)
    assert found.read_peers().announcements == []  # it answers while it runs
    os.kill(a.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not answer"):
            found.read_peers()
        assert time.monotonic() - started < 30  # the deadline, not hivemind's own waits
    finally:
        os.kill(a.pid, signal.SIGCONT)
    assert found.read_peers().announcements == []  # and the DHT still serves once it runs again


def test_rebootstrap_pings_the_entry_points_again(two_peers: tuple[DHT, DHT], bootstrap: str) -> None:
    """After a cut a DHT node may know nobody; rebootstrap asks the run's entry points again and
    counts those that answer."""
    a, b = two_peers
    found = RunDirectory(a, "run-reboot")
    entry = bootstrap.rsplit("/p2p/", 1)[1]
    assert found.rebootstrap([entry]) == 1
    assert found.rebootstrap([entry, str(b.peer_id)]) == 2
