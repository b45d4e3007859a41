"""peer/net/transport.py's reading of p2pd's dial errors: is a failed dial only our daemon's backoff?"""

from __future__ import annotations

import pytest
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from noloco_swarm.peer.net.transport import backed_off

PEER = "QmQrGZewzWBnDSPgFwwRjBunmFzhhkzaMqhKRXwsMSuhcT"
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
