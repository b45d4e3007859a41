"""Identity keys (peer/net/identity.py) and join tickets (peer/tickets.py), without a network."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from noloco_swarm.peer import tickets
from noloco_swarm.peer.net import identity
from noloco_swarm.peer.net.streams import Refused
from noloco_swarm.protocol import codec, records, rpc


def test_a_key_file_gives_the_peer_id_libp2p_derives_and_owns_its_subkeys(tmp_path: Path) -> None:
    key = tmp_path / "peer.key"
    identity.generate(key)
    me = identity.load(key)
    assert me.peer_id == PeerID.from_identity(key.read_bytes()).to_base58()
    assert identity.owner_of(me.owned("a/b/3")) == ("a/b/3", me.peer_id)
    assert identity.owner_of(me.mark) == ("", me.peer_id)
    for bad in ("a/b/3", "x[owner:not a key]", b"x", 7, "x[owner:ssh-rsa AAAA]"):
        assert identity.owner_of(bad) is None


def test_key_files_of_another_kind_are_refused_with_the_fix(tmp_path: Path) -> None:
    other = tmp_path / "ed25519.key"
    other.write_bytes(
        crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=b"\x01" * 64).SerializeToString()
    )
    with pytest.raises(identity.IdentityError, match="Ed25519 key; noloco needs RSA: move it away"):
        identity.load(other)
    junk = tmp_path / "junk.key"
    junk.write_bytes(b"\x00\x01junk")
    with pytest.raises(identity.IdentityError, match="not a libp2p private key"):
        identity.load(junk)


def test_identity_file_without_a_path_is_fresh_and_removed(tmp_path: Path) -> None:
    with identity.identity_file(None) as (path, fresh):
        assert fresh and Path(path).exists()
        first = identity.load(path).peer_id
    assert not Path(path).exists()
    kept = tmp_path / "sub" / "kept.key"
    with identity.identity_file(str(kept)) as (path, fresh):
        assert fresh and path == str(kept)
    with identity.identity_file(str(kept)) as (path, fresh):
        assert not fresh and identity.load(path).peer_id != first


def test_a_ticket_admits_only_its_peer_in_its_run_until_it_expires(tmp_path: Path) -> None:
    authority = tmp_path / "authority.key"
    identity.generate(authority)
    key = identity.load(authority).key
    public = tickets.public_key_text(key)
    now = time.time()
    ticket = tickets.issue(key, "run-1", "QmPeer", now + 60)
    tickets.write(ticket, tmp_path / "t")
    assert tickets.read(tmp_path / "t") == ticket
    tickets.check(ticket, public, "run-1", "QmPeer", now)
    refusals = {
        "is for peer": (public, "run-1", "QmOther", now),
        "is for run": (public, "run-2", "QmPeer", now),
        "expired": (public, "run-1", "QmPeer", now + 61),
    }
    for reason, args in refusals.items():
        with pytest.raises(tickets.TicketError, match=reason):
            tickets.check(ticket, *args)
    other = tmp_path / "other.key"
    identity.generate(other)
    with pytest.raises(tickets.TicketError, match="not signed by this run's authority"):
        tickets.check(ticket, tickets.public_key_text(identity.load(other).key), "run-1", "QmPeer", now)
    forged = records.JoinTicket("run-1", "QmPeer", now + 10_000, ticket.signature)  # a longer life
    with pytest.raises(tickets.TicketError, match="not signed"):
        tickets.check(forged, public, "run-1", "QmPeer", now)
    with pytest.raises(tickets.TicketError, match="not a join ticket"):
        tickets.read(authority)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.one_of(
        st.text(),
        st.binary(),
        st.integers(),
        st.builds(lambda a, k: f"{a}[owner:{k}]", st.text(), st.text()),
        st.builds(
            lambda a, k: f"{a}[owner:ssh-rsa {k}]", st.text(), st.text(alphabet="AB3Nza+/=", max_size=64)
        ),
    )
)
def test_any_subkey_gets_an_owner_or_none_and_never_an_exception(subkey: object) -> None:
    """A DHT subkey is a stranger's text: what fuzzing the directory's reader must show (the
    first version let cryptography's UnsupportedAlgorithm escape, and a read of the peers key
    with one such record would have crashed the peer)."""
    owned = identity.owner_of(subkey)
    assert owned is None or (isinstance(owned[0], str) and owned[1].startswith("Qm"))


def test_the_gate_admits_a_caller_once_its_ticketed_announcement_is_read(tmp_path: Path) -> None:
    """A joiner announces itself moments before it asks a donor for state: the donor's gate reads
    the directory again for an unknown caller (at most every REFRESH_PERIOD) and admits it then;
    status stays open, and a caller without a valid ticket is refused `no_ticket`."""
    authority = tmp_path / "authority.key"
    identity.generate(authority)
    key = identity.load(authority).key
    now = [1000.0]
    listed: list[records.PeerAnnouncement] = []
    reads = []

    async def refresh() -> None:
        reads.append(now[0])
        for a in listed:
            gate.admit_announced(a)

    gate = tickets.Gate(tickets.public_key_text(key), "run-1", refresh, clock=lambda: now[0])
    request = rpc.StateRequest("run-1", 1, 0)

    async def calls() -> list[str]:
        out = []
        for verb, header in (("rpc_status", rpc.StatusRequest("run-1")), ("rpc_fetch_state", request)):
            try:
                await gate.check("QmJoiner", verb, header)
                out.append("ok")
            except Refused as e:
                out.append(e.code)
        return out

    assert asyncio.run(calls()) == ["ok", "no_ticket"] and len(reads) == 1
    ticket = codec.encode(tickets.issue(key, "run-1", "QmJoiner", now[0] + 60))
    listed.append(records.PeerAnnouncement("run-1", "QmJoiner", 1, 2, (), "cpu", 0, ticket))
    assert asyncio.run(calls()) == ["ok", "no_ticket"] and len(reads) == 1  # read moments ago
    gate._last_refresh -= tickets.REFRESH_PERIOD
    assert asyncio.run(calls()) == ["ok", "ok"] and len(reads) == 2
    now[0] += 61  # its ticket expired
    assert not gate.admits("QmJoiner")
    forged = records.PeerAnnouncement("run-1", "QmOther", 1, 2, (), "cpu", 0, ticket)  # not its own
    assert not gate.admit_announced(forged) and not gate.admits("QmOther")
