"""The tensor transport over real p2pd daemons on loopback: round trips, exchange, bad input, errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from noloco_swarm.peer import failpoints
from noloco_swarm.peer.exchange.board import ExchangeBoard
from noloco_swarm.peer.net import lifetime, streams
from noloco_swarm.peer.net.transport import (
    PROTOCOL,
    Accepts,
    InboundStream,
    PeerUnavailable,
    Refused,
    RemoteRefused,
    Transport,
    TransportConfig,
    backed_off,
    dialable,
)
from noloco_swarm.protocol import codec, rpc
from tests.integration.helpers import p2pd_descendants, unused_port

pytestmark = pytest.mark.integration
LIMIT = 64 << 20  # tensor bytes one frame may announce, in these tests
CONFIG = TransportConfig(
    max_frame_bytes=LIMIT,
    max_peer_inflight_bytes=LIMIT,
    max_inflight_bytes=2 * LIMIT,
    max_peer_streams=8,
    serve_timeout=20,
    header_timeout=2,
)
T = TypeVar("T")
BOARDS: dict[str, ExchangeBoard] = {}  # each transport's outer-exchange sessions, by peer id


def board(transport: Transport) -> ExchangeBoard:
    return BOARDS[transport.peer_id]


@pytest.fixture(scope="module")
def pair(loop: asyncio.AbstractEventLoop) -> Iterator[tuple[Transport, Transport]]:
    """Caller `a` and server `b`, connected; always shut down, and no p2pd of ours may remain."""
    before = p2pd_descendants()
    started: list[Transport] = []
    try:
        a = loop.run_until_complete(Transport.create(config=CONFIG))
        started.append(a)
        peers = loop.run_until_complete(a.visible_addresses())
        b = loop.run_until_complete(Transport.create(initial_peers=peers, config=CONFIG))
        started.append(b)
        for verb, (handler, accepts) in HANDLERS.items():
            b.register(verb, handler, accepts)
        numel = LIMIT // 8  # a stage whose theta and phi together are one frame's worth
        BOARDS[a.peer_id], BOARDS[b.peer_id] = ExchangeBoard(a, numel), ExchangeBoard(b, numel)
        yield a, b
    finally:
        for transport in reversed(started):
            loop.run_until_complete(transport.shutdown())
            loop.run_until_complete(transport.shutdown())  # idempotent
    assert wait_until(lambda: p2pd_descendants() <= before), "a transport left its p2pd running"


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], limit: float = 30) -> T:
    return loop.run_until_complete(asyncio.wait_for(coro, limit))


def wait_until(condition: Callable[[], bool], timeout: float = 10, poll: float = 0.05) -> bool:
    """Ask `condition` every `poll` seconds until it holds (True), for `timeout` seconds at most."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


