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
from noloco_swarm.peer.directory import (
    ManifestMismatchError,
    RunDirectory,
    bucket_key,
    gone_key,
    manifest_key,
    peers_key,
)
from noloco_swarm.peer.net.node import NetworkConfig, reachability, start_dht
from noloco_swarm.protocol import codec, records
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


@pytest.fixture
def stranger(bootstrap: str) -> Iterator[DHT]:
    """A third DHT node with a key of its own: no member of any run below."""
    node = start_dht(NetworkConfig(initial_peers=(bootstrap,), host_maddrs=LOOPBACK))
    try:
        yield node
    finally:
        node.shutdown()


def me(dht: DHT) -> str:
    return str(dht.peer_id)


def manifest(run_id: str, **overrides: object) -> records.RunManifest:
    return records.RunManifest.create(run_id, RunConfig.create("tiny", "noloco", **overrides).manifest())


def test_manifest_publish_join_and_mismatch(two_peers: tuple[DHT, DHT], stranger: DHT) -> None:
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
    # A stranger stores another config under the run's id: it cannot replace the creator's record
    # (the subkey is the creator's, signed), only add its own, and joiners of the run still join.
    RunDirectory(stranger, "run-m").publish_manifest(other)
    assert [author for author, _ in joiner.manifests()] == sorted([me(a), me(stranger)])
    assert joiner.join_manifest(mine, new_run=False) == mine
    # Under the creator's mark, unsigned: our nodes refuse it (hivemind's bootstrap node here
    # checks nothing, so the store may "succeed" there) and every reader checks every answer.
    stranger.store(manifest_key("run-m"), codec.encode(other), get_dht_time() + 600, subkey=a.identity.mark)
    assert dict(joiner.manifests())[me(a)] == mine


def test_announcements_build_the_same_view_everywhere(two_peers: tuple[DHT, DHT], stranger: DHT) -> None:
    a, b = two_peers
    da, db, late = RunDirectory(a, "run-v"), RunDirectory(b, "run-v"), RunDirectory(stranger, "run-v")
    assert da.announce(records.PeerAnnouncement("run-v", me(a), 1, 0))
    assert db.announce(records.PeerAnnouncement("run-v", me(b), 0, 0))
    assert late.announce(records.PeerAnnouncement("run-v", me(stranger), 0, 3))
    with pytest.raises(ValueError, match="announces only itself"):
        da.announce(records.PeerAnnouncement("run-v", me(b), 0, 0))
    # Garbage, and forged announcements of b (far round, an hour's expiry, as the attack in issue
    # 10): unsigned under b's plain id; signed by a but speaking for b; under b's mark, unsigned.
    a.store(peers_key("run-v"), b"\x00garbage", get_dht_time() + 30, subkey=a.identity.owned("mallory"))
    forged = codec.encode(records.PeerAnnouncement("run-v", me(b), 0, 1000))
    assert a.store(peers_key("run-v"), forged, get_dht_time() + 3600, subkey=me(b))
    assert a.store(peers_key("run-v"), forged, get_dht_time() + 3600, subkey=a.identity.owned(me(b)))
    a.store(peers_key("run-v"), forged, get_dht_time() + 3600, subkey=b.identity.owned(me(b)))  # see above

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
    assert views_a[2].stages == ((me(b),), (me(a),))  # the third node joins at round 3
    assert me(stranger) in views_a[3].stages[0]
    assert me(b) in views_a[3].stages[0], "a forged announcement took b out"
    assert da.read_peers().malformed == 3


