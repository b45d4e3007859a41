"""Moving one flat fp32 tensor A -> B over libp2p on loopback: our transport vs hivemind's usual path.

Modes, alternated within each repetition over the same two p2pd daemons:
  ours           noloco_swarm.peer.net.transport: envelope + raw parts read straight into one buffer
  pbparts        protobuf stream of runtime_pb2.Tensor parts, each copied into a preallocated buffer
  hivemind       serialize_torch_tensor + split_for_streaming -> combine_from_streaming + deserialize,
                 in hivemind's default 64 KiB chunks (hivemind.utils.streaming)
  hivemind_part  the same, in chunks of our part size
Ratios are against `hivemind`. Only `ours` also checks every float for NaN/inf on arrival.

With `--shaped-mbit N` (root, Linux) the receiver runs in its own network namespace, joined to
ours by a veth pair whose two ends are shaped to N Mbit/s with a `tbf` qdisc, and the table adds
each mode's share of that link (payload bits / N Mbit/s; TCP, noise and yamux framing are part
of the gap to 100%).

The receiver B is a child process (as on a real swarm, where sender and receiver do not share a
Python interpreter). Timings come from one pass over all modes; memory from a second pass with a
fresh receiver per mode, where each side samples its own RSS every 2 ms and "extra" is the peak
over the transfer minus the RSS before it, in multiples of the tensor's size.

    python bench/exchange_throughput.py --sizes-mib 64 256 --reps 3
    python bench/exchange_throughput.py --sizes-mib 256 --reps 3 --shaped-mbit 1000 --no-memory
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator

import torch
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, P2PHandlerError, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import STREAMING_CHUNK_SIZE_BYTES, combine_from_streaming, split_for_streaming

from noloco_swarm.peer.net.lifetime import M_MMAP_THRESHOLD
from noloco_swarm.peer.net.transport import Accepts, RemoteRefused, Transport, TransportConfig
from noloco_swarm.protocol import codec, rpc

FAILURES: dict[tuple[int, str], int] = {}
MODES = ("ours", "pbparts", "hivemind", "hivemind_part")
MIB = 1 << 20
HOST_ADDR, NS_ADDR = "10.231.0.1", "10.231.0.2"  # the shaped link's two ends


class RssPeak:
    """Samples this process's RSS in a thread; `reset` starts a window, `extra` is its peak rise."""

    def __init__(self, interval: float = 0.002) -> None:
        self._page = resource.getpagesize()
        self._base = self._peak = self.rss()
        self._cpu = time.process_time()
        self._interval = interval
        threading.Thread(target=self._run, daemon=True).start()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while True:
            self._peak = max(self._peak, self.rss())
            time.sleep(self._interval)

    def reset(self) -> None:
        self._base = self._peak = self.rss()
        self._cpu = time.process_time()

    def cpu(self) -> float:
        """CPU seconds this process spent (all threads) since `reset`."""
        return time.process_time() - self._cpu

    def extra(self) -> int:
        return max(self._peak, self.rss()) - self._base


# -- receiver (child process) ----------------------------------------------------------------


async def serve(part_bytes: int, listen: str) -> None:
    rss = RssPeak()
    config = TransportConfig(
        part_bytes=part_bytes,
        max_frame_bytes=2 << 30,
        max_peer_inflight_bytes=2 << 30,
        max_inflight_bytes=4 << 30,
    )
    transport = await Transport.create(config=config, host_maddrs=[listen])
    p2p = transport.p2p

    def report(tensor: torch.Tensor) -> str:
        summary = {"extra": rss.extra(), "cpu": rss.cpu(), "numel": tensor.numel()}
        return json.dumps(summary | {"sum": float(tensor[:1000].sum())})

    async def reset(peer: str, header: codec.Message, tensors: list[torch.Tensor]) -> tuple:
        rss.reset()
        return rpc.Ack(), []

    async def ours(peer: str, header: codec.Message, tensors: list[torch.Tensor]) -> tuple:
        return rpc.Ack(note=report(tensors[0])), []

    async def pbparts(parts: AsyncIterator[runtime_pb2.Tensor], _: P2PContext) -> runtime_pb2.ExpertUID:
        buffer, filled = None, 0
        async for part in parts:
            if buffer is None:  # the first part carries the size, as split_for_streaming does
                buffer = torch.empty(tuple(part.size), dtype=torch.float32)
                view = memoryview(buffer.view(-1).view(torch.uint8).numpy())
            view[filled : filled + len(part.buffer)] = part.buffer
            filled += len(part.buffer)
        assert buffer is not None and filled == buffer.numel() * 4
        return runtime_pb2.ExpertUID(uid=report(buffer))

    async def hivemind_path(parts: AsyncIterator[runtime_pb2.Tensor], _: P2PContext) -> runtime_pb2.ExpertUID:
        received = [part async for part in parts]
        tensor = deserialize_torch_tensor(combine_from_streaming(received))
        del received
        return runtime_pb2.ExpertUID(uid=report(tensor))

    transport.register("rpc_bench_reset", reset)
    transport.register("rpc_bench", ours, Accepts(1, 2 << 30, frozenset({"float32"})))
    for name, handler in (
        ("pbparts", pbparts),
        ("hivemind", hivemind_path),
        ("hivemind_part", hivemind_path),
    ):
        await p2p.add_protobuf_handler(f"bench.{name}", handler, runtime_pb2.Tensor, stream_input=True)
    print("ready", (await transport.visible_addresses())[0], flush=True)
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent exits
    finally:
        await transport.shutdown()


