"""Dial-back: can the swarm open a connection to us, or only we to it?

A peer behind NAT or a firewall can dial out (so its own calls work) while nobody can dial in,
and then every call another peer starts to it fails. Only a node outside can tell, by opening a
fresh connection to the addresses we would announce. A `noloco dht` bootstrap node offers this
as a libp2p protocol (`offer_on_dht`), and `noloco doctor` asks for it (`ask`):

  request   one JSON line: {"addrs": [multiaddr, ...]}, at most MAX_ADDRS, each /ip4 or /ip6 + /tcp
  answer    one JSON line: {"ok": bool, "dialed": [multiaddr, ...], "detail": str, "tested": bool}

"tested" is false when the bootstrap could not carry out the dial (asked again too soon, or its own
dialer failed): a failure of the bootstrap's, not a verdict on the asker's reachability. (An older
bootstrap leaves it out; it then means true.) Every request gets an answer, whatever fails.

The bootstrap dials only the requesting peer's own id (libp2p's handshake checks it), only at
addresses on the IP address it sees the request come from (as libp2p's AutoNAT does, so that
nobody can make it connect to third parties), from a libp2p daemon started for this dial alone
(its own daemon's connection to us was opened by us and proves nothing), one dial at a time and
at most once per RATE_SECONDS per peer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

PROTOCOL = "/noloco/dialback/1.0.0"
MAX_ADDRS = 16
MAX_LINE = 4096
DIAL_SECONDS = 10.0
RATE_SECONDS = 5.0


@dataclass(frozen=True)
class Verdict:
    ok: bool
    dialed: tuple[str, ...]
    detail: str
    tested: bool = True


def first_line(text: str, limit: int = 200) -> str:
    """The first line of a (daemon's, often multi-line) error message, for a one-line report
    (here and in `noloco doctor`; this module imports hivemind only when it dials)."""
    line = text.strip().splitlines()[0] if text.strip() else "(no message)"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def addresses_to_dial(request: Any, observed: str) -> list[str]:
    """The addresses of `request` (parsed JSON) that may be dialled back, given the multiaddr the
    request came from. ValueError (saying why) for a malformed request or no address allowed."""
    from hivemind.utils.multiaddr import Multiaddr

    if not isinstance(request, dict) or not isinstance(request.get("addrs"), list):
        raise ValueError('expected {"addrs": [multiaddr, ...]}')
    addrs = request["addrs"]
    if not 1 <= len(addrs) <= MAX_ADDRS or not all(isinstance(a, str) for a in addrs):
        raise ValueError(f"expected 1 to {MAX_ADDRS} addresses as strings")
    seen = Multiaddr(observed)
    family = "ip4" if "ip4" in seen.protocols() else "ip6"
    ip = seen.value_for_protocol(family)
    allowed, refused = [], []
    for text in addrs:
        try:
            address = Multiaddr(text)
            if "p2p" in address.protocols():
                address = address.decapsulate(Multiaddr(f"/p2p/{address.value_for_protocol('p2p')}"))
            names = [p.name for p in address.protocols()]
            same_ip = family in names and address.value_for_protocol(family) == ip
            ok = same_ip and names == [family, "tcp"] and 0 < int(address.value_for_protocol("tcp")) < 65536
        except Exception:  # noqa: BLE001  (py-multiaddr raises many kinds of error for bad text)
            ok = False
        (allowed if ok else refused).append(str(address) if ok else text)
    if not allowed:
        raise ValueError(
            f"none of the addresses is a TCP address on {ip}, where this request came from: {refused}"
        )
    return allowed


class DialBack:
    """The bootstrap's side: serves PROTOCOL on a running daemon."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()  # one dial (one extra daemon) at a time
        self._last: dict[str, float] = {}  # peer id -> when it last asked

    async def serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request, one answer; nothing the caller sends escapes this function."""
        peer = info.peer_id.to_base58()
        try:
            try:
                line = await asyncio.wait_for(reader.readuntil(b"\n"), DIAL_SECONDS)
                if len(line) > MAX_LINE:
                    raise ValueError(f"request over {MAX_LINE} bytes")
                addrs = addresses_to_dial(json.loads(line), str(info.addr))
            except (ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError) as e:
                verdict = Verdict(False, (), f"refused: {e}")
            else:
                try:
                    verdict = await self._dial(peer, addrs)
                except Exception as e:  # ours, not the asker's: it still gets an answer
                    logger.exception("dial-back for %s failed on this node's side", peer)
                    verdict = Verdict(
                        False, (), f"this bootstrap could not dial: {first_line(str(e))}", False
                    )
            answer = {
                "ok": verdict.ok,
                "dialed": list(verdict.dialed),
                "detail": verdict.detail,
                "tested": verdict.tested,
            }
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (OSError, asyncio.CancelledError) as e:  # the caller went away
            logger.debug("dial-back for %s ended early: %s", peer, e)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            writer.close()

    async def _dial(self, peer: str, addrs: list[str]) -> Verdict:
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        from noloco_swarm.peer.net.lifetime import start_p2p

        now = time.monotonic()
        if now - self._last.get(peer, -RATE_SECONDS) < RATE_SECONDS:
            return Verdict(False, (), f"asked again within {RATE_SECONDS:.0f} s: try later", False)
        self._last = {p: t for p, t in self._last.items() if now - t < RATE_SECONDS} | {peer: now}
        async with self._lock:
            fresh = await start_p2p(
                host_maddrs=["/ip4/0.0.0.0/tcp/0"], use_relay=False, auto_nat=False, nat_port_map=False
            )
            try:
                async with asyncio.timeout(DIAL_SECONDS):
                    await fresh._client.connect(PeerID.from_base58(peer), [Multiaddr(a) for a in addrs])
            except TimeoutError:
                return Verdict(False, tuple(addrs), f"no connection within {DIAL_SECONDS:.0f} s")
            except Exception as e:  # noqa: BLE001  (the daemon's errors name what failed)
                return Verdict(False, tuple(addrs), f"dial failed: {first_line(str(e))}")
            finally:
                await fresh.shutdown()
        return Verdict(True, tuple(addrs), "a fresh connection reached you")


async def _offer_in_dht_process(dht: Any, node: Any) -> None:
    await node.p2p.add_binary_stream_handler(PROTOCOL, DialBack().serve)


def offer_on_dht(dht: Any) -> None:
    """Serve dial-back on a running hivemind DHT's daemon (in its process, from ours)."""
    dht.run_coroutine(_offer_in_dht_process)


async def ask(p2p: Any, bootstrap: str, addrs: list[str], timeout: float) -> Verdict | None:
    """Ask `bootstrap` (a peer id our daemon is connected to) to dial us back at `addrs`.
    None if it does not offer dial-back (not a `noloco dht` node, or an older one)."""
    from hivemind.p2p import PeerID
    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure, P2PDaemonError

    try:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(bootstrap), PROTOCOL)
    except (ControlFailure, P2PDaemonError) as e:
        if "protocol" in str(e).lower() and "support" in str(e).lower():
            return None
        raise
    try:
        writer.write(json.dumps({"addrs": addrs}).encode() + b"\n")
        await writer.drain()
        try:
            line = await asyncio.wait_for(reader.readuntil(b"\n"), timeout + DIAL_SECONDS)
        except asyncio.IncompleteReadError:
            raise ConnectionError("the stream closed before an answer came") from None
        answer = json.loads(line[:MAX_LINE])
        dialed = tuple(map(str, answer["dialed"]))
        return Verdict(bool(answer["ok"]), dialed, str(answer["detail"]), bool(answer.get("tested", True)))
    finally:
        writer.close()
