"""A joiner's state download: hivemind's `load_state_from_peers` against ours, same bytes, one run.

Modes, alternated within each repetition (the machine is shared and noisy: compare within a run):
  hivemind     two hivemind `DecentralizedAverager`s on their own DHTs; the joiner calls
               `load_state_from_peers()`: the donor streams its `get_current_state()` tensors as
               protobuf parts (hivemind's default 64 KiB, no compression) over libp2p, and the
               averager process hands them to the caller. What a hivemind `Optimizer` does to join.
  ours-1       peer/donors.download_state from one donor: manifest, then chunks (sha256 checked on
               arrival) over our transport, assembled into the four state parts.
  ours-2/-3    the same from two / three donors holding the same bytes, all sending at once.
  ours-2-own   two donors that share phi and delta but not the AdamW moments (NoLoCo's replicas
               after an outer step whose group spans the stage): the moments come from the
               target only.

The state is four flat fp32 tensors (phi, delta, exp_avg, exp_avg_sq) of `--mib / 4` MiB each.
Every donor is its own process (as on a swarm: donor and joiner never share an interpreter),
with its own p2pd; the joiner is this process. Donors hash their snapshot before the clock
starts, as a replica does when it takes the snapshot at the boundary. Times are wall clock
from the request to the assembled, checked state; MiB/s is state MiB over that time.

With `--shaped-mbit N` (root, Linux) every donor runs in its own network namespace of a
testbed (noloco_swarm/testbed) whose link is shaped to N Mbit/s each way with `tbf`, as a
volunteer's uplink would be; the joiner stays in the root namespace, on the bridge. There the
donors' links, not the CPU, are the bottleneck, and what several donors are for shows.

    python bench/state_transfer.py --mib 256 --reps 3
    python bench/state_transfer.py --mib 256 --reps 3 --shaped-mbit 200 --out docs/results/state_transfer_shaped.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from noloco_swarm.peer.donors import Snapshot, download_state
from noloco_swarm.peer.net.transport import Transport, TransportConfig
from noloco_swarm.protocol import codec, rpc
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.testbed.bed import Testbed, namespaces_permitted

MIB = 1 << 20
RUN = "bench"
VIEW = MembershipView(1, (("donor", "joiner"),))
CONFIG = TransportConfig(serve_timeout=600)
HIVEMIND_OPTIONS = dict(prefix="bench_state", target_group_size=2, min_matchmaking_time=1.0, start=True)


def state(numel: int, seed: int, shared_moments: bool = True) -> dict[str, torch.Tensor]:
    """The parts; phi and delta are the same for every seed, the moments too if `shared_moments`."""
    common = torch.Generator().manual_seed(0)
    own = torch.Generator().manual_seed(seed if not shared_moments else 0)
    return {
        "phi": torch.randn(numel, generator=common),
        "delta": torch.randn(numel, generator=common),
        "exp_avg": torch.randn(numel, generator=own),
        "exp_avg_sq": torch.rand(numel, generator=own),
    }


# -- donor processes ------------------------------------------------------------------------


async def serve(numel: int, seed: int, shared_moments: bool, listen: str) -> None:
    """A donor: serve one snapshot until stdin closes. Prints its address once ready."""
    snapshot = Snapshot.take(state(numel, seed, shared_moments), 6, "e" * 64, VIEW, 6)

    async def manifest(peer: str, header: codec.Message, _: list) -> tuple[codec.Message, list]:
        return snapshot.manifest(RUN, 0), []

    async def chunk(peer: str, header: codec.Message, _: list) -> tuple[codec.Message, list]:
        assert isinstance(header, rpc.ChunkRequest)
        reply, tensor = snapshot.chunk(RUN, 0, header)
        return reply, [tensor]

    transport = await Transport.create(host_maddrs=[listen], config=CONFIG)
    try:
        transport.register("rpc_fetch_state", manifest)
        transport.register("rpc_fetch_chunk", chunk)
        print(json.dumps({"addresses": await transport.visible_addresses()}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        await transport.shutdown()


def serve_hivemind(numel: int, listen: str) -> None:
    """hivemind's donor: a DHT node and an averager that shares its state, until stdin closes."""
    import hivemind
    from hivemind.averaging import DecentralizedAverager

    dht = hivemind.DHT(host_maddrs=[listen], start=True)
    tensors = [state(numel, 0)[k] for k in rpc.STATE_PARTS]
    averager = DecentralizedAverager(tensors, dht, allow_state_sharing=True, **HIVEMIND_OPTIONS)
    try:
        print(json.dumps({"addresses": [str(a) for a in dht.get_visible_maddrs()]}), flush=True)
        sys.stdin.read()
    finally:
        averager.shutdown()
        dht.shutdown()


