"""`noloco`: the command line of noloco-swarm."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from noloco_swarm.cli.options import ConfigError, build_config, parse_assignments

DEFAULT_IDENTITY = Path("~/.config/noloco-swarm/dht.key")

EPILOG = """Any setting can also be given as --set KEY=VALUE (repeatable), in a TOML file (--config),
or in NOLOCO_SET="KEY=VALUE;KEY=VALUE". Keys: see `noloco keys`."""


def _common(p: argparse.ArgumentParser, *, replicas: int, stages: int, steps: int) -> None:
    p.add_argument(
        "--preset", default="tiny", help="model preset: tiny, small, medium, large (default: tiny)"
    )
    p.add_argument("--stages", type=int, default=stages, help=f"pipeline stages P (default: {stages})")
    p.add_argument(
        "--replicas", type=int, default=replicas, help=f"replicas per stage D (default: {replicas})"
    )
    p.add_argument("--steps", type=int, default=steps, help=f"inner steps to train (default: {steps})")
    p.add_argument(
        "--seed", type=int, default=0, help="run seed: initial weights and data order (default: 0)"
    )
    p.add_argument(
        "--config", metavar="FILE", help="TOML config file with [model], [data], [inner], [outer] sections"
    )
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")


def _network(p: argparse.ArgumentParser, *, identity_default: str | None) -> None:
    """hivemind's listen/announce/relay/identity options, named as volunteers expect them."""
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR", help="multiaddrs of live peers")
    p.add_argument(
        "--host-maddrs",
        nargs="+",
        default=["/ip4/0.0.0.0/tcp/0"],
        metavar="MADDR",
        help="listen addresses (default: all IPv4 interfaces, a random TCP port)",
    )
    p.add_argument(
        "--announce-maddrs", nargs="*", default=[], metavar="MADDR", help="public addresses to announce (NAT)"
    )
    p.add_argument(
        "--identity", default=identity_default, help=f"private key file (default: {identity_default})"
    )
    p.add_argument("--no-relay", action="store_true", help="disable libp2p circuit relays")
    p.add_argument("--auto-relay", action="store_true", help="find relays automatically (behind NAT)")


def _network_config(args: argparse.Namespace):
    from noloco_swarm.train.config import NetworkConfig

    identity = str(Path(args.identity).expanduser()) if args.identity else None
    return NetworkConfig(
        initial_peers=tuple(args.initial_peers),
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        identity_path=identity,
        use_relay=not args.no_relay,
        use_auto_relay=args.auto_relay,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="noloco", description=__doc__, epilog=EPILOG)
    sub = p.add_subparsers(dest="command", required=True)

    local = sub.add_parser(
        "local",
        help="train the tiny preset on the embedded corpus on this machine (the main job)",
        description="A whole swarm on this machine: P stages x D replicas of the tiny preset, trained "
        "on the embedded corpus with NoLoCo, with a live view and a final summary.",
        epilog=EPILOG,
    )
    _common(local, replicas=2, stages=2, steps=300)
    local.add_argument("--method", default="noloco", choices=["noloco", "diloco", "allreduce", "local"])
    local.add_argument("--plain", action="store_true", help="print progress lines instead of the live view")
    local.add_argument(
        "--in-process",
        action="store_true",
        help="run the swarm inside this process (the simulator), no network",
    )
    local.add_argument("--keep", type=Path, default=None, help="keep peer logs and metrics in this folder")

    join = sub.add_parser(
        "join",
        help="run one peer: host one stage of a run and train with the swarm",
        description="Join a run through any live peer (--initial-peers), host one pipeline stage, train.",
        epilog=EPILOG,
    )
    _common(join, replicas=2, stages=2, steps=300)
    _network(join, identity_default=None)
    join.add_argument("--run-id", required=True, help="the run's name; peers of one run share it")
    join.add_argument("--stage", default="auto", help="stage to host: a number, or auto (fewest replicas)")
    join.add_argument("--method", default="noloco", choices=["noloco", "diloco", "allreduce", "local"])
    join.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where this stage runs")
    join.add_argument(
        "--new-run", action="store_true", help="publish the run's manifest if it does not exist"
    )
    join.add_argument("--metrics", type=Path, default=None, help="append JSON-lines metrics to this file")
    join.add_argument("--run-config", type=Path, default=None, help=argparse.SUPPRESS)  # from noloco local
    join.add_argument("--die-with-parent", action="store_true", help=argparse.SUPPRESS)
    join.add_argument("--step-timeout", type=float, default=120.0, help="deadline of one pipeline step (s)")

    sim = sub.add_parser(
        "sim",
        help="compare methods in the in-process simulator; writes JSON, CSV and a PNG plot",
        epilog=EPILOG,
    )
    _common(sim, replicas=4, stages=2, steps=300)
    sim.add_argument(
        "--methods",
        default="noloco,diloco,allreduce,local",
        help="comma-separated: noloco, diloco, allreduce, local, noloco-fixed (routing off)",
    )
    sim.add_argument("--out", type=Path, default=None, help="output folder (default: runs/sim-<time>)")

    dht = sub.add_parser("dht", help="run a bootstrap node and print the --initial-peers address to share")
    _network(dht, identity_default=str(DEFAULT_IDENTITY))
    dht.add_argument(
        "--address-file", type=Path, default=None, help="also write the --initial-peers address here"
    )

    status = sub.add_parser(
        "status", help="a live view of a running swarm: every peer's stage, step and loss"
    )
    status.add_argument(
        "--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs of live peers"
    )
    status.add_argument("--run-id", required=True)
    status.add_argument(
        "--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/0"], metavar="MADDR", help="listen addresses"
    )
    status.add_argument("--once", action="store_true", help="print one snapshot and exit")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")

    sub.add_parser("presets", help="list model presets and their parameter counts")
    sub.add_parser("keys", help="list every config key")
    return p


