"""The `noloco` flags that fill the config tree, and the layers one command line resolves to.

A named flag is the top layer, and only when it is given: every config flag defaults to None,
so an absent `--replicas` leaves `num_replicas` to the config file, NOLOCO_SET or --set. A
command's own defaults (`noloco sim` runs 4 replicas; `inner.total_steps` follows `--steps`) are
the bottom layer, under every source.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from noloco_swarm.testbed.bed import TransportKind
from noloco_swarm.train.layering import (
    Layer,
    Resolved,
    is_swarm_file,
    load_file,
    load_run_config,
    load_swarm_file,
    parse_assignments,
    resolve,
)

PRECEDENCE = "defaults < --config FILE < NOLOCO_SET < --set KEY=VALUE < named flags"


@dataclass(frozen=True)
class Flag:
    """A named flag and the config key it sets."""

    option: str
    key: str

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")


FLAGS: tuple[Flag, ...] = (
    Flag("--preset", "preset"),
    Flag("--method", "method"),
    Flag("--stages", "num_stages"),
    Flag("--replicas", "num_replicas"),
    Flag("--seed", "seed"),
    Flag("--run-id", "peer.run_id"),
    Flag("--stage", "peer.stage"),
    Flag("--device", "peer.device"),
    Flag("--metrics", "peer.metrics"),
    Flag("--metrics-port", "peer.metrics_port"),
    Flag("--checkpoint-dir", "peer.checkpoint_dir"),
    Flag("--step-timeout", "peer.step_timeout"),
    Flag("--initial-peers", "network.initial_peers"),
    Flag("--host-maddrs", "network.host_maddrs"),
    Flag("--announce-maddrs", "network.announce_maddrs"),
    Flag("--identity", "network.identity_path"),
    Flag("--no-relay", "network.use_relay"),
    Flag("--auto-relay", "network.use_auto_relay"),
)
METHOD_CHOICES = ["noloco", "diloco", "allreduce", "local"]


def add_sources(p: argparse.ArgumentParser) -> None:
    """--config, --set and --print-config: every command that builds a config takes them."""
    p.add_argument("--config", metavar="FILE", help="TOML config file: top-level keys and [section] tables")
    p.add_argument(
        "--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE", help="set any key"
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as TOML (each value's source as a comment) and exit",
    )


def add_run(p: argparse.ArgumentParser, *, replicas: int, steps: int, method: bool = True) -> None:
    """The run's shape and length (`noloco local`, `join`, `sim`)."""
    p.add_argument(
        "--preset", default=None, help="model preset: tiny, mini, small, medium, large (default: tiny)"
    )
    p.add_argument("--stages", type=int, default=None, help="pipeline stages P, key num_stages (default: 2)")
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help=f"replicas per stage D, key num_replicas (default: {replicas})",
    )
    p.add_argument("--steps", type=int, default=steps, help=f"inner steps to train (default: {steps})")
    p.add_argument(
        "--seed", type=int, default=None, help="run seed: initial weights and data order (default: 0)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    if method:
        p.add_argument(
            "--method", default=None, choices=METHOD_CHOICES, help="outer method (default: noloco)"
        )


def add_peer(p: argparse.ArgumentParser) -> None:
    """How one peer runs: the peer.* keys (`noloco join`)."""
    p.add_argument("--run-id", default=None, help="the run's name; peers of one run share it (peer.run_id)")
    p.add_argument(
        "--stage", default=None, help="stage to host: a number, or auto (fewest replicas; the default)"
    )
    p.add_argument(
        "--device", default=None, choices=["cpu", "cuda"], help="where this stage runs (default: cpu)"
    )
    p.add_argument("--metrics", default=None, help="append the peer's events as JSON lines to this file")
    add_metrics_port(p, "serve Prometheus metrics at http://0.0.0.0:PORT/metrics (default: off)")
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="write this replica's full state here at outer-step boundaries (peer.checkpoint_dir)",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=None,
        help="longest deadline of one pipeline step in s, also of an outer exchange unless set; "
        "deadlines adapt below it to the steps seen (peer.deadline_factor; default: 120)",
    )


def add_metrics_port(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT", help=text)


def add_network(p: argparse.ArgumentParser, *, identity_default: str | None, peers_help: str) -> None:
    """hivemind's listen/announce/relay/identity options, named as volunteers expect them (network.*)."""
    p.add_argument("--initial-peers", nargs="*", default=None, metavar="MADDR", help=peers_help)
    p.add_argument(
        "--host-maddrs",
        nargs="+",
        default=None,
        metavar="MADDR",
        help="listen addresses (default: all IPv4 interfaces, a random TCP port)",
    )
    p.add_argument(
        "--announce-maddrs",
        nargs="*",
        default=None,
        metavar="MADDR",
        help="public addresses to announce (NAT)",
    )
    keep = identity_default or "none: a new peer id at every start"
    p.add_argument(
        "--identity", default=None, help=f"private key file, key network.identity_path (default: {keep})"
    )
    p.add_argument(
        "--no-relay", dest="no_relay", action="store_const", const=False, default=None, help="disable relays"
    )
    p.add_argument(
        "--auto-relay",
        dest="auto_relay",
        action="store_const",
        const=True,
        default=None,
        help="find relays (NAT)",
    )


def add_pin(p: argparse.ArgumentParser, *, default: bool) -> None:
    """Whether a launcher pins its peers to CPUs (`noloco local`: on; `noloco testbed`: off)."""
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=default,
        help="run each peer and its p2pd on its own share of this machine's CPUs "
        f"(Linux; default: {'on' if default else 'off'})",
    )


