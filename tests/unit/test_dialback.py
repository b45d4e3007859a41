"""Dial-back requests are checked before anything is dialled: only the caller's own IP, only TCP,
a bounded list; a malformed request gets an answer that says so, and never an exception."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from noloco_swarm.peer.net import dialback

SEEN = "/ip4/203.0.113.7/tcp/40123"  # where the request came from (its source port is not ours)
PEER = "QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"


def test_only_tcp_addresses_on_the_callers_own_ip_are_dialled() -> None:
    request = {
        "addrs": [
            "/ip4/203.0.113.7/tcp/31337",
            f"/ip4/203.0.113.7/tcp/31338/p2p/{PEER}",  # its own id at the end: dialled without it
            "/ip4/198.51.100.1/tcp/31337",  # someone else's machine: never
            "/ip4/203.0.113.7/udp/31337/quic",  # not plain TCP
            "not a multiaddr",
        ]
    }
    assert dialback.addresses_to_dial(request, SEEN) == [
        "/ip4/203.0.113.7/tcp/31337",
        "/ip4/203.0.113.7/tcp/31338",
    ]
    v6 = dialback.addresses_to_dial({"addrs": ["/ip6/2001:db8::1/tcp/4001"]}, "/ip6/2001:db8::1/tcp/5")
    assert v6 == ["/ip6/2001:db8::1/tcp/4001"]


@pytest.mark.parametrize(
    "request_",
    [
        None,
        [],
        {"addrs": "/ip4/203.0.113.7/tcp/1"},
        {"addrs": []},
        {"addrs": [7]},
        {"addrs": ["/ip4/203.0.113.7/tcp/1"] * (dialback.MAX_ADDRS + 1)},
        {"addrs": ["/ip4/198.51.100.1/tcp/1"]},
        {"addrs": ["/ip4/203.0.113.7/tcp/0"]},
    ],
)
def test_a_request_with_nothing_to_dial_is_refused_with_a_reason(request_: Any) -> None:
    with pytest.raises(ValueError, match=r"expected|none of the addresses"):
        dialback.addresses_to_dial(request_, SEEN)


@dataclass
class Info:
    peer_id: PeerID
    addr: Multiaddr


class Writer:
    def __init__(self) -> None:
        self.data, self.closed = b"", False

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    "sent",
    [b"", b"{not json\n", b'{"addrs": ["/ip4/198.51.100.1/tcp/1"]}\n', b"\xff\xfe\n", b"x" * 70000],
)
def test_a_malformed_request_gets_an_answer_not_an_error(sent: bytes) -> None:
    writer = asyncio.run(serve(sent, dialback.DialBack()))
    answer = json.loads(writer.data)
    assert answer["ok"] is False and answer["dialed"] == [] and answer["detail"].startswith("refused: ")
    assert answer["tested"] is True  # a verdict on the request, not a failure of the bootstrap's
    assert writer.closed


async def serve(sent: bytes, node: dialback.DialBack) -> Writer:
    """One request through `node`'s handler, as its daemon would hand it over; what it wrote."""
    reader = asyncio.StreamReader()
    reader.feed_data(sent)
    reader.feed_eof()
    writer = Writer()
    info = Info(PeerID.from_base58(PEER), Multiaddr(SEEN))
    await node.serve(info, reader, writer)  # type: ignore[arg-type]
    return writer


def test_a_bootstrap_whose_dialer_cannot_start_still_answers_and_says_it_did_not_test(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its dialer's p2pd cannot listen (a socket path longer than unix sockets allow): the asker
    gets an answer naming that, marked untested, not a closed stream. Asked again at once, the
    rate limit answers, also untested: neither is a verdict on the asker's reachability."""
    from hivemind.p2p import P2P

    from noloco_swarm.peer.net import lifetime

    monkeypatch.setattr(P2P, "_UNIX_SOCKET_PREFIX", P2P._UNIX_SOCKET_PREFIX)  # start_p2p sets it
    too_long = tmp_path / ("d" * 120)
    too_long.mkdir()
    monkeypatch.setattr(lifetime, "SOCKETS", too_long)
    node = dialback.DialBack()
    request = json.dumps({"addrs": ["/ip4/203.0.113.7/tcp/31337"]}).encode() + b"\n"
    first = json.loads(asyncio.run(serve(request, node)).data)
    assert first["ok"] is False and first["tested"] is False, first
    assert first["detail"].startswith("this bootstrap could not dial: "), first
    again = json.loads(asyncio.run(serve(request, node)).data)
    assert again["tested"] is False and "asked again" in again["detail"], again


def test_a_daemon_error_is_reported_by_its_first_line_even_when_empty() -> None:
    assert dialback.first_line("Connect failed.\n  * [/ip4/1.2.3.4/tcp/1] dial refused") == "Connect failed."
    assert dialback.first_line("") == dialback.first_line(" \n ") == "(no message)"
    assert dialback.first_line("x" * 300) == "x" * 197 + "..."