async def eventually(condition: Callable[[], bool], timeout: float = 5) -> bool:
    """Like wait_until, while the loop runs (the server side of a test needs it to make progress)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


# -- server handlers -----------------------------------------------------------------------


async def echo(peer: str, header: codec.Message, tensors: list[torch.Tensor]) -> tuple[codec.Message, list]:
    return rpc.Ack(note=header.TAG), tensors


async def fetch_state(
    peer: str, header: codec.Message, tensors: list[torch.Tensor]
) -> tuple[codec.Message, list]:
    """Misbehaves on purpose, by stage: refuse, blame the input, send NaN, send too much."""
    assert isinstance(header, rpc.StateRequest)
    if header.stage == 0:
        raise Refused("not_ready", "no state before the first round")
    if header.stage == 1:
        raise codec.MessageError("stage 1 is not served here")
    if header.stage == 2:
        return rpc.Ack(), [torch.tensor([1.0, float("nan")])]
    if header.stage == 4:  # as when the server's side of the stream broke: it closes, unanswered
        raise PeerUnavailable("the stream broke under the server")
    return rpc.Ack(), [torch.zeros(LIMIT // 4 + 1)]


ANY = Accepts(64, LIMIT)  # up to 64 tensors of any dtype, one frame's worth of bytes
HANDLERS = {
    "rpc_echo": (echo, ANY),
    "rpc_forward": (echo, ANY),
    "rpc_small": (echo, Accepts(1, 4096, frozenset({"float32"}))),
    "rpc_fetch_state": (fetch_state, Accepts()),  # carries no tensors
}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def healthy(loop: asyncio.AbstractEventLoop, a: Transport, b: Transport) -> None:
    """b still answers a normal request."""
    x = torch.randn(1000)
    header, (y,) = run(loop, a.call(b.peer_id, "rpc_echo", rpc.StateRequest("run", 0), [x], timeout=10))
    assert header == rpc.Ack(note="fetch_state") and torch.equal(x, y)


# -- tests ---------------------------------------------------------------------------------


def test_round_trip_is_bitwise_for_small_large_and_bf16(
    loop: asyncio.AbstractEventLoop, pair: tuple[Transport, Transport]
) -> None:
    a, b = pair
    sent = [
        torch.randn(3, 4),
        torch.randn(6 << 20 >> 2),  # 6 MiB: above the 4 MiB that unary hivemind calls carry
        torch.randn(5, 7).to(torch.bfloat16),
        torch.randn(3 << 20).to(torch.bfloat16),  # 6 MiB of bf16
        torch.randn(9).half(),
        torch.arange(-5, 5),
        torch.empty(0, 4),
        torch.randn(4, 6).t(),  # not contiguous: sent as its contiguous copy
    ]
    header, got = run(loop, a.call(b.peer_id, "rpc_echo", rpc.StateRequest("run", 0), sent, timeout=20))
    assert header == rpc.Ack(note="fetch_state")
    assert len(got) == len(sent)
    for x, y in zip(sent, got, strict=True):
        assert y.dtype == x.dtype and y.shape == x.shape
        assert torch.equal(bits(x), bits(y))

    acts, tokens = torch.randn(2, 16, 32), torch.randint(0, 100, (2, 16))
    forward = rpc.ForwardHeader(
        "run", 0, 3, 0, 1, (6, 7), codec.TensorMeta.of(acts), codec.TensorMeta.of(tokens)
    )
    _, (acts2, tokens2) = run(loop, a.call(b.peer_id, "rpc_forward", forward, [acts, tokens], timeout=10))
    assert torch.equal(acts, acts2) and torch.equal(tokens, tokens2)
    with pytest.raises(ValueError, match="declares"):  # our own mistake, caught before sending
        run(loop, a.call(b.peer_id, "rpc_forward", forward, [tokens, acts], timeout=10))


def test_exchange_16mib_both_ways_bitwise_with_1x_bytes(
    loop: asyncio.AbstractEventLoop, pair: tuple[Transport, Transport], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    ours, theirs = torch.randn(4 << 20), torch.randn(4 << 20)  # 16 MiB of fp32 each
    key = (1, 50)
    header = rpc.ExchangeHeader("run", *key, 0, 0, ("theta",), codec.TensorMeta.of(ours), CONFIG.part_bytes)
    before_a, before_b = a.byte_counts().get(b.peer_id, {}), b.byte_counts().get(a.peer_id, {})

    async def higher_rank(k: tuple[int, ...], tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        await asyncio.sleep(0.3)  # the caller arrives first and the server waits for our tensor
        board(b).provide(k, tensor)
        return await board(b).received(k, a.peer_id, timeout=20)

    async def both() -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        return await asyncio.gather(
            board(a).swap(b.peer_id, header, (ours,), timeout=20), higher_rank(key, theirs)
        )

    (got_a,), (got_b,) = run(loop, both())
    assert torch.equal(got_a, theirs) and torch.equal(got_b, ours)
    nbytes = ours.numel() * 4
    after_a, after_b = a.byte_counts()[b.peer_id], b.byte_counts()[a.peer_id]
    for counts, before in ((after_a, before_a), (after_b, before_b)):
        for direction in ("sent", "received"):
            payload = counts[f"{direction}_payload"] - before.get(f"{direction}_payload", 0)
            total = counts[f"{direction}_total"] - before.get(f"{direction}_total", 0)
            assert payload == nbytes
            assert nbytes < total < nbytes + 4096  # framing (and the caller's receipt): a few hundred bytes
    # The caller's receipt came: the callee has nothing in flight (what a stopping peer waits
    # for, ExchangeBoard.drain) and keeps nothing of this exchange for a call again.
    assert run(loop, board(b).drain(10))
    assert (key, a.peer_id) not in board(b)._served

    # A caller whose stream broke before our answer reached it (so it sent no receipt) calls again:
    # it gets what we sent the first time, even once the exchange is finished here and our weights
    # were replaced by the outer step.
    key2 = (1, 60)
    header2 = rpc.ExchangeHeader("run", *key2, 0, 0, ("theta",), codec.TensorMeta.of(ours), CONFIG.part_bytes)
    monkeypatch.setattr(failpoints, "_left", failpoints.parse("lose_reply:rpc_exchange=1"))

    async def lost() -> list[object]:
        return await asyncio.gather(
            board(a).swap(b.peer_id, header2, (ours,), timeout=20),
            higher_rank(key2, theirs),
            return_exceptions=True,
        )

    first, (got_b2,) = run(loop, lost())
    assert isinstance(first, streams.StreamClosed) and "failpoint" in str(first) and torch.equal(got_b2, ours)
    sent = theirs.clone()
    board(b).forget(key2)
    theirs = theirs + 1.0  # the weights move on: replaced, as an outer step does
    (again,) = run(loop, board(a).swap(b.peer_id, header2, (ours,), timeout=10))
    assert torch.equal(again, sent)
    # A shape that is not ours, and a key older than a newer exchange's, are refused.
    small = torch.randn(10)
    board(b).provide((1, 100), torch.randn(11))
    wrong = rpc.ExchangeHeader("run", 1, 100, 0, 0, ("theta",), codec.TensorMeta.of(small), 1 << 20)
    with pytest.raises(RemoteRefused) as refused:
        run(loop, board(a).swap(b.peer_id, wrong, (small,), timeout=10))
    assert refused.value.code == "mismatch"
    with pytest.raises(RemoteRefused) as refused:
        run(loop, board(a).swap(b.peer_id, header, (ours,), timeout=10))
    assert refused.value.code == "stale"
    board(b).forget((1, 100))


def test_exchange_partner_that_never_provides_times_out(
    loop: asyncio.AbstractEventLoop, pair: tuple[Transport, Transport]
) -> None:
    a, b = pair
    x = torch.randn(10)
    header = rpc.ExchangeHeader("run", 2, 50, 0, 0, ("theta",), codec.TensorMeta.of(x), 1 << 20)
    start = time.monotonic()
    with pytest.raises(PeerUnavailable, match="within"):
        run(loop, board(a).swap(b.peer_id, header, (x,), timeout=1.0))
    with pytest.raises(PeerUnavailable, match="within"):
        run(loop, board(b).received((2, 50), a.peer_id, timeout=0.2))
    assert time.monotonic() - start < 5
    board(b).forget((2, 50))
    healthy(loop, a, b)


def test_handler_errors_are_remote_refused_and_the_server_keeps_serving(
    loop: asyncio.AbstractEventLoop, pair: tuple[Transport, Transport]
) -> None:
    a, b = pair
    cases = [
        ("rpc_fetch_state", 0, "not_ready"),
        ("rpc_fetch_state", 1, "bad_request"),
        ("rpc_nope", 0, "unknown_verb"),
    ]
    for verb, stage, code in cases:
        with pytest.raises(RemoteRefused) as refused:
            run(loop, a.call(b.peer_id, verb, rpc.StateRequest("run", stage), timeout=10))
        assert refused.value.code == code and refused.value.peer_id == b.peer_id
        healthy(loop, a, b)


def test_a_stream_closed_unanswered_is_stream_closed_and_the_server_keeps_serving(
    loop: asyncio.AbstractEventLoop, pair: tuple[Transport, Transport]
) -> None:
    """A caller can tell "the stream closed before any answer" (worth one more try if the peer
    still answers) from a refusal and from a reply cut short."""
    a, b = pair
    with pytest.raises(streams.StreamClosed):
        run(loop, a.call(b.peer_id, "rpc_fetch_state", rpc.StateRequest("run", 4), timeout=10))
    healthy(loop, a, b)


def test_nan_and_oversize_are_message_errors_on_the_receiving_side(
    loop: asyncio.AbstractEventLoop, pair: tuple[Transport, Transport]
) -> None:
    a, b = pair
    bad_before = b.byte_counts()[a.peer_id]["bad_messages"]
    nan = torch.randn(3 << 20)
    nan[-1] = float("nan")  # in the last part: the server has read everything before it finds it
    with pytest.raises(RemoteRefused) as refused:  # b received garbage: it refuses, counts it
        run(loop, a.call(b.peer_id, "rpc_echo", rpc.StateRequest("run", 0), [nan], timeout=10))
    assert refused.value.code == "bad_request" and "NaN" in refused.value.reason
    assert b.byte_counts()[a.peer_id]["bad_messages"] == bad_before + 1
    with pytest.raises(codec.MessageError, match="NaN"):  # a received garbage
        run(loop, a.call(b.peer_id, "rpc_fetch_state", rpc.StateRequest("run", 2), timeout=10))
    with pytest.raises(codec.MessageError, match="over our limit"):  # a would have to allocate too much
        run(loop, a.call(b.peer_id, "rpc_fetch_state", rpc.StateRequest("run", 3), timeout=10))
    healthy(loop, a, b)


def frame(envelope: rpc.Envelope) -> bytes:
    encoded = codec.encode(envelope)
    return streams.MAGIC + len(encoded).to_bytes(4, "big") + encoded


HEADER = codec.encode(rpc.StateRequest("run", 0))
RAW_CASES = {
    "garbage": b"GET / HTTP/1.1\r\n\r\n" + os.urandom(64),
    "bad_length": streams.MAGIC + (1 << 30).to_bytes(4, "big"),
    "garbage_header": frame(rpc.Envelope("rpc_echo", b"\x93\x01\x02")),
    "oversize": frame(rpc.Envelope("rpc_echo", HEADER, (codec.TensorMeta((1 << 34,), "float32"),))),
    "truncated": frame(rpc.Envelope("rpc_echo", HEADER, (codec.TensorMeta((1 << 18,), "float32"),)))
    + b"\0" * 5000,
    # Tensors that the verb does not take, announced and partly sent: refused before they are read.
    "undeclared": frame(rpc.Envelope("rpc_fetch_state", HEADER, (codec.TensorMeta((1 << 20,), "float32"),)))
    + b"\0" * 5000,
    "too_large": frame(rpc.Envelope("rpc_small", HEADER, (codec.TensorMeta((1025,), "float32"),))),
}
REFUSED_AS = {"undeclared": "undeclared_tensors", "too_large": "too_large"}


@pytest.mark.parametrize("case", list(RAW_CASES))
def test_malformed_request_is_rejected_and_the_server_keeps_serving(
    loop: asyncio.AbstractEventLoop, pair: tuple[Transport, Transport], case: str
) -> None:
    a, b = pair
    bad_before = b.byte_counts().get(a.peer_id, {}).get("bad_messages", 0)

    async def send_raw() -> codec.Message | None:
        _, reader, writer = await a.p2p.call_binary_stream_handler(PeerID.from_base58(b.peer_id), PROTOCOL)
        try:
            writer.write(RAW_CASES[case])
            await writer.drain()
            if case == "truncated":
                return None  # we hang up mid-tensor; b has nobody to answer
            envelope = await streams.read_envelope(reader, streams.ByteCounts())
            return codec.decode(envelope.header)
        finally:
            writer.close()

    reply = run(loop, send_raw())
    if reply is not None:
        assert isinstance(reply, rpc.ErrorReply) and reply.code == REFUSED_AS.get(case, "bad_request")
    counted = eventually(lambda: b.byte_counts()[a.peer_id]["bad_messages"] == bad_before + 1)
    assert run(loop, counted), "b did not count the malformed request against a"
    healthy(loop, a, b)


async def answer_code(reader: asyncio.StreamReader, within: float) -> str | None:
    """The code of the ErrorReply waiting on a raw stream, or None if none comes within `within`."""
    try:
        envelope = await asyncio.wait_for(streams.read_envelope(reader, streams.ByteCounts()), within)
    except TimeoutError:
        return None
    reply = codec.decode(envelope.header)
    assert isinstance(reply, rpc.ErrorReply)
    return reply.code


def test_a_flood_of_streams_or_bytes_from_one_caller_is_busy_and_silent_streams_time_out(
    loop: asyncio.AbstractEventLoop, pair: tuple[Transport, Transport]
) -> None:
    """One caller holding more streams than its cap gets 'busy' at once for the rest; its silent
    streams are refused at the header deadline, which frees their slots; and a second request
    whose bytes would take the caller past its byte cap is 'busy' before a byte is read."""
    a, b = pair
    cap, extra = CONFIG.max_peer_streams, 4

    async def open_stream(start: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        _, reader, writer = await a.p2p.call_binary_stream_handler(PeerID.from_base58(b.peer_id), PROTOCOL)
        if start:  # libp2p opens a stream at the remote only with its first bytes
            writer.write(start)
            await writer.drain()
        return reader, writer

    async def flood() -> tuple[list[str | None], list[str | None], float]:
        # Each sends the start of a frame and no more: half-open.
        opened = await asyncio.gather(*(open_stream(streams.MAGIC) for _ in range(cap + extra)))
        try:
            first = await asyncio.gather(*(answer_code(r, 1.0) for r, _ in opened))
            start = time.monotonic()
            held = [r for (r, _), code in zip(opened, first, strict=True) if code is None]
            later = await asyncio.gather(*(answer_code(r, CONFIG.header_timeout + 5) for r in held))
            return first, later, time.monotonic() - start
        finally:
            for _, writer in opened:
                writer.close()

    first, later, waited = run(loop, flood())
    assert first.count("busy") == extra and first.count(None) == cap, first
    assert later == ["timeout"] * cap and waited < CONFIG.header_timeout + 2
    assert run(loop, eventually(lambda: b.streams_from(a.peer_id) == 0)), "closed streams kept their slots"
    healthy(loop, a, b)

    def request(elements: int) -> bytes:
        return frame(rpc.Envelope("rpc_echo", HEADER, (codec.TensorMeta((elements,), "float32"),)))

    async def over_the_byte_cap() -> tuple[str | None, str | None]:
        holding, second = await open_stream(), await open_stream()
        try:
            holding[1].write(request(LIMIT // 8))  # half of a's byte cap, whose bytes never come
            await holding[1].drain()
            held = await answer_code(holding[0], 0.5)  # b waits for them, holding the reservation
            second[1].write(request(LIMIT // 8 + 1))  # the other half and 4 bytes more
            await second[1].drain()
            return held, await answer_code(second[0], 5.0)
        finally:
            holding[1].close()
            second[1].close()

    assert run(loop, over_the_byte_cap()) == (None, "busy")
    assert run(loop, eventually(lambda: b.streams_from(a.peer_id) == 0)), "closed streams kept their slots"
    healthy(loop, a, b)


def test_calls_to_a_peer_reuse_one_stream_which_the_callee_closes_when_idle(
    loop: asyncio.AbstractEventLoop, pair: tuple[Transport, Transport]
) -> None:
    """Sequential calls share one kept stream, concurrent ones keep a few; a kept stream holds
    none of its caller's stream slots; the callee closes a stream left idle for its header
    deadline, and the caller's next call opens a fresh one."""
    a, b = pair
    a.close_idle()
    assert run(loop, eventually(lambda: b.kept_from(a.peer_id) == 0)), "the callee kept closed streams"
    opened = a.streams_opened_to(b.peer_id)
    for _ in range(5):
        healthy(loop, a, b)
    assert a.streams_opened_to(b.peer_id) == opened + 1, "each sequential call opened its own stream"
    assert b.kept_from(a.peer_id) == 1 and b.streams_from(a.peer_id) == 0  # kept, idle, no slot

    async def together() -> None:
        x = torch.randn(10)
        calls = [a.call(b.peer_id, "rpc_echo", rpc.Ack(), [x], timeout=10) for _ in range(3)]
        for _, (y,) in await asyncio.gather(*calls):
            assert torch.equal(x, y)

    run(loop, together())
    assert opened + 1 < a.streams_opened_to(b.peer_id) <= opened + 3
    assert run(loop, eventually(lambda: b.kept_from(a.peer_id) == 0, CONFIG.header_timeout + 5)), (
        "the callee kept idle streams past its header deadline"
    )
    before = a.streams_opened_to(b.peer_id)
    healthy(loop, a, b)  # the kept streams met closed: a fresh one, and the call goes through
    assert a.streams_opened_to(b.peer_id) == before + 1