def test_gone_reports_are_shared_and_only_members_count(two_peers: tuple[DHT, DHT], stranger: DHT) -> None:
    a, b = two_peers
    da, db, ds = RunDirectory(a, "run-g"), RunDirectory(b, "run-g"), RunDirectory(stranger, "run-g")
    assert da.report_gone(records.GoneReport("run-g", "crashed", me(a), 4))
    # another member saw the same death a round later: both reports stay, neither replaces the other
    assert db.report_gone(records.GoneReport("run-g", "crashed", me(b), 5))
    with pytest.raises(ValueError, match="only as itself"):
        da.report_gone(records.GoneReport("run-g", "framed", me(b), 4))
    # A stranger reports b in its own name, then in a's: unsigned, under its own mark, under a's.
    assert ds.report_gone(records.GoneReport("run-g", me(b), me(stranger), 4))
    lie = records.GoneReport("run-g", me(b), me(a), 4)
    base = f"{me(b)}/{me(a)}/4"
    key = gone_key("run-g", me(b))  # a peer's reports are stored under a key of its own
    assert stranger.store(key, codec.encode(lie), get_dht_time() + 30, subkey=base)
    owned = stranger.identity.owned(base)
    assert stranger.store(key, codec.encode(lie), get_dht_time() + 30, subkey=owned)
    stranger.store(key, codec.encode(lie), get_dht_time() + 30, subkey=a.identity.owned(base))
    a.store(gone_key("run-g", "crashed"), b"\x01junk", get_dht_time() + 30, subkey=a.identity.owned("junk"))
    # Under the key of another peer than the one it names, a report of b counts for nobody.
    misfiled = records.GoneReport("run-g", me(b), me(a), 6)
    assert a.store(
        gone_key("run-g", "crashed"),
        codec.encode(misfiled),
        get_dht_time() + 30,
        subkey=a.identity.owned(f"{me(b)}/{me(a)}/6"),
    )
    members = {me(a), me(b), "crashed"}
    everyone = members | {me(stranger)}  # the stranger's report counts once it is a member, in its name
    # ... and b, judged gone from round 4 on (after crashed), no longer counts for crashed in
    # round 5 (credible_gone since 2026-12-07)
    assert db.read_gone(everyone) == {"crashed": {4}, me(b): {4}}
    assert db.read_gone(members) == da.read_gone(members) == {"crashed": {4, 5}}
    reports = sorted([("crashed", me(a), 4), ("crashed", me(b), 5), (me(b), me(stranger), 4)])
    assert sorted(db.read_reports(["crashed", me(b)])) == reports
    crashed = [r for r in reports if r[0] == "crashed"]  # and not the report misfiled under its key
    assert sorted(db.read_reports(["crashed"])) == crashed
    assert db.read_peers().announcements == []  # reports are not announcements


def test_a_whole_read_finds_every_bucket_and_the_latest_record_of_each_peer(
    two_peers: tuple[DHT, DHT], stranger: DHT
) -> None:
    """Heartbeats go to the roster (no view) or to the key of the writer's bucket; a reader reads
    the roster and the buckets in waves (0-1, 2-5, 6-13, ...) while a wave's last two hold a record."""
    a, b = two_peers
    da, db, ds = RunDirectory(a, "run-b"), RunDirectory(b, "run-b"), RunDirectory(stranger, "run-b")
    assert da.announce(records.PeerAnnouncement("run-b", me(a), 0, 2, step=0))  # a joiner: the roster
    assert db.announce(records.PeerAnnouncement("run-b", me(b), 1, 0, step=7), bucket=5)
    assert ds.announce(records.PeerAnnouncement("run-b", me(stranger), 0, 0, step=7), bucket=13)
    time.sleep(0.05)  # a's next heartbeat expires later than its first
    # a entered: its next heartbeat goes to its bucket, while the roster still holds the first
    assert da.announce(records.PeerAnnouncement("run-b", me(a), 0, 2, step=100), bucket=0)
    with pytest.raises(ValueError, match="bucket"):
        da.announce(records.PeerAnnouncement("run-b", me(a), 0, 2), bucket=-1)
    a.store(bucket_key("run-b", 1), b"\x00garbage", get_dht_time() + 30, subkey=a.identity.owned("x"))
    for reader in (da, db):
        readout = reader.read_peers()
        assert [(x.peer_id, x.step) for x in readout.announcements] == sorted(
            [(me(a), 100), (me(b), 7), (me(stranger), 7)]
        )
        assert readout.malformed == 1
    # roster + 2 buckets, then 4 (bucket 5 holds b), then 8 (bucket 13, stranger), then 16 (empty)
    before = db.calls.reads
    db.read_peers()
    assert db.calls.reads - before == 1 + 2 + 4 + 8 + 16