# -- sender (parent) -------------------------------------------------------------------------


async def send(mode: str, transport: Transport, peer: str, tensor: torch.Tensor, part_bytes: int) -> str:
    """One transfer; returns the receiver's JSON report."""
    if mode == "ours":
        reply, _ = await transport.call(peer, "rpc_bench", rpc.Ack(), [tensor], timeout=600)
        assert isinstance(reply, rpc.Ack)
        return reply.note
    if mode == "pbparts":
        data = memoryview(tensor.view(torch.uint8).numpy())

        async def parts() -> AsyncIterator[runtime_pb2.Tensor]:
            yield runtime_pb2.Tensor(
                buffer=data[:part_bytes].tobytes(), size=list(tensor.shape), dtype="float32"
            )
            for offset in range(part_bytes, len(data), part_bytes):
                yield runtime_pb2.Tensor(buffer=data[offset : offset + part_bytes].tobytes())

        stream = parts()
    else:

        async def chunks() -> AsyncIterator[runtime_pb2.Tensor]:
            chunk_bytes = part_bytes if mode == "hivemind_part" else STREAMING_CHUNK_SIZE_BYTES
            for chunk in split_for_streaming(serialize_torch_tensor(tensor), chunk_bytes):
                yield chunk

        stream = chunks()
    name = f"bench.{mode}"
    reply = await transport.p2p.call_protobuf_handler(
        PeerID.from_base58(peer), name, stream, runtime_pb2.ExpertUID
    )
    return reply.uid


# Per (MiB, mode), one row per rep: MiB/s, sender and receiver extra memory, their CPU s per GiB.
Rows = dict[tuple[int, str], list[tuple[float, float, float, float, float]]]


async def measure(
    args: argparse.Namespace, modes: list[str], sizes: list[int], reps: int, rss: RssPeak, env: dict
) -> Rows:
    """Start a fresh receiver and sender, then time `reps` alternating transfers per mode and size."""
    part = args.part_kib << 10
    prefix = ["ip", "netns", "exec", args.netns] if args.netns else []
    listen = f"/ip4/{NS_ADDR}/tcp/0" if args.netns else "/ip4/127.0.0.1/tcp/0"
    child = subprocess.Popen(
        [*prefix, sys.executable, __file__, "--serve", "--part-kib", str(args.part_kib), "--listen", listen],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    assert child.stdout is not None and child.stdin is not None
    transport = None
    results: Rows = {}
    try:
        line = await asyncio.to_thread(child.stdout.readline)
        if not line.startswith("ready "):
            raise RuntimeError(f"receiver did not start: {line!r}")
        addr = line.split()[1]
        transport = await Transport.create(
            initial_peers=[addr],
            config=TransportConfig(part_bytes=part),
            host_maddrs=[f"/ip4/{HOST_ADDR}/tcp/0" if args.netns else "/ip4/127.0.0.1/tcp/0"],
        )
        peer = addr.rsplit("/p2p/", 1)[1]
        for size in sizes:
            tensor = torch.randn(size * MIB // 4)
            for rep in range(reps + 1):  # rep 0 warms up connections and allocators
                for mode in modes if rep % 2 else reversed(modes):
                    await transport.call(peer, "rpc_bench_reset", rpc.Ack(), timeout=30)
                    rss.reset()
                    start = time.perf_counter()
                    try:
                        report = json.loads(await send(mode, transport, peer, tensor, part))
                    except (ValueError, ConnectionError, P2PHandlerError, RemoteRefused) as e:
                        # hivemind's stream path now and then ends with no response on this busy
                        # machine; count it against the mode rather than abort the comparison
                        FAILURES[(size, mode)] = FAILURES.get((size, mode), 0) + 1
                        print(f"{mode} {size} MiB failed: {type(e).__name__}: {e}", file=sys.stderr)
                        continue
                    seconds = time.perf_counter() - start
                    assert report["numel"] == tensor.numel()
                    assert abs(report["sum"] - float(tensor[:1000].sum())) < 1e-3
                    if rep:
                        nbytes = tensor.numel() * 4
                        per_gib = (1 << 30) / nbytes
                        row = (
                            size / seconds,
                            rss.extra() / nbytes,
                            report["extra"] / nbytes,
                            rss.cpu() * per_gib,
                            report["cpu"] * per_gib,
                        )
                        results.setdefault((size, mode), []).append(row)
    finally:
        if transport is not None:
            await transport.shutdown()
        child.stdin.close()
        child.wait(timeout=30)
    return results


@contextlib.contextmanager
def shaped_link(mbit: int) -> Iterator[str]:
    """A network namespace behind a veth pair shaped to `mbit` Mbit/s each way; removed at exit."""
    ns, host_if, ns_if = (
        f"noloco-bench-{os.getpid()}",
        f"nlb{os.getpid() % 10000}a",
        f"nlb{os.getpid() % 10000}b",
    )
    rate = ["tbf", "rate", f"{mbit}mbit", "burst", f"{max(mbit * 1000 // 8 // 100, 32)}kb", "latency", "50ms"]
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
        ["ip", "link", "set", ns_if, "netns", ns],
        ["ip", "addr", "add", f"{HOST_ADDR}/30", "dev", host_if],
        ["ip", "link", "set", host_if, "up"],
        ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{NS_ADDR}/30", "dev", ns_if],
        ["ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up"],
        ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"],
        ["tc", "qdisc", "add", "dev", host_if, "root", *rate],
        ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ns_if, "root", *rate],
    ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, text=True)
        yield ns
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)  # and its peer
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


