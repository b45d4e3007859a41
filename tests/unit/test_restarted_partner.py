"""A member restarted under its id (`--resume` after the swarm moved on) joins a later round J,
while its old membership stays in the views until J or until reports end it. Its exchange
partners of those rounds must not wait for it to the deadline, on either side of the call: the
new process refuses their calls at once, and a partner that waits for the old membership's call
learns from a probe that the process answering for that id joins later."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from noloco_swarm.peer.exchange import runner
from noloco_swarm.peer.exchange.board import ExchangeBoard
from noloco_swarm.peer.exchange.runner import OuterExchange, Rejoining
from noloco_swarm.peer.net import streams
from noloco_swarm.peer.net.streams import Refused
from noloco_swarm.peer.net.transport import Transport
from noloco_swarm.protocol.codec import TensorMeta, decode, encode
from noloco_swarm.protocol.plan import exchange_key
from noloco_swarm.protocol.rpc import ExchangeHeader, PeerStatus


def board() -> ExchangeBoard:
    """A board on a transport that never dials (its handlers are called directly)."""
    p2p = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me"))
    return ExchangeBoard(Transport(p2p, streams.TransportConfig()), 8)  # type: ignore[arg-type]


def header(round_: int, step: int) -> ExchangeHeader:
    return ExchangeHeader("run-1", round_, step, 0, 0, ("theta",), TensorMeta.of(torch.zeros(8)), 1 << 16)


def status(joining_at: int | None) -> PeerStatus:
    return PeerStatus("run-1", "partner", 0, 12, 1, 0, 1, 0, joining_at=joining_at)


def test_a_process_that_joins_at_round_j_refuses_every_exchange_of_an_earlier_round_at_once() -> None:
    async def main() -> None:
        b = board()
        b.forget((5, -1))  # what join_late does once it picked round 5 (runtime.py: retire_before)
        caller = SimpleNamespace(peer="partner")
        for round_, step in ((4, 249), (0, 49)):
            with pytest.raises(Refused, match="over here"):
                await asyncio.wait_for(b._serve(caller, header(round_, step), None), 1)  # type: ignore[arg-type]
        b.provide(exchange_key(5, 299), torch.zeros(8))  # its own first exchange is offered as usual
        assert exchange_key(5, 299) in b._provided

    asyncio.run(main())


def test_a_partner_waiting_for_the_old_membership_stops_when_the_new_process_says_it_joins_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runner, "PROBE_PERIOD", 0.01)
    answers = [status(None), status(7)]  # the old process still answers, then the restarted one

    async def probe(peer: str) -> PeerStatus:
        return answers.pop(0) if len(answers) > 1 else answers[0]

    async def main() -> None:
        exchange = object.__new__(OuterExchange)
        exchange.board = board()
        exchange.plan = SimpleNamespace(step=250)
        exchange.ctx = SimpleNamespace(  # type: ignore[assignment]
            deadlines=SimpleNamespace(exchange=30.0),
            rounds=SimpleNamespace(probe=probe),
            cfg=SimpleNamespace(outer=SimpleNamespace(overlap_steps=0)),
        )
        with pytest.raises(Rejoining, match="joins at round 7"):
            await asyncio.wait_for(exchange._await_caller(exchange_key(4, 250), "partner"), 5)
        # A process joining at the exchange's own round or earlier is the member we wait for.
        answers[:] = [status(4)]
        waiting = asyncio.ensure_future(exchange._await_caller(exchange_key(4, 250), "partner"))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)

    asyncio.run(main())


def test_a_status_says_the_round_its_process_joins_at_and_refuses_a_negative_one() -> None:
    assert decode(encode(status(7)), PeerStatus).joining_at == 7
    assert decode(encode(status(None)), PeerStatus).joining_at is None
    with pytest.raises(ValueError):
        status(-1)