def test_announcements_expire(two_peers: tuple[DHT, DHT]) -> None:
    a, b = two_peers
    short = RunDirectory(a, "run-x", ttl=2.0)
    assert short.announce(records.PeerAnnouncement("run-x", me(a), 0, 0))
    assert [x.peer_id for x in RunDirectory(b, "run-x").read_peers().announcements] == [me(a)]
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
    # And the DHT still serves once it runs again (at the usual deadline: a process just woken
    # on a loaded machine may take more than half a second to answer its first call).
    monkeypatch.undo()
    assert found.read_peers().announcements == []


def test_rebootstrap_pings_the_entry_points_again(two_peers: tuple[DHT, DHT], bootstrap: str) -> None:
    """After a cut a DHT node may know nobody; rebootstrap asks the run's entry points again and
    counts those that answer."""
    a, b = two_peers
    found = RunDirectory(a, "run-reboot")
    entry = bootstrap.rsplit("/p2p/", 1)[1]
    assert found.rebootstrap([entry]) == 1
    assert found.rebootstrap([entry, str(b.peer_id)]) == 2


def test_a_directory_over_a_node_on_the_peers_own_loop(bootstrap: str, two_peers: tuple[DHT, DHT]) -> None:
    """A peer's DHT node runs on its event loop (LoopDHT): its directory, called from worker
    threads as the peer calls it, reads what hivemind's forked DHT nodes store and the other
    way round; a call from the loop's own thread is refused at once, not left to wait on itself."""
    import asyncio

    from hivemind.p2p import P2P

    from noloco_swarm.peer.net import identity
    from noloco_swarm.peer.net.node import LoopDHT

    a, _ = two_peers
    theirs = RunDirectory(a, "loop-run")
    theirs.announce(records.PeerAnnouncement("loop-run", a.identity.peer_id, 0, 0, ("/ip4/1.2.3.4/tcp/1",)))

    async def main() -> tuple[set[str], set[str]]:
        with identity.identity_file(None) as (path, _):  # a fresh key, as a new peer's
            me = identity.load(path)
            p2p = await P2P.create(host_maddrs=list(LOOPBACK), identity_path=path, initial_peers=[bootstrap])
        try:
            dht = await LoopDHT.create(p2p, [bootstrap], me)
            try:
                ours = RunDirectory(dht, "loop-run")
                announcement = records.PeerAnnouncement("loop-run", me.peer_id, 1, 0, ("/ip4/1.2.3.5/tcp/2",))
                assert await asyncio.to_thread(ours.announce, announcement)
                seen_by_us = {x.peer_id for x in (await asyncio.to_thread(ours.read_peers)).announcements}
                seen_by_them = {x.peer_id for x in (await asyncio.to_thread(theirs.read_peers)).announcements}
                with pytest.raises(RuntimeError, match="would wait on itself"):
                    ours.read_peers()

                # A call still pending when the node shuts down ends then, not at its timeout (a
                # stopping peer's threads held up its exit so), and a later call is refused.
                async def forever(_dht: LoopDHT, _node: object) -> None:
                    await asyncio.Event().wait()

                pending = await asyncio.to_thread(dht.run_coroutine, forever, True)
                await dht.shutdown()
                assert pending.cancelled()
                with pytest.raises(RuntimeError, match="shut down"):
                    await asyncio.to_thread(ours.read_peers)
                return seen_by_us, seen_by_them
            finally:
                await dht.shutdown()
        finally:
            await p2p.shutdown()

    seen_by_us, seen_by_them = asyncio.run(main())
    assert a.identity.peer_id in seen_by_us and len(seen_by_us) == 2
    assert seen_by_us == seen_by_them
