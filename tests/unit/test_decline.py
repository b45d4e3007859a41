"""rpc_decline: a caller that avoids its callee says so, and the callee's wait for that call ends
at once, whether the word comes before or while it waits; what a stranger can make it keep is
bounded."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from noloco_swarm.peer.exchange.board import DECLINE, EARLY_DECLINES, ExchangeBoard
from noloco_swarm.peer.net import streams
from noloco_swarm.peer.net.streams import RemoteRefused
from noloco_swarm.peer.net.transport import Transport
from noloco_swarm.protocol.codec import MessageError
from noloco_swarm.protocol.rpc import Decline, StatusRequest


def board() -> ExchangeBoard:
    """A board on a transport that never dials (its handlers are called directly)."""
    p2p = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me"))
    return ExchangeBoard(Transport(p2p, streams.TransportConfig()), 8)  # type: ignore[arg-type]


async def declined(b: ExchangeBoard, peer: str, round_: int, step: int) -> None:
    await b.transport._server.handlers[DECLINE](peer, Decline("run-1", round_, step, 1), [])


def test_a_decline_ends_the_wait_for_that_call_before_or_while_it_waits() -> None:
    async def main() -> None:
        b = board()
        await declined(b, "caller", 0, 4)  # before the local peer waits
        with pytest.raises(RemoteRefused, match="avoided"):
            await asyncio.wait_for(b.received((0, 4), "caller", timeout=30), 5)
        waiting = asyncio.ensure_future(b.received((1, 8), "caller", timeout=30))
        await asyncio.sleep(0.01)  # it waits now
        await declined(b, "caller", 1, 8)
        with pytest.raises(RemoteRefused, match="avoided"):
            await asyncio.wait_for(waiting, 5)
        # Another caller's word, or one for another exchange, ends nothing of ours.
        await declined(b, "stranger", 2, 12)
        other = asyncio.ensure_future(b.received((2, 12), "caller", timeout=0.2))
        with pytest.raises(Exception, match="did not exchange"):
            await other

    asyncio.run(main())


def test_what_declines_leave_behind_is_bounded_and_retires_with_its_exchange() -> None:
    async def main() -> None:
        b = board()
        for i in range(4 * EARLY_DECLINES):  # strangers' declines for far-off exchanges
            await declined(b, f"peer-{i}", 1 << 30, 1 << 30)
        assert len(b._declined_early.keys) == EARLY_DECLINES and not b._received
        b.forget((1 << 30, 1 << 30))
        assert not b._declined_early.keys
        await declined(b, "caller", 0, 4)  # older than the last finished exchange: nothing kept
        assert not b._declined_early.keys
        with pytest.raises(MessageError, match="needs a decline"):
            await b.transport._server.handlers[DECLINE]("caller", StatusRequest("run-1"), [])

    asyncio.run(main())
