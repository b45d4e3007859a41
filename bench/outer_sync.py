"""The outer step alone on emulated links: NoLoCo's pairwise exchange against our DiLoCo sharded
all-reduce, N replicas of one stage, with and without stragglers (needs root: the testbed).

Every replica is a real `noloco join` peer on its own testbed host, each host's link shaped to the
rate with tbf (both ways). The swarm has one stage, so a round is H inner steps of a small model
(next to nothing beside the exchange) and then the outer step, which moves the stage's fp32
weights. With stragglers, every inner phase lasts LogNormal(MU, SIGMA) seconds (the paper's
LogNormal(1, 0.5) by default; `NOLOCO_STRAGGLE`, peer/failpoints.py), drawn per replica and round
from the run's seed, so NoLoCo's and DiLoCo's runs straggle exactly alike.

Per run, from the peers' `outer` events (`Outer.seconds`: from a replica's own boundary to the end
of its exchange, waiting for late partners included). The first outer step (it also dials the
partners) is left out.
  sync        mean over replicas and outer steps of Outer.seconds: how long a replica stands at
              its boundary before it trains on (the outer step's wall time as a replica sees it)
  ready       per group and outer step, the seconds of its last member to arrive (the group's
              minimum): the exchange once everyone is there, the transfer alone; median
  floor       the bytes each peer must receive x 8 / rate: the stage's weights for NoLoCo's swap,
              2 (N-1)/N of them for DiLoCo's reduce-scatter plus all-gather
Ratios: ready / floor (the issue's target for NoLoCo: at most 1.1), DiLoCo / NoLoCo for sync and
ready, side by side for the same N, rate and stragglers.

    sudo nice -n 10 python bench/outer_sync.py --out docs/results/outer_sync.json
    sudo python bench/outer_sync.py --replicas 4 --rates 100 --rounds 3     # a quick look
    sudo python bench/outer_sync.py --replicas 2 --rates 100 --bursts 64,auto --queues 20,100 \
        --methods noloco --stragglers off     # the shaper's token bucket and queue, side by side
    sudo python bench/outer_sync.py --replicas 2 --rates 25,100 --transports tcp,quic \
        --methods noloco --stragglers off     # the peers over TCP (yamux) and over QUIC
    sudo python bench/outer_sync.py --replicas 2,4 --rates 25,100 --caps 0,0.93 --repeat 3 \
        --methods noloco --stragglers off     # the exchange capped just under the link's rate

`--caps` are shares of the link rate that the peers' exchange is capped at (peer.exchange_max_mbit;
0: no cap), or `auto`: the cap each peer sets from what its partners measured (the default,
peer/net/uplink.py). `--repeat R` runs the whole set of settings R times over, alternating, so that settings
compared side by side meet the machine in the same state.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import get_args

from noloco_swarm.harness.local import wait
from noloco_swarm.harness.namespaces import namespace_swarm, peer_host
from noloco_swarm.model import build_stage, num_flat
from noloco_swarm.peer.events import Outer, of_kind
from noloco_swarm.peer.failpoints import STRAGGLE_ENV, Straggle
from noloco_swarm.testbed.bed import TransportKind, default_burst_kbit, namespaces_permitted
from noloco_swarm.testbed.schedule import Shape
from noloco_swarm.train.config import RunConfig
from noloco_swarm.train.layering import build_config

METHODS = ("noloco", "diloco")


def config(
    method: str, replicas: int, hidden: int, inner_steps: int, max_mbit: float | None = 0.0
) -> RunConfig:
    """One stage of the tiny preset (hidden size `hidden`), a one-row batch of 16 tokens; the
    exchange capped at `max_mbit` (peer.exchange_max_mbit, 0: no cap, None: auto, the measured
    link)."""
    assignments = {
        "num_stages": "1",
        "num_replicas": str(replicas),
        "model.hidden_size": str(hidden),
        "model.seq_len": "16",
        "inner.batch_size": "1",
        "outer.inner_steps": str(inner_steps),
        "eval_windows": "1",
        "eval_every": "0",
        "peer.exchange_max_mbit": "auto" if max_mbit is None else str(max_mbit),
    }
    return build_config("tiny", method, assignments=assignments, env={})


def measure(
    cfg: RunConfig,
    rounds: int,
    rate_mbit: float,
    straggle: str,
    keep: Path | None,
    burst: float | None = None,
    queue_ms: float = 100.0,
    transport: TransportKind = "tcp",
) -> dict:
    """One run on the testbed: the sync and ready times of outer steps 2..rounds (links shaped
    with a token bucket of `burst` kbit, None: the testbed's default, and a queue of `queue_ms`;
    the peers listening on `transport`)."""
    H = cfg.outer.inner_steps
    hosts = [peer_host(0, d) for d in range(cfg.num_replicas)]
    workdir = None
    if keep is not None:
        tag = "stragglers" if straggle else "even"
        workdir = (
            keep
            / f"{cfg.outer.method}-n{cfg.num_replicas}-{rate_mbit:g}mbit-{tag}-burst{burst or 'auto'}-queue{queue_ms:g}ms-{transport}-cap{'auto' if cfg.peer.exchange_max_mbit is None else f'{cfg.peer.exchange_max_mbit:g}'}"
        )
        base = workdir  # a setting run again gets a folder of its own
        for again in itertools.count(2):
            if not workdir.exists():
                break
            workdir = base.with_name(f"{base.name}~{again}")
        workdir.mkdir(parents=True)
    os.environ[STRAGGLE_ENV] = straggle  # the peers inherit it ("" : no stragglers)
    started = time.monotonic()
    try:
        with namespace_swarm(
            cfg,
            rounds * H,
            step_timeout=300,
            shapes=[Shape(h, rate_mbit, burst, queue_ms) for h in hosts],
            workdir=workdir,
            transport=transport,
        ) as ns:
            wait(ns.swarm, timeout=1800)
            outers = [e for p in ns.swarm.peers for e in of_kind(p.events(), Outer) if e.step > H]
            link = [ns.bed.counters(h) for h in hosts]  # (received, sent) bytes over the whole run
    finally:
        os.environ.pop(STRAGGLE_ENV, None)
    groups: dict[tuple[int, tuple[int, ...]], list[float]] = defaultdict(list)
    for e in outers:
        groups[(e.step, tuple(sorted(e.group)))].append(e.seconds)
    complete = [min(s) for (_, group), s in groups.items() if len(s) == len(group)]
    return {
        "sync_s": statistics.fmean(e.seconds for e in outers),
        "ready_s": statistics.median(complete),
        "received_bytes": statistics.median(e.received_bytes for e in outers),
        "failed": sum(len(e.failed) for e in outers),
        # What crossed a peer's link per outer step (all rounds: the first one and the inner
        # steps' DHT traffic included), against the payload it had to receive.
        "link_received_per_outer_step": statistics.fmean(rx for rx, _ in link) / rounds,
        "outer_steps": len(outers),
        # The peers' exchange paces and measured uplinks (bytes/s; 0: none), outer step by step.
        "paces": [e.pace for e in outers],
        "uplinks": [e.uplink for e in outers],
        "wall_s": time.monotonic() - started,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="4,8", help="N values, comma-separated")
    ap.add_argument("--rates", default="25,100", help="link rates in Mbit/s, comma-separated")
    ap.add_argument("--hidden", type=int, default=128, help="the stage's hidden size (128: 8 MiB of weights)")
    ap.add_argument("--inner-steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="outer steps per run (the first is left out)")
    ap.add_argument("--straggle", default="1,0.5", help="MU,SIGMA[,SCALE] of the inner phases' LogNormal")
    ap.add_argument("--methods", default=",".join(METHODS), help="outer methods to run, comma-separated")
    ap.add_argument(
        "--stragglers", choices=("both", "off", "on"), default="both", help="runs without and/or with them"
    )
    ap.add_argument(
        "--bursts",
        default="auto",
        help="token buckets (kbit) to shape with, comma-separated; auto: the testbed's default (10 ms of the rate)",
    )
    ap.add_argument("--queues", default="100", help="the shapers' queues (tbf latency, ms), comma-separated")
    ap.add_argument(
        "--transports", default="tcp", help="what the peers listen on: tcp, quic or both (comma-separated)"
    )
    ap.add_argument(
        "--caps", default="0", help="shares of the rate the exchange is capped at (0: none), comma-separated"
    )
    ap.add_argument("--repeat", type=int, default=1, help="run every setting this many times, alternating")
    ap.add_argument("--keep", type=Path, default=None, help="keep each run's logs and events here")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ok, why = namespaces_permitted()
    if not ok:
        sys.exit(f"outer_sync needs the namespace testbed: {why}")
    Straggle.parse(args.straggle)  # refuse a malformed value before any run
    transports = args.transports.split(",")
    if unknown := set(transports) - set(get_args(TransportKind)):
        sys.exit(f"unknown transports {sorted(unknown)}: choose from {', '.join(get_args(TransportKind))}")
    caps = [None if x == "auto" else float(x) for x in args.caps.split(",")]
    if any(cap is not None and not 0 <= cap <= 1 for cap in caps):
        sys.exit(
            f"--caps are shares of the link rate, each within 0..1 (0: no cap), or auto; got {args.caps}"
        )
    rates = [float(x) for x in args.rates.split(",")]
    bursts = [None if x == "auto" else float(x) for x in args.bursts.split(",")]
    queues = [float(x) for x in args.queues.split(",")]
    stragglers = {"both": ("", args.straggle), "off": ("",), "on": (args.straggle,)}[args.stragglers]
    # The stage's weights: one stage of the model, whatever N (the replica count is not in it).
    stage_bytes = 4 * num_flat(build_stage(config("noloco", 2, args.hidden, 2).model, 0, 1, 0))
    rows = []
    for n, repeat in itertools.product((int(x) for x in args.replicas.split(",")), range(args.repeat)):
        for rate, burst, queue, straggle, transport, cap in itertools.product(
            rates, bursts, queues, stragglers, transports, caps
        ):
            runs = {}
            for method in args.methods.split(","):  # side by side: the same N, rate and draws
                cfg = config(method, n, args.hidden, args.inner_steps, None if cap is None else cap * rate)
                run = measure(cfg, args.rounds, rate, straggle, args.keep, burst, queue, transport)
                share = 1.0 if method == "noloco" else 2 * (n - 1) / n
                run["floor_s"] = share * stage_bytes * 8 / (rate * 1e6)
                run["ready_over_floor"] = run["ready_s"] / run["floor_s"]
                runs[method] = run
                print(
                    f"N={n} {rate:g} Mbit/s {transport} burst {burst or 'auto'} queue {queue:g} ms cap {'auto' if cap is None else f'{cap:g}'} "
                    f"{'stragglers' if straggle else 'even      '} "
                    f"{method:6s}: "
                    f"sync {run['sync_s']:.2f} s, ready {run['ready_s']:.2f} s "
                    f"({run['ready_over_floor']:.3f}x floor {run['floor_s']:.2f} s), "
                    f"{run['failed']} failed, run {run['wall_s']:.0f} s",
                    flush=True,
                )
            row = {
                "replicas": n,
                "rate_mbit": rate,
                "burst_kbit": burst or default_burst_kbit(rate),
                "queue_ms": queue,
                "transport": transport,
                "cap": "auto" if cap is None else cap,
                "repeat": repeat,
                "stragglers": straggle or None,
                "stage_bytes": stage_bytes,
                "runs": runs,
            }
            if set(METHODS) <= set(runs):
                row["diloco_over_noloco_sync"] = runs["diloco"]["sync_s"] / runs["noloco"]["sync_s"]
                row["diloco_over_noloco_ready"] = runs["diloco"]["ready_s"] / runs["noloco"]["ready_s"]
                print(
                    f"  DiLoCo/NoLoCo: sync {row['diloco_over_noloco_sync']:.2f}x, "
                    f"ready {row['diloco_over_noloco_ready']:.2f}x",
                    flush=True,
                )
            rows.append(row)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": "sudo nice -n 10 python bench/outer_sync.py " + " ".join(sys.argv[1:]),
            "config": {k: str(v) for k, v in vars(args).items()},
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