def _assignments(args: argparse.Namespace) -> dict[str, str]:
    merged: dict[str, str] = {}
    for item in args.assignments:
        merged.update(parse_assignments(item))
    merged.update(
        {"num_stages": str(args.stages), "num_replicas": str(args.replicas), "seed": str(args.seed)}
    )
    return merged


def _config(args: argparse.Namespace, method: str):
    assignments = _assignments(args)
    routing_off = method == "noloco-fixed"
    if routing_off:
        method = "noloco"
        assignments["outer.random_routing"] = "false"
    assignments.setdefault("inner.total_steps", str(args.steps))
    return build_config(args.preset, method, config_file=args.config, assignments=assignments)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "presets":
            return _presets()
        if args.command == "keys":
            from noloco_swarm.cli.options import valid_keys

            print("\n".join(valid_keys()))
            return 0
        if args.command == "dht":
            from noloco_swarm.cli.dht import run_dht

            return run_dht(_network_config(args), address_file=args.address_file)
        if args.command == "status":
            from noloco_swarm.cli.status import run_status
            from noloco_swarm.train.config import NetworkConfig

            net = NetworkConfig(initial_peers=tuple(args.initial_peers), host_maddrs=tuple(args.host_maddrs))
            return run_status(net, args.run_id, once=args.once, interval=args.interval)
        import torch

        default_threads = torch.get_num_threads()
        if args.command == "join":
            # Leave a core to the transport: torch compute slows sharply when p2pd and the
            # stream handlers compete with it for every core (measured with hivemind 1.1.12).
            default_threads = max(1, default_threads - 1)
        torch.set_num_threads(args.threads or default_threads)
        if args.command == "join":
            return _join(args)
        if args.command == "local":
            from noloco_swarm.cli.local import run_local, run_local_swarm

            cfg = _config(args, args.method)
            if args.in_process:
                return run_local(cfg, args.steps, plain=args.plain)
            _check_swarm_method(cfg.outer.method)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
            return run_local_swarm(cfg, args.steps, plain=args.plain, keep=args.keep)
        if args.command == "sim":
            from noloco_swarm.cli.sim import run_sim

            methods = [m.strip() for m in args.methods.split(",") if m.strip()]
            configs = {m: _config(args, m) for m in methods}
            out = args.out or Path("runs") / time.strftime("sim-%Y%m%d-%H%M%S")
            return run_sim(configs, args.steps, out)
    except ConfigError as e:
        print(f"noloco: config error: {e}", file=sys.stderr)
        return 2
    return 1  # pragma: no cover - argparse requires a command


def _check_swarm_method(method: str) -> None:
    # Peers average gradients only through outer steps; per-step all-reduce exists in the simulator.
    if method == "allreduce":
        raise ConfigError(
            "method allreduce runs only in the simulator: use noloco sim or noloco local --in-process"
        )


def _join(args: argparse.Namespace) -> int:
    from noloco_swarm.cli.join import load_run_config, run_join
    from noloco_swarm.peer.lifetime import die_with_parent

    if args.die_with_parent:
        die_with_parent()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(
                "noloco: --device cuda, but this torch has no usable CUDA device "
                f"(torch {torch.__version__}); use --device cpu or install a CUDA build",
                file=sys.stderr,
            )
            return 2
    cfg = load_run_config(args.run_config) if args.run_config else _config(args, args.method)
    _check_swarm_method(cfg.outer.method)
    stage = None if args.stage == "auto" else int(args.stage)
    peer = dataclasses.replace(
        cfg.peer,
        run_id=args.run_id,
        stage=stage,
        metrics=str(args.metrics) if args.metrics else None,
        step_timeout=args.step_timeout,
        exchange_timeout=args.step_timeout,
        device=args.device,
    )
    cfg = cfg.replace(peer=peer, network=_network_config(args))
    return run_join(cfg, args.steps, new_run=args.new_run)


def _presets() -> int:
    from rich.console import Console
    from rich.table import Table

    from noloco_swarm.model.presets import PRESETS, count_parameters

    table = Table(title="model presets")
    for column in ("preset", "hidden", "ffn", "heads", "layers", "seq", "vocab", "parameters", "lr"):
        table.add_column(column, justify="right")
    for name, cfg in PRESETS.items():
        table.add_row(
            name,
            str(cfg.hidden_size),
            str(cfg.intermediate_size),
            str(cfg.num_heads),
            str(cfg.num_layers),
            str(cfg.seq_len),
            f"{cfg.vocab_size:,}",
            f"{count_parameters(cfg):,}",
            f"{cfg.lr:g}",
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