async def run(args: argparse.Namespace) -> None:
    rss = RssPeak()
    speeds = await measure(args, args.modes, args.sizes_mib, args.reps, rss, {})
    memory: Rows = {}
    if not args.no_memory:
        # Memory pass: a fresh receiver per mode, and a fixed glibc mmap threshold on both sides, so
        # every large buffer goes back to the OS when freed and no mode hides its peak in heap left
        # by another. (Not for the timings: it makes many small allocations slower.)
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 << 10)
        env = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
        for mode in args.modes:
            memory |= await measure(args, [mode], [max(args.sizes_mib)], 1, rss, env)
    print_table(args, speeds, memory)


def print_table(args: argparse.Namespace, speeds: Rows, memory: Rows) -> None:
    link = f"a veth pair shaped to {args.shaped_mbit} Mbit/s (tbf)" if args.netns else "loopback"
    print(f"\n{link}, 2 p2pd daemons, part {args.part_kib} KiB, torch threads {torch.get_num_threads()}")
    print(f"median of {args.reps} alternating reps; CPU: Python process seconds per GiB (p2pd not included);")
    print("extra: peak RSS rise during the transfer / tensor size (separate pass, fresh receiver per mode)")
    head = (
        "MiB",
        "mode",
        "MiB/s",
        "vs hivemind",
        "CPU send",
        "CPU recv",
        "extra send",
        "extra recv",
        "of link",
    )
    print("{:>5} {:>14} {:>7} {:>12} {:>9} {:>9} {:>11} {:>11} {:>8}".format(*head))
    for size in args.sizes_mib:
        base = statistics.median(r[0] for r in speeds.get((size, "hivemind"), [(float("nan"),)]))
        for mode in args.modes:
            rows = speeds.get((size, mode))
            if not rows:
                print(f"{size:>5} {mode:>14}  every transfer failed")
                continue
            speed, cpu_send, cpu_recv = (statistics.median(r[i] for r in rows) for i in (0, 3, 4))
            mem = memory.get((size, mode))
            extra = [f"{mem[0][i]:.2f}x" if mem else "-" for i in (1, 2)]
            share = f"{speed * MIB * 8 / (args.shaped_mbit * 1e6):.1%}" if args.netns else "-"
            print(
                f"{size:>5} {mode:>14} {speed:>7.0f} {speed / base:>11.2f}x {cpu_send:>9.2f} {cpu_recv:>9.2f} "
                f"{extra[0]:>11} {extra[1]:>11} {share:>8}"
            )
    for (size, mode), count in sorted(FAILURES.items()):
        print(f"{mode} at {size} MiB: {count} transfer(s) failed and are not in the figures")
    print("\nreproduce: python bench/exchange_throughput.py " + " ".join(sys.argv[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--part-kib", type=int, default=1024, help="our part size (64 .. 4096)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--no-memory", action="store_true", help="skip the memory pass")
    parser.add_argument("--shaped-mbit", type=int, default=0, help="receiver behind a tbf-shaped veth link")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.netns = ""
    # Transfers and torch compete for the same cores; keep torch to one thread on both sides.
    torch.set_num_threads(1)
    os.environ.setdefault("GOLOG_LOG_LEVEL", "error")
    if args.serve:
        asyncio.run(serve(args.part_kib << 10, args.listen))
    elif args.shaped_mbit:
        with shaped_link(args.shaped_mbit) as args.netns:
            asyncio.run(run(args))
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
