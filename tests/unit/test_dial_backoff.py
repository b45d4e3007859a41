"""peer/net/transport.py's reading of p2pd's dial errors (is a failed dial only our daemon's backoff?)
and its writing of the addresses it dials."""

from __future__ import annotations

import pytest
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.utils.multiaddr import Multiaddr

from noloco_swarm.peer.net.transport import backed_off, dialable

PEER = "QmQrGZewzWBnDSPgFwwRjBunmFzhhkzaMqhKRXwsMSuhcT"
PEER_V1 = "12D3KooWM2M5LvcymiCFvAtxJ6ijjD8dbER7LftJmbita9bE96t6"
HEAD = f"Connect failed. msg=failed to dial: failed to dial {PEER}: all dials failed\n"


@pytest.mark.parametrize(
    ("lines", "only_backoff"),
    [
        (["  * [/ip4/127.0.0.1/tcp/46041] dial backoff"], True),  # as CI's failed run had it
        (["  * [/ip4/127.0.0.1/tcp/1] dial backoff", "  * [/ip4/10.0.0.2/tcp/2] dial backoff"], True),
        (["  * [/ip4/127.0.0.1/tcp/1] dial tcp4 127.0.0.1:1: connect: connection refused"], False),
        (["  * [/ip4/127.0.0.1/tcp/1] dial backoff", "  * [/ip4/10.0.0.2/tcp/2] i/o timeout"], False),
        ([], False),  # "all dials failed" with no address: nothing says backoff
    ],
)
def test_only_a_dial_refused_for_backoff_at_every_address_is_backoff(
    lines: list[str], only_backoff: bool
) -> None:
    assert backed_off(ControlFailure(HEAD + "\n".join(lines))) is only_backoff


def test_an_older_daemons_bare_backoff_and_other_errors() -> None:
    assert backed_off(ControlFailure("Connect failed. msg=dial backoff"))
    assert not backed_off(ControlFailure("Connect failed. msg=no addresses"))
    assert not backed_off(ControlFailure("stream reset"))


def test_dialable_writes_every_p2p_part_as_p2pd_reads_it() -> None:
    relay, target = "12D3KooWBURgXPuRfFiNWgL8Uw6Gkqu5p2GUhtxtT1H2HjTpES9o", PEER_V1
    plain = dialable(Multiaddr(f"/ip4/1.2.3.4/tcp/5/p2p/{target}"), target)
    assert plain.to_bytes() == Multiaddr("/ip4/1.2.3.4/tcp/5").to_bytes()  # the peer id goes apart
    circuit = dialable(Multiaddr(f"/ip4/1.2.3.4/tcp/5/p2p/{relay}/p2p-circuit/p2p/{target}"), target)
    digest = PeerID.from_base58(relay).to_bytes()  # a 38-byte identity multihash
    # code 421 (varint a5 03), the multihash's length (38 = 0x26), the multihash; then p2p-circuit
    expected = (
        Multiaddr("/ip4/1.2.3.4/tcp/5").to_bytes() + bytes.fromhex("a50326") + digest + bytes.fromhex("a202")
    )
    assert circuit.to_bytes() == expected
    assert str(circuit) == f"/ip4/1.2.3.4/tcp/5/p2p/{relay}/p2p-circuit"