def test_settle_closes_our_kept_streams_and_waits_for_the_callers_to_close_theirs(
    loop: asyncio.AbstractEventLoop, pair: tuple[Transport, Transport]
) -> None:
    """A peer's last act before it stops (Peer.run): its own kept streams close at once, and it
    waits while a caller keeps a stream to it open, until that caller closes it."""
    a, b = pair
    healthy(loop, a, b)  # a keeps a stream to b
    assert b.kept_from(a.peer_id) == 1
    assert run(loop, b.settle(0.3)) is False, "settled with a caller's stream open"

    async def caller_closes_later() -> bool:
        settling = asyncio.ensure_future(b.settle(20))
        await asyncio.sleep(0.3)
        assert not settling.done(), "settled with a caller's stream open"
        return await a.settle(20) and await settling  # a closes its kept stream; nobody calls a

    assert run(loop, caller_closes_later()) is True
    assert b.kept_from(a.peer_id) == 0
    healthy(loop, a, b)  # calls go on, on a fresh stream


def test_a_kept_stream_the_callee_ended_is_not_served_twice_and_the_call_goes_through(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """A stream handler ends its stream after replying; a caller that kept that stream (an
    unconfirmed call) sends its next request on it and meets it closed: the request goes once more
    on a fresh stream and is served exactly once."""
    before = p2pd_descendants()
    served: list[float] = []

    async def once(stream: InboundStream, header: codec.Message, envelope: rpc.Envelope) -> None:
        (x,) = await streams.read_tensors(stream.reader, envelope.tensors, stream.counts, stream.part_bytes)
        served.append(float(x[0]))
        await streams.reply(stream, rpc.Ack(note="once"), [x])

    async def scenario() -> None:
        a = await Transport.create(config=CONFIG)
        try:
            b = await Transport.create(initial_peers=await a.visible_addresses(), config=CONFIG)
            try:
                b.register_stream("rpc_once", once, on_close=lambda: None, accepts=ANY)
                for i in range(6):
                    reply, (y,) = await a.call(
                        b.peer_id, "rpc_once", rpc.Ack(), [torch.full((4,), float(i))], timeout=10
                    )
                    assert reply == rpc.Ack(note="once") and float(y[0]) == i
                assert a.streams_opened_to(b.peer_id) == 6  # every kept stream had been ended
            finally:
                await b.shutdown()
        finally:
            await a.shutdown()

    run(loop, scenario())
    assert served == [float(i) for i in range(6)], served
    assert wait_until(lambda: p2pd_descendants() <= before), "a transport left its p2pd running"


def test_a_fresh_daemon_dials_a_peer_at_its_announced_addresses(
    loop: asyncio.AbstractEventLoop, pair: tuple[Transport, Transport]
) -> None:
    """What joiners and probes do with a directory's addresses (with their /p2p/ part): a daemon
    that knows nobody dials `b` there, and `b` dials it back (connected already: still True).
    (Until this test, every such dial failed inside p2pd, unnoticed: calls found their way
    through the DHT's routes instead.)"""
    _, b = pair
    c = run(loop, Transport.create(config=CONFIG))  # no initial peers: it knows nobody
    try:
        announced = run(loop, b.visible_addresses())
        assert all("/p2p/" in address for address in announced)
        assert run(loop, c.connect(b.peer_id, announced, timeout=10))
        assert run(loop, b.connect(c.peer_id, run(loop, c.visible_addresses()), timeout=10))
        reply, _ = run(loop, c.call(b.peer_id, "rpc_echo", rpc.StateRequest("run", 0), timeout=10))
        assert reply == rpc.Ack("fetch_state")  # the echo handler names what it got
        # A relayed address (a NAT'd peer's) with the relay's /p2p/ part inside: p2pd parses it
        # and asks `b` to relay, which answers (it holds no reservation for the target), where
        # the address as py-multiaddr writes it failed in p2pd's parser.
        nobody = "12D3KooWM2M5LvcymiCFvAtxJ6ijjD8dbER7LftJmbita9bE96t6"
        circuit = dialable(Multiaddr(f"{announced[0]}/p2p-circuit/p2p/{nobody}"), nobody)
        with pytest.raises(P2PDaemonError) as failed:
            run(loop, c.p2p._client.connect(PeerID.from_base58(nobody), [circuit]))
        assert "p2p-circuit] error opening relay circuit" in str(failed.value), failed.value
    finally:
        run(loop, c.shutdown())


def test_a_call_waits_out_a_dial_backoff_that_no_dial_of_its_own_explains(
    loop: asyncio.AbstractEventLoop, pair: tuple[Transport, Transport], tmp_path: Path
) -> None:
    """A dial of `a`'s daemon that `a`'s transport did not make (its DHT node's, in a peer) fails
    while `c` is down; `c` comes back at the same address, while the daemon still backs off from
    it. A call waits the backoff out instead of failing at once (which marked a live peer gone at
    step 0 in CI). After a dial of the transport's own failed, the backoff is evidence: at once."""
    a, _ = pair
    key, port = str(tmp_path / "c.key"), unused_port()
    address = f"/ip4/127.0.0.1/tcp/{port}"
    c = run(loop, Transport.create(host_maddrs=(address,), identity_path=key, config=CONFIG))
    c_id = c.peer_id
    run(loop, c.shutdown())

    def dial_from_the_daemon() -> str:
        with pytest.raises(P2PDaemonError) as failed:  # the daemon's own dial, as a DHT node's
            run(loop, a.p2p._client.connect(PeerID.from_base58(c_id), [Multiaddr(address)]))
        return str(failed.value)

    assert "connection refused" in dial_from_the_daemon()
    c = run(loop, Transport.create(host_maddrs=(address,), identity_path=key, config=CONFIG))
    try:
        c.register("rpc_echo", echo)
        assert backed_off(P2PDaemonError(dial_from_the_daemon()))  # what a call's first dial meets
        reply, _ = run(loop, a.call(c_id, "rpc_echo", rpc.StateRequest("run", 0), timeout=20))
        assert reply == rpc.Ack("fetch_state")
    finally:
        run(loop, c.shutdown())
    assert not run(loop, a.connect(c_id, [address], timeout=10))  # the transport's own dial
    c = run(loop, Transport.create(host_maddrs=(address,), identity_path=key, config=CONFIG))
    try:
        c.register("rpc_echo", echo)
        with pytest.raises(PeerUnavailable, match=r"(?s)dial backoff.*after: .*connection refused"):
            run(loop, a.call(c_id, "rpc_echo", rpc.StateRequest("run", 0), timeout=20))
    finally:
        run(loop, c.shutdown())


def test_shut_down_peer_is_unavailable_within_the_deadline(
    loop: asyncio.AbstractEventLoop, pair: tuple[Transport, Transport]
) -> None:
    a, _ = pair
    peers = run(loop, a.visible_addresses())
    c = run(loop, Transport.create(initial_peers=peers, config=CONFIG))
    daemon = c.p2p._child.pid
    try:
        c.register("rpc_echo", echo)
        run(loop, a.call(c.peer_id, "rpc_echo", rpc.StateRequest("run", 0), timeout=10))
    finally:
        run(loop, c.shutdown())
    assert daemon not in p2pd_descendants()
    start = time.monotonic()
    with pytest.raises(PeerUnavailable):
        run(loop, a.call(c.peer_id, "rpc_echo", rpc.StateRequest("run", 0), timeout=3))
    assert time.monotonic() - start < 4
    with pytest.raises(RuntimeError, match="shut down"):
        run(loop, c.call(a.peer_id, "rpc_echo", rpc.StateRequest("run", 0), timeout=3))


async def hang(peer: str, header: codec.Message, tensors: list[torch.Tensor]) -> tuple[codec.Message, list]:
    await asyncio.sleep(3600)
    raise AssertionError("never answers")


def test_a_transport_shut_down_while_serving_ends_its_calls_quietly(
    loop: asyncio.AbstractEventLoop, pair: tuple[Transport, Transport], caplog: pytest.LogCaptureFixture
) -> None:
    """shutdown() cancels the calls being served: their callers learn that the peer is gone,
    and the server logs no error (a cancelled handler used to reach the stream server's
    callback, which logged a traceback on every peer stopped mid-step)."""
    a, _ = pair
    peers = run(loop, a.visible_addresses())
    c = run(loop, Transport.create(initial_peers=peers, config=CONFIG))
    c.register("rpc_echo", hang)
    call = loop.create_task(a.call(c.peer_id, "rpc_echo", rpc.StateRequest("run", 0), timeout=20))
    try:
        assert run(loop, eventually(lambda: c.streams_from(a.peer_id) > 0, timeout=20)), "not served"
    finally:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            run(loop, c.shutdown())
            with pytest.raises(PeerUnavailable):
                run(loop, call)
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


DAEMON_CHILD = """
import asyncio, sys
from noloco_swarm.peer.net.transport import Transport
async def main():
    t = await Transport.create()
    print(t.p2p._child.pid, flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


def test_p2pd_dies_with_a_sigkilled_owner() -> None:
    """...and the sockets it leaves (its folder) go with the next sweep, which keeps a live one's."""
    proc = subprocess.Popen(
        [sys.executable, "-c", DAEMON_CHILD], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        daemon = int(proc.stdout.readline())  # type: ignore[union-attr]
        assert os.path.exists(f"/proc/{daemon}")
        sockets = lifetime.SOCKETS / f"{lifetime.SOCKETS_PREFIX}{proc.pid}"
        assert len(list(sockets.glob("hivemind-*.sock"))) == 2 and sockets not in lifetime.sweep_sockets()
        proc.kill()  # SIGKILL: no cleanup code of ours runs
        proc.wait(timeout=10)
        assert wait_until(lambda: not os.path.exists(f"/proc/{daemon}") or _zombie(daemon), 10)
        assert sockets in lifetime.sweep_sockets() and not sockets.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the session we started, daemon included
        proc.wait(timeout=10)
        proc.stdout.close()  # type: ignore[union-attr]


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_daemon_slower_than_its_start_timeout_is_started_again_with_longer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A p2pd that misses its start-up deadline (here 1 ms, which no daemon meets) is started once
    more with a longer one (15 s at least), saying so; the daemon of the failed try is gone."""
    before = p2pd_descendants()

    async def start() -> str:
        p2p = await lifetime.start_p2p(startup_timeout=0.001, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            return p2p.peer_id.to_base58()
        finally:
            await p2p.shutdown()

    with caplog.at_level(logging.WARNING, logger="noloco_swarm.peer.net.lifetime"):
        assert asyncio.run(start())
    said = [r.getMessage() for r in caplog.records if r.name == "noloco_swarm.peer.net.lifetime"]
    assert said == [
        "the libp2p daemon did not start within 0.001 s (peer.daemon_start_timeout); starting it again with 15 s"
    ], said
    assert wait_until(lambda: p2pd_descendants() <= before), "the failed try left its p2pd running"
