"""Starting a hivemind DHT node with the options volunteers behind NATs need, and describing it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P, P2PDaemonError

from noloco_swarm.peer.directory import signed_dht_kwargs
from noloco_swarm.peer.net import identity
from noloco_swarm.peer.net.identity import Identity
from noloco_swarm.peer.net.lifetime import DHT
from noloco_swarm.peer.net.streams import relayed
from noloco_swarm.train.config import NetworkConfig

T = TypeVar("T")
# Seconds the DHT node's shutdown may take to remove its handlers from a live daemon (milliseconds
# when the daemon answers).
SHUTDOWN_TIMEOUT = 3.0


def start_dht(net: NetworkConfig) -> DHT:
    """A running DHT node joined to `net.initial_peers` (an empty list starts a new swarm). It
    signs its records with its libp2p key, `dht.identity` (a fresh one without
    `net.identity_path`), and checks everyone's signatures."""
    with identity.identity_file(net.identity_path) as (path, fresh):
        me = identity.load(path)
        options = net.p2p_kwargs() | {"identity_path": path, "check_if_identity_free": not fresh}
        dht = DHT(
            initial_peers=list(net.initial_peers),
            start=True,
            client_mode=net.client_mode,
            **signed_dht_kwargs(me),
            **options,
        )
    dht.identity = me
    return dht


def _loopback(addr: str) -> bool:
    return "/127.0.0.1/" in addr or "/::1/" in addr


def reachability(addresses: Sequence[str]) -> list[str]:
    """Human-readable lines: how others can reach a node at these addresses (direct or relayed)."""
    lines = []
    for addr in addresses:
        kind = "relayed" if relayed(addr) else ("loopback only" if "/127.0.0.1/" in addr else "direct")
        lines.append(f"{addr}  ({kind})")
    if addresses and all(_loopback(a) for a in addresses):
        lines.append(
            "only loopback addresses: peers on other machines cannot reach this node; set --host-maddrs"
        )
    return lines or ["no visible addresses yet: the node is not reachable"]


def reachability_kind(addresses: Sequence[str]) -> str:
    """One line for a live view: how others can reach a node at these addresses."""
    direct = [a for a in addresses if not relayed(a)]
    if not addresses:
        return "not reachable (no visible addresses)"
    if direct and all(_loopback(a) for a in direct):
        return "loopback only: peers on other machines cannot reach this node"
    if not direct:
        return f"through a relay only ({len(addresses)} relayed addresses)"
    return f"direct ({len(direct)} addresses" + (", relays too)" if len(direct) < len(addresses) else ")")


class LoopDHT:
    """hivemind's DHT node running on this process's event loop, behind the part of hivemind's
    `DHT` interface that RunDirectory uses (`get`, `store`, `run_coroutine`, `shutdown`).

    hivemind's `DHT` runs its node in a process forked from ours, which for a peer means a copy
    of a process that has torch loaded: about 0.3 GiB more per peer (docs/benchmarks.md, "A real
    model's peers"). Here the node shares the peer's event loop and its libp2p daemon instead.
    Its calls are made from worker threads (the directory blocks on their answers, as on
    hivemind's), never from the loop's own thread, which would wait on itself: such a call
    raises RuntimeError at once.
    """

    def __init__(
        self, node: DHTNode, loop: asyncio.AbstractEventLoop, identity: Identity | None = None
    ) -> None:
        self.node, self.loop, self.identity = node, loop, identity
        self.closed = False
        # Calls submitted from worker threads and not answered yet: shutdown cancels them, so the
        # threads waiting on them return at once instead of at their timeout (which held up the
        # process's exit by up to DHT_CALL_TIMEOUT).
        self._pending: set[concurrent.futures.Future[Any]] = set()

    @classmethod
    async def create(cls, p2p: P2P, initial_peers: Sequence[str], identity: Identity | None) -> LoopDHT:
        """A node on the running loop, joined through `initial_peers` over `p2p` (which it does
        not own, and whose daemon was started with the same initial peers: hivemind's node pings
        them by peer id, the daemon knows their addresses), signing its records with `identity`
        and checking everyone's (directory.py)."""
        validators = signed_dht_kwargs(identity)["record_validators"]
        node = await DHTNode.create(
            initial_peers=list(initial_peers), p2p=p2p, record_validator=CompositeValidator(validators)
        )
        return cls(node, asyncio.get_running_loop(), identity)

    def _submit(self, coro: Coroutine[Any, Any, T], return_future: bool) -> concurrent.futures.Future[T] | T:
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if self.closed:
            coro.close()
            raise RuntimeError("the DHT node has shut down")
        if on_loop:
            coro.close()
            raise RuntimeError(
                "a DHT call from the event loop's own thread would wait on itself: use a thread"
            )
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future if return_future else future.result()

    def get(self, key: str, latest: bool = False, return_future: bool = False) -> Any:
        return self._submit(self.node.get(key, latest=latest), return_future)

    def store(
        self, key: str, value: Any, expiration_time: float, subkey: Any = None, return_future: bool = False
    ) -> Any:
        return self._submit(self.node.store(key, value, expiration_time, subkey=subkey), return_future)

    def run_coroutine(
        self, coro: Callable[[Any, DHTNode], Coroutine[Any, Any, T]], return_future: bool = False
    ) -> Any:
        return self._submit(coro(self, self.node), return_future)

    async def shutdown(self) -> None:
        """Stop the node. hivemind removes its handlers from the daemon one request each, and its
        control connection never fails a request to a daemon that has died: it waits forever (a
        peer whose group got SIGTERM, p2pd's included, took the whole 10 s grace to stop, then was
        SIGKILLed). So skip that with a dead daemon and give up after a bound with a live one: the
        transport stops the daemon next, and its handlers with it."""
        if self.closed:
            return
        self.closed = True
        for future in list(self._pending):
            future.cancel()
        self.node.is_alive = False
        child = getattr(self.node.p2p, "_child", None)
        if child is not None and child.returncode is not None:
            return
        with contextlib.suppress(TimeoutError, P2PDaemonError, OSError):
            await asyncio.wait_for(self.node.shutdown(), SHUTDOWN_TIMEOUT)