@dataclass
class Place:
    """Where the processes run: on loopback, or each donor in its own shaped testbed host."""

    bed: Testbed | None = None

    def listen(self, host: str | None) -> str:
        if self.bed is None:
            return "/ip4/127.0.0.1/tcp/0"
        return f"/ip4/{self.bed.gateway}/tcp/0" if host is None else self.bed.hosts[host].maddr()

    def start(self, host: str, *args: str) -> tuple[subprocess.Popen[str], list[str]]:
        """A donor process (`--serve` or `--serve-hivemind` ...) on `host`; its addresses."""
        argv = [sys.executable, __file__, *args, "--listen", self.listen(host)]
        options = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        proc = self.bed.popen(host, argv, **options) if self.bed else subprocess.Popen(argv, **options)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            proc.kill()
            raise RuntimeError(f"the donor on {host} failed to start")
        return proc, json.loads(line)["addresses"]


# -- the joiner, ours -------------------------------------------------------------------------


async def ours(joiner: Transport, donors: list[str], numel: int, expect: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    got = await download_state(joiner, donors, run_id=RUN, stage=0, round_=1, numel=numel, timeout=600)
    seconds = time.perf_counter() - start
    assert all(torch.equal(got.parts[k], expect[k]) for k in expect), "the state differs"
    return seconds


# -- hivemind ---------------------------------------------------------------------------------


class Hivemind:
    """hivemind's joiner: a DHT node and an averager, which loads the donor's state."""

    def __init__(self, numel: int, donor: list[str], listen: str) -> None:
        import hivemind
        from hivemind.averaging import DecentralizedAverager

        self.state = state(numel, 0)
        # The averager process logs how long its network download took; its handlers are forked
        # from ours, so a file handler added here receives its lines.
        fd, self.log = tempfile.mkstemp(suffix=".log")
        os.close(fd)
        self.handler = logging.FileHandler(self.log)
        logging.getLogger("hivemind.averaging.averager").addHandler(self.handler)
        self.dht = hivemind.DHT(host_maddrs=[listen], initial_peers=donor, start=True)
        zeros = [torch.zeros_like(self.state[k]) for k in rpc.STATE_PARTS]
        self.joiner = DecentralizedAverager(zeros, self.dht, allow_state_sharing=False, **HIVEMIND_OPTIONS)
        deadline = time.monotonic() + 120
        while self.joiner.load_state_from_peers(timeout=60) is None:  # until the donor is announced
            assert time.monotonic() < deadline, "hivemind's joiner never found the donor"
            time.sleep(1.0)

    def network_seconds(self) -> list[float]:
        """The averager's own "Finished downloading state in X s" figures, warm-up excluded."""
        text = Path(self.log).read_text()
        return [float(x) for x in re.findall(r"Finished downloading state in ([0-9.]+)s", text)][1:]

    def fetch(self) -> float:
        start = time.perf_counter()
        loaded = self.joiner.load_state_from_peers(timeout=600)
        seconds = time.perf_counter() - start
        assert loaded is not None, "hivemind's load_state_from_peers found no state"
        _, tensors = loaded
        assert all(torch.equal(a, self.state[k]) for a, k in zip(tensors, rpc.STATE_PARTS, strict=True))
        return seconds

    def close(self) -> None:
        self.joiner.shutdown()
        self.dht.shutdown()
        logging.getLogger("hivemind.averaging.averager").removeHandler(self.handler)
        self.handler.close()
        os.unlink(self.log)


# -- the run ----------------------------------------------------------------------------------


async def bench(
    mib: int, reps: int, modes: list[str], place: Place
) -> tuple[dict[str, list[float]], list[float]]:
    numel = mib * MIB // 16
    same = state(numel, 0)
    donors: list[tuple[subprocess.Popen[str], list[str]]] = []
    joiner, hive = None, None
    try:
        for host, seed in (("d0", 0), ("d1", 1), ("d2", 2)):
            donors.append(place.start(host, "--serve", "--numel", str(numel), "--seed", str(seed)))
        # ours-2-own's second donor: phi and delta as the others, its own moments
        donors.append(place.start("d3", "--serve", "--numel", str(numel), "--seed", "7", "--own-moments"))
        entry = [addrs[0] for _, addrs in donors]
        joiner = await Transport.create(host_maddrs=[place.listen(None)], initial_peers=entry, config=CONFIG)
        ids = [addrs[0].rsplit("/p2p/", 1)[1] for _, addrs in donors]
        plan = {"ours-1": ids[:1], "ours-2": ids[:2], "ours-3": ids[:3], "ours-2-own": [ids[0], ids[3]]}
        await ours(joiner, ids[:3], numel, same)  # warm the connections
        if "hivemind" in modes:
            donors.append(place.start("hm", "--serve-hivemind", "--numel", str(numel)))
            hive = Hivemind(numel, donors[-1][1], place.listen(None))  # forks: main thread only
        seconds: dict[str, list[float]] = {mode: [] for mode in modes}
        for rep in range(reps):
            for mode in modes:
                if mode == "hivemind":
                    assert hive is not None
                    t = await asyncio.to_thread(hive.fetch)
                else:
                    t = await ours(joiner, plan[mode], numel, same)
                seconds[mode].append(t)
                print(f"rep {rep} {mode:>10}: {t:6.2f} s  {mib / t:7.1f} MiB/s", flush=True)
        return seconds, hive.network_seconds() if hive is not None else []
    finally:
        if hive is not None:
            hive.close()
        if joiner is not None:
            await joiner.shutdown()
        for proc, _ in donors:
            assert proc.stdin is not None
            proc.stdin.close()  # a donor's cue to shut down
        for proc, _ in donors:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB (four fp32 parts)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--modes", nargs="+", default=["hivemind", "ours-1", "ours-2", "ours-3", "ours-2-own"]
    )
    parser.add_argument("--out", default="docs/results/state_transfer.json")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--numel", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--own-moments", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-hivemind", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", help=argparse.SUPPRESS)
    parser.add_argument("--shaped-mbit", type=float, default=0, help="each donor behind a tbf-shaped link")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.serve:
        asyncio.run(serve(args.numel, args.seed, not args.own_moments, args.listen))
        return
    if args.serve_hivemind:
        serve_hivemind(args.numel, args.listen)
        return
    load_before = os.getloadavg()[0]  # the machine is shared: say how busy it was
    with contextlib.ExitStack() as stack:
        place = Place()
        if args.shaped_mbit:
            ok, why = namespaces_permitted()
            if not ok:
                raise SystemExit(f"--shaped-mbit: {why}")
            place = Place(stack.enter_context(Testbed(["d0", "d1", "d2", "d3", "hm"])))
            for host in place.bed.hosts:
                place.bed.shape(host, args.shaped_mbit)
        seconds, hive_network = asyncio.run(bench(args.mib, args.reps, args.modes, place))
    median = {mode: statistics.median(ts) for mode, ts in seconds.items()}
    base = median.get("hivemind")
    rows = {}
    print(f"\n{args.mib} MiB state, median of {args.reps} (ratio: ours MiB/s over hivemind's)")
    for mode, t in median.items():
        ratio = base / t if base else None
        rows[mode] = {
            "seconds": seconds[mode],
            "median_s": t,
            "mib_per_s": args.mib / t,
            "vs_hivemind": ratio,
        }
        shown = f"{ratio:.2f}x" if ratio else ""
        print(f"{mode:>10}: {t:6.2f} s  {args.mib / t:7.1f} MiB/s  {shown}")
    if hive_network:
        t = statistics.median(hive_network)
        print(
            f"hivemind's averager logged its network download alone at {t:.2f} s ({args.mib / t:.1f} MiB/s)"
        )
        rows["hivemind-network-only"] = {"seconds": hive_network, "median_s": t, "mib_per_s": args.mib / t}
    out = {
        "link": f"each donor behind {args.shaped_mbit:g} Mbit/s (tbf)" if args.shaped_mbit else "loopback",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "mib": args.mib,
        "reps": args.reps,
        "cpus": os.cpu_count(),
        "load_average_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)],  # before, after
        "machine": platform.platform(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "modes": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
