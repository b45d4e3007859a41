"""The wall-clock model against a real 2x2 swarm on the namespace testbed (needs root).

Runs the tiny preset (2 stages x 2 replicas, today's schedule: one batch in flight, fp32, blocking
exchange) once per link profile, every peer on its own emulated host (`noloco testbed`'s
machinery): first unshaped, then with every peer's link shaped by tbf and a user-space delay.
The unshaped run calibrates the model's one free input, the compute of a step (its median step
time, which on an unshaped link is compute plus the swarm's own overheads); the shaped runs are
then predicted from link rate, RTT and bytes alone and compared with what was measured:

- step: median seconds of an inner step (stage-0 peers' `Step` events, outer steps excluded),
- exchange: median seconds of an outer exchange (every peer's `Outer` events),
- tokens/s: tokens fed over the two outer periods between the `Step` events of steps H and 3H,
  exchanges, checkpoints and view changes included.

    sudo nice -n 10 python bench/wallclock_validation.py --out docs/results/wallclock_validation.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from noloco_swarm.harness.local import wait
from noloco_swarm.harness.namespaces import namespace_swarm, peer_host
from noloco_swarm.model.presets import count_stage_parameters
from noloco_swarm.model.split import split_layers
from noloco_swarm.peer.events import Outer, Step, of_kind
from noloco_swarm.sim.wallclock import TCP_EFFICIENCY, Link, Schedule, StageCost, Swarm, simulate
from noloco_swarm.testbed.schedule import Shape
from noloco_swarm.train.config import RunConfig
from noloco_swarm.train.layering import build_config


def measure(
    cfg: RunConfig,
    steps: int,
    rate_mbit: float | None,
    delay_ms: float,
    keep: Path | None,
    pin: bool = False,
) -> dict:
    """One testbed run; per-step, per-exchange and per-period figures from the peers' events.
    `pin`: each peer and its p2pd on their own share of the CPUs (as `noloco local` runs them)."""
    hosts = [peer_host(s, d) for s in range(cfg.num_stages) for d in range(cfg.num_replicas)]
    shapes = [Shape(h, rate_mbit) for h in hosts] if rate_mbit else []
    workdir = None
    if keep is not None:
        workdir = keep / ("unshaped" if rate_mbit is None else f"{rate_mbit:g}mbit-{delay_ms:g}ms")
        workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with namespace_swarm(
        cfg, steps, step_timeout=120, delay_ms=delay_ms, shapes=shapes, workdir=workdir, pin=pin
    ) as ns:
        wait(ns.swarm, timeout=900)
        peers = [(p.stage, p.events()) for p in ns.swarm.peers]
        link_bytes = {h: ns.bed.counters(h) for h in hosts}
    H, B, T = cfg.outer.inner_steps, cfg.inner.batch_size, cfg.model.seq_len
    first = [ev for stage, ev in peers if stage == 0]
    step_s = [e.seconds for ev in first for e in of_kind(ev, Step) if e.step > 2]
    outer_s = [e.seconds for _, ev in peers for e in of_kind(ev, Outer)]
    tokens_per_s = 0.0
    for ev in first:
        at = {e.step: e.time for e in of_kind(ev, Step)}
        tokens_per_s += 2 * H * B * T / (at[3 * H] - at[H])
    return {
        "rate_mbit": rate_mbit,
        "rtt_ms": 2 * delay_ms,
        "step_s": statistics.median(step_s),
        "exchange_s": statistics.median(outer_s),
        "tokens_per_s": tokens_per_s,
        "link_mib_in_out": {h: [rx / 2**20, tx / 2**20] for h, (rx, tx) in link_bytes.items()},
        # What the peers measured their uplinks at (bytes/s; peer/net/uplink.py), exchange by exchange.
        "uplink_bytes_s": [e.uplink for _, ev in peers for e in of_kind(ev, Outer) if e.uplink],
        "wall_s": time.monotonic() - started,
    }


def testbed_config(seq_len: int, batch_size: int, inner_steps: int, **extra: str) -> RunConfig:
    """The testbed benchmarks' 2x2 tiny swarm (no evaluation during the run)."""
    assignments = {
        "num_stages": "2",
        "num_replicas": "2",
        "model.seq_len": str(seq_len),
        "inner.batch_size": str(batch_size),
        "outer.inner_steps": str(inner_steps),
        "eval_windows": "4",
        "eval_every": "0",
    }
    return build_config("tiny", "noloco", assignments=assignments | extra, env={})


