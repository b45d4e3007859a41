"""User-space latency: a TCP relay that holds each direction's bytes for a fixed one-way delay.

`netem` is not available on these machines, so latency is added above the kernel. A `Route`
listens on one address and forwards every connection it accepts to a target address; each chunk
read from one side is written to the other `forward_s` (towards the target) or `backward_s`
(back) seconds after it was read, and chunks stay in order. A libp2p peer is reached through the
delayed path when it announces the relay's address (`noloco join --announce-maddrs`) instead of
its own listen address: whoever dials it then dials the relay.

What it emulates: a fixed added one-way latency on the application bytes of connections dialled
to the relay address, independently per direction, with bytes in flight bounded (`window`) so a
slow reader pushes back on the writer. What it does not: jitter, loss, reordering or a bandwidth
limit (shape the link with `Testbed.shape` for that); delay of TCP handshakes and ACKs (each leg is
its own TCP connection with its own short round trip, so TCP's congestion control never sees the
delay: throughput is not bounded by window / RTT as on a real long link); connections the peer
dials itself (a connection is delayed only if it was made to a relay, so give every peer a relay
to delay every pair); UDP or QUIC.

A route's delays can change while it serves (`DelayRelay.set_delay`: a delay spike); a chunk keeps
the delay it was read under, and chunks stay in order when the delay falls.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass

CHUNK = 64 * 1024


@dataclass(frozen=True)
class Route:
    """Accept on (listen_host, listen_port) (port 0: any free one) and forward to the target."""

    listen_host: str
    listen_port: int
    target_host: str
    target_port: int
    forward_s: float
    backward_s: float
    window: int = 4 * 1024 * 1024
    """Bytes held in flight per direction before the relay stops reading from the sender."""

    def __post_init__(self) -> None:
        if self.forward_s < 0 or self.backward_s < 0:
            raise ValueError(f"delays must be >= 0 s, got {self.forward_s} and {self.backward_s}")
        if self.window < CHUNK:
            raise ValueError(f"window must be at least {CHUNK} bytes, got {self.window}")


class Lag:
    """A route's one-way delays now, in seconds: each chunk takes the delay of the moment it was
    read. Only the relay's event loop reads or changes it."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        self.forward_s, self.backward_s = forward_s, backward_s


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    delay: Callable[[], float],
    window: int,
) -> None:
    """Copy reader to writer, each chunk `delay()` s after it was read, as a link would: what was
    read is delivered even if the sender then closes or resets (the other direction does not
    matter), an EOF is passed on as a half-close and a reset as an abort, each after the delay."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue(maxsize=max(1, window // CHUNK))

    async def read() -> None:
        while True:
            try:
                data: bytes | None = await reader.read(CHUNK)
            except OSError:
                data = None  # reset by the sender
            await queue.put((loop.time() + delay(), data))
            if not data:
                return

    async def write() -> None:
        while True:
            due, data = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if data is None:
                writer.transport.abort()
                return
            if not data:
                if writer.can_write_eof() and not writer.is_closing():
                    writer.write_eof()
                return
            writer.write(data)
            try:
                await writer.drain()
            except OSError:  # the receiver is gone: nothing more can reach it
                reading.cancel()
                return

    async with asyncio.TaskGroup() as tg:
        reading = tg.create_task(read())
        tg.create_task(write())


async def _relay(
    route: Route, lag: Lag, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
) -> None:
    """One accepted connection: dial the target, pump both ways, close both ends however it ends."""
    target_w = None
    try:
        target_r, target_w = await asyncio.wait_for(
            asyncio.open_connection(route.target_host, route.target_port), timeout=10.0
        )
        async with asyncio.TaskGroup() as tg:
            tg.create_task(_pump(client_r, target_w, lambda: lag.forward_s, route.window))
            tg.create_task(_pump(target_r, client_w, lambda: lag.backward_s, route.window))
    except* (OSError, TimeoutError, asyncio.IncompleteReadError):
        pass  # a reset or unreachable target ends this connection only, as it would end a real one
    finally:
        for w in (client_w, target_w):
            if w is not None:
                w.close()
                with suppress(OSError):
                    await w.wait_closed()


async def serve(
    routes: Sequence[Route],
    ready: asyncio.Future[list[int]],
    stop: asyncio.Event,
    lags: Sequence[Lag] | None = None,
) -> None:
    """Serve every route until `stop` is set; `ready` gets the bound ports (in route order).
    Binding happens first, so an address in use raises a plain OSError before anything serves.
    `lags`: each route's delays, which may change meanwhile (default: the routes' own, fixed)."""
    if lags is None:
        lags = [Lag(r.forward_s, r.backward_s) for r in routes]
    connections: set[asyncio.Task[None]] = set()
    group: list[asyncio.TaskGroup] = []  # the owner of every connection, once it exists

    def accept(route: Route, lag: Lag) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], None]:
        def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            task = group[0].create_task(_relay(route, lag, r, w))
            connections.add(task)
            task.add_done_callback(connections.discard)

        return on_connect

    servers: list[asyncio.Server] = []
    try:
        for route, lag in zip(routes, lags, strict=True):
            servers.append(
                await asyncio.start_server(
                    accept(route, lag), route.listen_host, route.listen_port, start_serving=False
                )
            )
        async with asyncio.TaskGroup() as tg:
            group.append(tg)
            for server in servers:
                await server.start_serving()
            ready.set_result([s.sockets[0].getsockname()[1] for s in servers])
            await stop.wait()
            for server in servers:
                server.close()
            for task in list(connections):
                task.cancel()
    finally:
        for server in servers:
            server.close()


class DelayRelay:
    """`serve` on its own thread and event loop, for synchronous callers:

    with DelayRelay([Route(...)]) as relay:
        relay.ports  # where each route listens
    """

    def __init__(self, routes: Sequence[Route]) -> None:
        self.routes = list(routes)
        self.lags = [Lag(r.forward_s, r.backward_s) for r in self.routes]
        self.ports: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="delay-relay", daemon=True)
        self._started = threading.Event()
        self._error: BaseException | None = None

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            ready: asyncio.Future[list[int]] = self._loop.create_future()
            ready.add_done_callback(self._on_ready)
            await serve(self.routes, ready, self._stop, self.lags)

        try:
            asyncio.run(main())
        except OSError as e:  # handed to the owner in __enter__ (e.g. the address is in use)
            self._error = e
        finally:
            self._started.set()

    def _on_ready(self, ready: asyncio.Future[list[int]]) -> None:
        self.ports = ready.result()
        self._started.set()

    def set_delay(self, index: int, forward_s: float, backward_s: float) -> None:
        """Route `index` delays what it reads from now on by these (seconds each way)."""
        if forward_s < 0 or backward_s < 0:
            raise ValueError(f"delays must be >= 0 s, got {forward_s} and {backward_s}")
        if self._loop is None or not self._thread.is_alive():
            raise RuntimeError("the delay relay is not running")
        lag = self.lags[index]

        def change() -> None:
            lag.forward_s, lag.backward_s = forward_s, backward_s

        self._loop.call_soon_threadsafe(change)

    def __enter__(self) -> DelayRelay:
        self._thread.start()
        self._started.wait(timeout=30)
        if len(self.ports) != len(self.routes):
            self._thread.join(timeout=5)
            raise RuntimeError(f"the delay relay did not start: {self._error!r}") from self._error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=15)
