"""Both ways at once over a shaped link: what share of it each stack gets (needs root: the testbed).

NoLoCo's outer exchange sends a stage's weights each way between two peers at the same time, and
its target is at most 1.1x the physical floor (bytes x 8 / rate). `bench/outer_sync.py` measures
the whole outer step; this bench measures the transfer under it, so its gap to the floor can be
put down to a layer. Two hosts of the namespace testbed, each behind its own link shaped with tbf
(both ways, the testbed's default bucket and a `--queue-ms` queue), each running one endpoint
process; for every mode the two start together and each times until it has sent and received
everything; a mode's time is the later of the two:

  kernel-both    plain TCP on one connection, both ways at once (what the link itself allows)
  p2p-tcp-one    our transport over p2pd, TCP with noise and yamux (the peer's default), one way
  p2p-tcp-both   the same, both ways at once: each side calls the other's sink at once
  p2p-quic-one   our transport over p2pd's QUIC transport, one way
  p2p-quic-both  the same, both ways at once
  p2p-tcp-paced  p2p-tcp-both with each side's sending capped at `--pace` of the link rate
  p2p-quic-paced the same over QUIC

Why cap: both ways over one shaped link, each side's data fills its queue and the partner's ACKs
wait behind it, which slows the partner's sending. A cap just under the rate keeps the queue empty.

`--streams K` cuts each side's tensor into K calls made at once (separate streams, each with its
own flow-control window). Modes alternate within each repetition; the first repetition (it dials)
is left out; figures are medians of wall / floor.

    sudo python bench/duplex_link.py --rates 25,100 --reps 6 --pace 0.93 \
        --modes kernel-both,p2p-tcp-both,p2p-tcp-paced,p2p-tcp-one --out docs/results/duplex_link_paced.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from noloco_swarm.peer.net.streams import Pacer
from noloco_swarm.peer.net.transport import Accepts, Transport, TransportConfig
from noloco_swarm.protocol import codec, rpc
from noloco_swarm.testbed.bed import Testbed, default_burst_kbit, namespaces_permitted

MODES = (
    "kernel-both",
    "p2p-tcp-one",
    "p2p-tcp-both",
    "p2p-quic-one",
    "p2p-quic-both",
    "p2p-tcp-paced",
    "p2p-quic-paced",
)
MIB = 1 << 20
KERNEL_PORT = 5071
SINK = "rpc_duplex_sink"


# -- endpoint (one per testbed host) ---------------------------------------------------------


class Endpoint:
    """One host's side: a kernel TCP listener and two transports (p2pd over TCP, over QUIC)."""

    def __init__(self, address: str, size_mib: int, streams: int) -> None:
        self.address, self.streams = address, streams
        self.payload = torch.randn(size_mib * MIB // 4)
        self.data = self.payload.numpy().tobytes()
        self.transports: dict[str, Transport] = {}
        self.peers: dict[str, str] = {}  # transport kind -> the other side's peer id
        self.other_ip = ""
        self.received = 0
        self.arrived = asyncio.Event()
        self.accepted: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

    async def start(self) -> str:
        config = TransportConfig(part_bytes=1 << 20, max_frame_bytes=1 << 30, max_peer_inflight_bytes=1 << 30)
        listen = {"tcp": f"/ip4/{self.address}/tcp/0", "quic": f"/ip4/{self.address}/udp/0/quic-v1"}
        for kind, maddr in listen.items():
            transport = await Transport.create(config=config, host_maddrs=[maddr])
            transport.register(SINK, self._sink, Accepts(1, 1 << 30, frozenset({"float32"})))
            self.transports[kind] = transport
        await asyncio.start_server(self._accept, self.address, KERNEL_PORT)
        addrs = [str((await t.visible_addresses())[0]) for t in self.transports.values()]
        return " ".join(addrs)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.accepted.put((reader, writer))

    async def _sink(self, peer: str, header: codec.Message, tensors: list[torch.Tensor]) -> tuple:
        self.received += tensors[0].numel() * 4
        if self.received >= len(self.data):
            self.arrived.set()
        return rpc.Ack(), []

    async def connect(self, tcp_maddr: str, quic_maddr: str, ip: str) -> None:
        self.other_ip = ip
        for kind, maddr in (("tcp", tcp_maddr), ("quic", quic_maddr)):
            peer = maddr.rsplit("/p2p/", 1)[1]
            if not await self.transports[kind].connect(peer, [maddr], timeout=30):
                raise RuntimeError(f"could not connect to {maddr}")
            self.peers[kind] = peer

    async def run(self, mode: str, caller: bool, pace: float) -> float:
        """One transfer of `mode`; returns this side's seconds until it sent and got everything.
        `pace`: bytes/s a paced mode's sending is capped at."""
        self.received, self.arrived = 0, asyncio.Event()
        start = time.perf_counter()
        if mode == "kernel-both":
            await self._kernel(caller)
        else:
            kind, ways = mode.split("-")[1:]
            jobs = []
            if ways != "one" or caller:
                jobs.append(self._send(kind, Pacer(pace) if ways == "paced" else None))
            if ways != "one" or not caller:
                jobs.append(self.arrived.wait())
            await asyncio.gather(*jobs)
        return time.perf_counter() - start

    async def _send(self, kind: str, pace: Pacer | None) -> None:
        transport, peer = self.transports[kind], self.peers[kind]
        calls = [  # one pacer for all: the K calls together keep to its rate
            transport.call(peer, SINK, rpc.Ack(), [part.contiguous()], timeout=600, pace=pace)
            for part in self.payload.chunk(self.streams)
        ]
        await asyncio.gather(*calls)

    async def _kernel(self, caller: bool) -> None:
        if caller:
            reader, writer = await asyncio.open_connection(self.other_ip, KERNEL_PORT)
        else:
            reader, writer = await self.accepted.get()

        async def send() -> None:
            writer.write(self.data)
            await writer.drain()

        await asyncio.gather(send(), reader.readexactly(len(self.data)))
        writer.close()

    async def close(self) -> None:
        for transport in self.transports.values():
            await transport.shutdown()


async def endpoint(address: str, size_mib: int, streams: int) -> None:
    """Serve the parent's lines: `peer TCP QUIC IP`, `go MODE caller|callee PACE`, `quit`."""
    side = Endpoint(address, size_mib, streams)
    print("ready", await side.start(), flush=True)
    loop = asyncio.get_running_loop()
    try:
        while line := (await loop.run_in_executor(None, sys.stdin.readline)).split():
            if line[0] == "peer":
                await side.connect(line[1], line[2], line[3])
                print("connected", flush=True)
            elif line[0] == "go":
                print("done", await side.run(line[1], line[2] == "caller", float(line[3])), flush=True)
            else:
                break
    finally:
        await side.close()


# -- parent: the testbed, the schedule, the figures -------------------------------------------


def measure(rate: float, args: argparse.Namespace) -> dict[str, list[float]]:
    """Every mode, `reps` + 1 times alternating, on two hosts shaped to `rate` Mbit/s."""
    floor = args.size_mib * MIB * 8 / (rate * 1e6)
    pace = str(args.pace * rate * 1e6 / 8)
    ratios: dict[str, list[float]] = {m: [] for m in args.modes}
    with Testbed(["a", "b"]) as bed:
        procs = {}
        try:
            for name in ("a", "b"):
                bed.shape(name, rate, latency_ms=args.queue_ms)
                argv = [sys.executable, __file__, "--endpoint", bed.hosts[name].address]
                argv += ["--size-mib", str(args.size_mib), "--streams", str(args.streams)]
                procs[name] = bed.popen(name, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            ready = {name: _expect(p, "ready").split()[1:] for name, p in procs.items()}
            for name, other in (("a", "b"), ("b", "a")):
                _say(procs[name], "peer", *ready[other], bed.hosts[other].address)
            for p in procs.values():
                _expect(p, "connected")
            for rep in range(args.reps + 1):
                for mode in args.modes if rep % 2 else reversed(args.modes):
                    time.sleep(0.5)  # let the queues drain between transfers
                    _say(procs["b"], "go", mode, "callee", pace)  # b waits for a's connection or data
                    _say(procs["a"], "go", mode, "caller", pace)
                    seconds = max(float(_expect(p, "done").split()[1]) for p in procs.values())
                    if rep:
                        ratios[mode].append(seconds / floor)
                        print(
                            f"{rate:g} Mbit/s {mode:14s} {seconds:.2f} s = {seconds / floor:.3f}x floor",
                            flush=True,
                        )
        finally:
            for p in procs.values():
                if p.stdin is not None and p.poll() is None:
                    p.stdin.close()
            for p in procs.values():
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    return ratios


def _say(proc: subprocess.Popen, *words: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(" ".join(words) + "\n")
    proc.stdin.flush()


def _expect(proc: subprocess.Popen, word: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(word):
        raise RuntimeError(f"an endpoint said {line!r}, expected {word!r} (exit code {proc.poll()})")
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", metavar="ADDRESS", help=argparse.SUPPRESS)
    ap.add_argument("--rates", default="25,100", help="link rates in Mbit/s, comma-separated")
    ap.add_argument(
        "--size-mib", type=int, default=8, help="MiB each side sends (8: the tiny stage's weights)"
    )
    ap.add_argument("--streams", type=int, default=1, help="calls at once per side, each with a slice")
    ap.add_argument("--pace", type=float, default=0.93, help="the paced modes' cap, a share of the link rate")
    ap.add_argument("--queue-ms", type=float, default=100.0, help="the shapers' queue (tbf latency)")
    ap.add_argument("--modes", default=",".join(MODES), help="modes to run, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.endpoint:
        asyncio.run(endpoint(args.endpoint, args.size_mib, args.streams))
        return
    if not 0 < args.pace <= 1:
        sys.exit(f"--pace is a share of the link rate, 0 < pace <= 1; got {args.pace}")
    args.modes = args.modes.split(",")
    if unknown := set(args.modes) - set(MODES):
        sys.exit(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    ok, why = namespaces_permitted()
    if not ok:
        sys.exit(f"duplex_link needs the namespace testbed: {why}")
    rows = []
    for rate in (float(x) for x in args.rates.split(",")):
        ratios = measure(rate, args)
        row = {
            "rate_mbit": rate,
            "burst_kbit": default_burst_kbit(rate),
            "over_floor": {m: statistics.median(v) for m, v in ratios.items()},
            "runs": ratios,
        }
        rows.append(row)
        print(f"{rate:g} Mbit/s, medians of {args.reps}: ", end="")
        print(", ".join(f"{m} {r:.3f}x" for m, r in row["over_floor"].items()), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": "sudo python bench/duplex_link.py " + " ".join(sys.argv[1:]),
            "size_mib": args.size_mib,
            "streams": args.streams,
            "pace": args.pace,
            "queue_ms": args.queue_ms,
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