def resolve_values(name: str, values: dict[str, str], inner_steps: int, batch_size: int) -> dict[str, str]:
    """A named schedule's config values for this H and B: "H/2" becomes H // 2, and microbatch
    sizes "a,b,.../16" (sixteenths of the batch) become rows."""
    out = {}
    for key, given in values.items():
        value = given
        if given == "H/2":
            value = str(inner_steps // 2)
        elif given.endswith("/16"):
            if batch_size % 16:
                raise SystemExit(f"{name!r} cuts the batch in sixteenths: needs 16 | B, got {batch_size}")
            value = ",".join(str(int(x) * batch_size // 16) for x in given.removesuffix("/16").split(","))
        out[key] = value
    return out


def model_swarm(
    cfg: RunConfig, step_compute_s: float, link: Link, per_stage: bool = False, **kw: Any
) -> Swarm:
    """The run's swarm for the model: a step's compute split as forward 1 : backward 2 per stage.
    `step_compute_s` is the whole step's (M = 1 runs every stage's compute in series), or with
    `per_stage` one stage's; `kw` are further `Swarm` fields."""
    P, B = cfg.num_stages, cfg.inner.batch_size
    forward = step_compute_s / (3 * B * (1 if per_stage else P))  # per sample
    ranges = split_layers(cfg.model.num_layers, P)
    stages = tuple(
        StageCost(forward, 2 * forward, count_stage_parameters(cfg.model, ranges[s], s == 0, s == P - 1))
        for s in range(P)
    )
    return Swarm(
        stages,
        replicas=cfg.num_replicas,
        batch=B,
        seq_len=cfg.model.seq_len,
        hidden=cfg.model.hidden_size,
        inner_steps=cfg.outer.inner_steps,
        link=link,
        **kw,
    )


def compare(cfg: RunConfig, step_compute_s: float, measured: dict) -> dict:
    """The model's figures for one measured profile, as they are and with the link share fitted."""
    rate, one_way = measured["rate_mbit"] or math.inf, measured["rtt_ms"] / 2000  # rate 0: unshaped
    link = Link.symmetric(rate, rtt_s=2 * one_way, efficiency=TCP_EFFICIENCY)
    model = simulate(model_swarm(cfg, step_compute_s, link), Schedule())
    # The same model given the share of the rate that the exchange actually got (its bytes are
    # known exactly): tells a wrong structure apart from links that deliver less than their rate.
    share = TCP_EFFICIENCY * (model.exchange_s - one_way) / (measured["exchange_s"] - one_way)
    fitted = model
    if rate < math.inf:
        fitted_link = Link.symmetric(rate, rtt_s=2 * one_way, efficiency=min(share, 1.0))
        fitted = simulate(model_swarm(cfg, step_compute_s, fitted_link), Schedule())
    return {
        "measured": measured,
        "model": {"step_s": model.step_s, "exchange_s": model.exchange_s, "tokens_per_s": model.tokens_per_s},
        "model_over_measured": {
            "step": model.step_s / measured["step_s"],
            "exchange": model.exchange_s / measured["exchange_s"],
            "tokens_per_s": model.tokens_per_s / measured["tokens_per_s"],
        },
        "payload_share_fitted_to_exchange": share,
        "fitted_model": {"step_s": fitted.step_s, "tokens_per_s": fitted.tokens_per_s},
        "fitted_model_over_measured": {
            "step": fitted.step_s / measured["step_s"],
            "tokens_per_s": fitted.tokens_per_s / measured["tokens_per_s"],
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument(
        "--profiles",
        default="10:25,20:0,20:25",
        help="RATE_MBIT:ONE_WAY_DELAY_MS, comma-separated (rate 0: unshaped)",
    )
    ap.add_argument(
        "--keep", type=Path, default=None, help="keep each run's logs and events under this folder"
    )
    ap.add_argument(
        "--measured", type=Path, default=None, help="no runs: take the measurements of an earlier --out file"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cfg = testbed_config(args.seq_len, args.batch_size, args.inner_steps)
    steps = 3 * args.inner_steps
    if args.measured is not None:
        earlier = json.loads(args.measured.read_text())
        command, unshaped = earlier["command"], earlier["unshaped"]
        measurements = [row["measured"] for row in earlier["profiles"]]
    else:
        command = "sudo nice -n 10 python bench/wallclock_validation.py " + " ".join(sys.argv[1:])
        unshaped = measure(cfg, steps, None, 0.0, args.keep)
        print(f"unshaped: {json.dumps({k: v for k, v in unshaped.items() if k != 'link_mib_in_out'})}")
        measurements = []
        for profile in args.profiles.split(","):
            rate, delay = (float(x) for x in profile.split(":"))
            measurements.append(measure(cfg, steps, rate, delay, args.keep))
    rows = [compare(cfg, unshaped["step_s"], m) for m in measurements]
    for row in rows:
        m, mod, fit = row["measured"], row["model"], row["fitted_model"]
        print(
            f"{m['rate_mbit']:g} Mbit/s, RTT {m['rtt_ms']:g} ms: step {m['step_s']:.2f} s (model {mod['step_s']:.2f}, "
            f"fitted {fit['step_s']:.2f}), exchange {m['exchange_s']:.2f} s (model {mod['exchange_s']:.2f}), "
            f"tokens/s {m['tokens_per_s']:.0f} (model {mod['tokens_per_s']:.0f}, fitted {fit['tokens_per_s']:.0f}), "
            f"link share fitted {row['payload_share_fitted_to_exchange']:.3f}"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": command,
            "config": {"preset": "tiny", "stages": 2, "replicas": 2, "steps": steps}
            | {
                k: str(v)
                for k, v in vars(args).items()
                if k in ("seq_len", "batch_size", "inner_steps", "profiles")
            },
            "model_inputs": "step compute = the unshaped run's median step; link = rate x 1448/1514, RTT = 2 x delay",
            "unshaped": unshaped,
            "profiles": rows,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