def add_testbed(p: argparse.ArgumentParser) -> None:
    """The testbed's links and faults (`noloco testbed`); not config keys: they shape the machine."""
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="HOST=RATE",
        help="limit a host's link each way, e.g. s1r0=10mbit (repeatable; hosts: boot, s0r0, s0r1, s1r0, ...)",
    )
    p.add_argument(
        "--cut",
        action="append",
        default=[],
        metavar="HOST@T+DURATION",
        help="cut a host's link T s after the peers start, for DURATION s, e.g. s1r0@30+20 (repeatable)",
    )
    p.add_argument(
        "--cut-mode",
        choices=["drop", "down"],
        default="drop",
        help="drop: discard every packet, the link stays up (a failed path); down: no carrier",
    )
    p.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="one-way delay added to every peer-to-peer connection by a user-space relay (default: 0)",
    )
    p.add_argument(
        "--delay",
        action="append",
        default=[],
        metavar="HOST=MS",
        help="one-way delay of connections to one peer's host instead of --delay-ms, e.g. s1r1=40 (repeatable)",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=None,
        help="longest deadline of one pipeline step and of an outer exchange in s (peer.step_timeout; "
        "deadlines adapt below it to the steps seen, peer.deadline_factor; default: 120)",
    )
    p.add_argument(
        "--transport",
        choices=get_args(TransportKind),
        default="tcp",
        help="what the peers listen on: tcp (noise and yamux over TCP) or quic (QUIC over UDP; "
        "takes no --delay: the delay relay carries TCP only)",
    )
    p.add_argument("--keep", type=Path, default=None, help="keep peer logs and metrics in this folder")


def flag_layers(args: argparse.Namespace) -> list[Layer]:
    """One layer per named flag the user gave; absent flags (None) set nothing."""
    out = []
    for flag in FLAGS:
        value = getattr(args, flag.dest, None)
        if value is not None:
            out.append(Layer(flag.option, {flag.key: value}))
    return out


def resolve_args(
    args: argparse.Namespace,
    defaults: Mapping[str, Any] | None = None,
    *,
    top: Sequence[Layer] = (),
    env: Mapping[str, str] | None = None,
) -> Resolved:
    """The config a command line gives: defaults < noloco local's run config (--run-config, for its
    peers) < --config < NOLOCO_SET < --set < named flags < `top` (e.g. one of `noloco sim --methods`)."""
    env = os.environ if env is None else env
    layers = [Layer("default", dict(defaults or {}), explicit=False)]
    if getattr(args, "steps", None) is not None:  # the schedule spans the run unless a source says otherwise
        layers.append(Layer("--steps", {"inner.total_steps": args.steps}, explicit=False))
    if getattr(args, "run_config", None):
        layers.append(Layer("noloco local's run config", load_run_config(args.run_config), explicit=False))
    if args.config:
        layers.append(Layer(f"--config {args.config}", load_file(args.config)))
    layers.append(Layer("NOLOCO_SET", parse_assignments(env.get("NOLOCO_SET", ""))))
    assignments: dict[str, str] = {}
    for item in args.assignments:
        assignments.update(parse_assignments(item))
    layers.append(Layer("--set", assignments))
    layers += flag_layers(args)
    resolved = resolve([*layers, *top])
    files = [p for p in resolved.cfg.network.initial_peers if is_swarm_file(p)]
    if not files:
        return resolved
    # Swarm files named in network.initial_peers: their multiaddrs replace them, and their run is
    # the run id when nothing else sets one (and `join --auto` is not choosing one).
    peers = [p for p in resolved.cfg.network.initial_peers if not is_swarm_file(p)]
    runs = []
    for path in files:
        swarm = load_swarm_file(path)
        peers += [p for p in swarm.initial_peers if p not in peers]
        runs += [swarm.run] if swarm.run and swarm.run not in runs else []
    values: dict[str, Any] = {"network.initial_peers": peers}
    if len(runs) == 1 and not resolved.cfg.peer.run_id and not getattr(args, "auto", False):
        values["peer.run_id"] = runs[0]
    return resolve([*layers, Layer(f"swarm file {', '.join(files)}", values), *top])
