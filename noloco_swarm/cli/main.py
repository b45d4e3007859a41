"""`noloco`: the command line of noloco-swarm."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from noloco_swarm.cli.flags import resolve_args
from noloco_swarm.cli.parser import DEFAULT_IDENTITY, SIM_METHODS, parser
from noloco_swarm.train.config import Runner, parse_cpus
from noloco_swarm.train.layering import ConfigError, Layer, Resolved, UnknownKey


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # A command that must start its process again (join with peer.release_memory=thp) does so
    # only when it is the process's own command line, never for a call from inside a program.
    args.restartable = argv is None
    try:
        if args.command == "presets":
            return _presets()
        if args.command == "plan":
            return _plan(args)
        if args.command == "plot":
            from noloco_swarm.cli.plot import run_plot

            return run_plot(args.run_dir, args.out)
        if args.command in ("authority", "ticket"):
            from noloco_swarm.cli import closed

            if args.command == "authority":
                return closed.run_authority(args.out)
            return closed.run_ticket(
                args.authority, args.run_id, args.peer_id, args.identity, args.hours, args.out
            )
        if args.command == "keys":
            from noloco_swarm.cli.keys import describe_keys

            print(describe_keys(show_all=args.all))
            return 0
        commands = {
            "local": _local,
            "join": _join,
            "sim": _sim,
            "dht": _dht,
            "status": _status,
            "runs": _runs,
            "testbed": _testbed,
            "doctor": _doctor,
        }
        return commands[args.command](args)
    except ConfigError as e:
        for line in config_error(e).splitlines():
            print(f"noloco: config error: {line}", file=sys.stderr)
        return 2


def config_error(e: ConfigError) -> str:
    """The config layers' error in the CLI's words: an unknown key says where the keys are listed."""
    return f"{e} (`noloco keys --all` lists every key)" if isinstance(e, UnknownKey) else str(e)


def _refuse(resolved: Resolved, runner: Runner, *extra: str) -> None:
    """Stop before anything starts if the runner cannot honour a setting (all reasons at once)."""
    problems = [*extra, *resolved.cfg.refusals(runner, resolved.explicit)]
    if problems:
        raise ConfigError("\n".join(problems))


def _print_config(resolved: Resolved, command: str) -> int:
    from noloco_swarm.cli.keys import to_toml

    print(to_toml(resolved, f"the config of noloco {command}"))
    return 0


def _threads(args: argparse.Namespace, *, peer: bool = False, cpus: int = 0) -> None:
    import torch

    default = cpus or torch.get_num_threads()  # a pinned peer's default: the CPUs it may use
    if peer:
        # Leave a core to the transport: torch compute slows sharply when p2pd and the
        # stream handlers compete with it for every core (measured with hivemind 1.1.12).
        default = max(1, default - 1)
    torch.set_num_threads(args.threads or default)


# Peers evaluate once, at the end of training: that is their default, and any other is refused.
PEER_DEFAULTS = {"eval_every": 0}
# A real swarm's rows and gradients cross in bf16: half fp32's bytes, at a cost in perplexity within
# the seeds' noise (docs/benchmarks.md, "Activation wire formats"). `noloco local` and the testbed
# hand their peers their own run config, exact (fp32) unless asked.
JOIN_DEFAULTS = {**PEER_DEFAULTS, "wire.activations": "bf16"}
# The main job: 2 stages x 4 replicas, so that NoLoCo's pairs are a true subset of each stage (with
# 2 replicas a pair is the whole stage, and every outer step leaves both replicas equal).
LOCAL_DEFAULTS = {"num_replicas": 4}


def _local(args: argparse.Namespace) -> int:
    resolved = resolve_args(args, LOCAL_DEFAULTS if args.in_process else {**PEER_DEFAULTS, **LOCAL_DEFAULTS})
    _refuse(resolved, "simulator" if args.in_process else "local")
    if args.print_config:
        return _print_config(resolved, "local --in-process" if args.in_process else "local")
    from noloco_swarm.cli.local import run_local, run_local_swarm

    _threads(args)
    if args.in_process:
        return run_local(resolved.cfg, args.steps, plain=args.plain)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    return run_local_swarm(resolved.cfg, args.steps, plain=args.plain, keep=args.keep, plot=args.plot)


def _testbed(args: argparse.Namespace) -> int:
    resolved = resolve_args(args, PEER_DEFAULTS)
    _refuse(resolved, "local")
    if args.print_config:
        return _print_config(resolved, "testbed")
    from noloco_swarm.testbed import namespaces_permitted
    from noloco_swarm.testbed.schedule import Timeline, check_delays, parse_delay, parse_shape

    try:
        shapes = [parse_shape(text) for text in args.shape]
        delays = dict(parse_delay(text) for text in args.delay)
        Timeline.of_cuts(args.cut)  # refuse a bad --cut before anything starts
        check_delays(args.transport, args.delay_ms, delays)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    ok, why = namespaces_permitted()
    if not ok:
        print(f"noloco testbed: {why}", file=sys.stderr)
        return 2
    from noloco_swarm.cli.testbed import run_testbed

    _threads(args)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    return run_testbed(
        resolved.cfg,
        args.steps,
        shapes=shapes,
        cuts=args.cut,
        cut_mode=args.cut_mode,
        delay_ms=args.delay_ms,
        delays=delays,
        step_timeout=args.step_timeout,
        keep=args.keep,
        threads=args.threads or 1,
        transport=args.transport,
        pin=args.pin,
    )


def _join(args: argparse.Namespace) -> int:
    resolved = resolve_args(args, JOIN_DEFAULTS)
    from noloco_swarm.peer.net import lifetime

    # glibc reads the allocator's settings at start: restart now, before --auto chooses a run
    release = resolved.cfg.peer.release_memory
    if args.restartable and not args.print_config and lifetime.needs_restart_for(release):
        argv = [sys.executable, "-m", "noloco_swarm.cli.main", *sys.argv[1:]]
        env = lifetime.allocator_env(release, dict(os.environ))
        os.execve(sys.executable, argv, env | {lifetime.RESTARTED: "1"})
    steps = args.steps
    if args.auto and resolved.cfg.peer.run_id:
        raise ConfigError("noloco join --auto chooses the run itself: drop --run-id (or peer.run_id)")
    listing = resolved.cfg.network.initial_peers and not args.print_config  # no run id: list the runs
    if not resolved.cfg.peer.run_id and (args.auto or listing):
        from noloco_swarm.cli.auto import join_target

        target = join_target(args, resolved, JOIN_DEFAULTS)
        if isinstance(target, int):
            return target
        resolved, steps = target, target.cfg.inner.total_steps  # the run's own length
    cfg = resolved.cfg
    missing = [] if cfg.peer.run_id else ["noloco join needs a run id: give --run-id NAME (or peer.run_id)"]
    _refuse(resolved, "peer", *missing)
    if args.print_config:
        return _print_config(resolved, "join")
    from noloco_swarm.cli.join import run_join
    from noloco_swarm.peer.net.lifetime import die_with_parent, pin_to_cpus, release_memory

    if args.die_with_parent:
        die_with_parent()
    cpus = parse_cpus(cfg.peer.cpus)
    if cpus:  # before torch's threads and p2pd start: they inherit it
        try:
            pin_to_cpus(cpus)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    release_memory(cfg.peer.release_memory)  # before the model and its state exist
    if cfg.peer.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(
                "noloco: --device cuda, but this torch has no usable CUDA device "
                f"(torch {torch.__version__}); use --device cpu or install a CUDA build",
                file=sys.stderr,
            )
            return 2
        if cfg.peer.deterministic:
            from noloco_swarm.train.cuda import deterministic_cuda

            deterministic_cuda()
    _threads(args, peer=True, cpus=len(cpus))
    if args.resume and not cfg.peer.checkpoint_dir:
        print(
            "noloco: --resume needs --checkpoint-dir (the folder the peer wrote its checkpoints to)",
            file=sys.stderr,
        )
        return 2
    return run_join(
        cfg,
        steps,
        new_run=args.new_run,
        resume=args.resume,
        log_format=args.log_format,
        panel=not args.plain,
    )


def _doctor(args: argparse.Namespace) -> int:
    resolved = resolve_args(args, JOIN_DEFAULTS)
    if args.print_config:
        return _print_config(resolved, "doctor")
    from noloco_swarm.cli.doctor import run_doctor

    return run_doctor(
        resolved.cfg,
        port=args.port,
        memory_limit=args.memory_limit,
        timeout=args.timeout,
        refusals=resolved.cfg.refusals("peer", resolved.explicit),
    )


def _sim_layer(method: str) -> Layer:
    """An explicit `--methods` entry: the flag layer of that method's config."""
    if method == "noloco-fixed":  # the routing ablation: NoLoCo with each replica's own chain
        return Layer("--methods", {"method": "noloco", "outer.random_routing": False})
    if method == "local-fixed":  # the paper's ablation: no outer step, each replica's own chain
        return Layer("--methods", {"method": "local", "outer.random_routing": False})
    if method.startswith("diloco-"):  # a named baseline: diloco-heavyball or diloco-nesterov
        return Layer(
            "--methods", {"method": "diloco", "outer.diloco_variant": method.removeprefix("diloco-")}
        )
    return Layer("--methods", {"method": method})


def _sim(args: argparse.Namespace) -> int:
    defaults = {"num_replicas": 4}
    if args.methods is not None:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        configs = {m: resolve_args(args, defaults, top=[_sim_layer(m)]) for m in methods}
    else:
        base = resolve_args(args, defaults)
        if "method" in base.explicit:  # a source chose one method: compare nothing else
            configs = {base.cfg.outer.method: base}
        else:
            methods = SIM_METHODS.split(",")
            configs = {m: resolve_args(args, {**defaults, "method": m}) for m in methods}
    for resolved in configs.values():
        _refuse(resolved, "simulator")
    if args.print_config:
        for name, resolved in configs.items():
            _print_config(resolved, f"sim, method {name}")
        return 0
    from noloco_swarm.cli.sim import run_sim

    _threads(args)
    out = args.out or Path("runs") / time.strftime("sim-%Y%m%d-%H%M%S")
    return run_sim({m: r.cfg for m, r in configs.items()}, args.steps, out)


def _dht(args: argparse.Namespace) -> int:
    resolved = resolve_args(args, {"network.identity_path": str(DEFAULT_IDENTITY)})
    if args.print_config:
        return _print_config(resolved, "dht")
    from noloco_swarm.cli.dht import run_dht

    if args.run is not None and args.swarm_file is None:
        raise ConfigError("noloco dht: --run names the run of a --swarm-file; give --swarm-file FILE too")
    if args.run is not None:
        from noloco_swarm.protocol.codec import check_run_id

        try:
            check_run_id(args.run)
        except ValueError as e:
            raise ConfigError(f"noloco dht --run: {e}") from e
    return run_dht(
        resolved.cfg.network, address_file=args.address_file, swarm_file=args.swarm_file, run=args.run
    )


def _status(args: argparse.Namespace) -> int:
    resolved = resolve_args(args)
    cfg = resolved.cfg
    missing = [] if cfg.peer.run_id else ["noloco status needs --run-id NAME (or peer.run_id)"]
    if not cfg.network.initial_peers:
        missing.append("noloco status needs --initial-peers MADDR (or network.initial_peers)")
    if missing:
        raise ConfigError("\n".join(missing))
    if args.print_config:
        return _print_config(resolved, "status")
    from noloco_swarm.cli.status import run_status

    if args.until_announced < 0 or args.until_answering < 0 or args.wait < 0:
        raise ConfigError("noloco status: --until-announced, --until-answering and --wait must be >= 0")
    return run_status(
        cfg.network,
        cfg.peer.run_id,
        once=args.once,
        interval=args.interval,
        until_announced=args.until_announced,
        until_answering=args.until_answering,
        wait=args.wait,
    )


def _runs(args: argparse.Namespace) -> int:
    resolved = resolve_args(args)
    if not resolved.cfg.network.initial_peers:
        raise ConfigError("noloco runs needs --initial-peers MADDR (or network.initial_peers)")
    if args.print_config:
        return _print_config(resolved, "runs")
    from noloco_swarm.cli.runs import run_runs

    return run_runs(resolved.cfg.network, as_json=args.json)


def _plan(args: argparse.Namespace) -> int:
    from noloco_swarm.cli.plan import TOKEN_COST, as_json, as_text, load_token_costs, schedule_toml
    from noloco_swarm.model.presets import get_preset
    from noloco_swarm.sim.costs import gpu_named
    from noloco_swarm.sim.planner import Problem, plan

    token_cost = args.token_cost or TOKEN_COST
    try:
        problem = Problem(
            get_preset(args.preset),
            args.stages,
            args.replicas,
            args.rate_mbit,
            args.rtt_ms / 1000,
            gpu_named(args.gpu, args.gpu_memory_gb),
            mfu=args.mfu,
            hop_rtts=args.hop_rtts,
            capped=not args.no_cap,
            target_tokens=args.target_tokens,
            batches=_numbers(args.batches, "--batches"),
            microbatches=_numbers(args.microbatches, "--microbatches"),
            ranks=_numbers(args.ranks, "--ranks"),
            inner_steps=_numbers(args.inner_steps, "--inner-steps"),
        )
        costs = load_token_costs(token_cost)
    except ValueError as e:
        raise ConfigError(f"noloco plan: {e}") from e
    if args.top < 0:
        raise ConfigError("noloco plan: --top must be >= 0")
    result = plan(problem, costs)
    print(as_json(result, args.top) if args.json else as_text(result, args.top, token_cost))
    if args.write is not None:
        if not result.schedules:
            raise ConfigError("noloco plan: no schedule fits, so there is nothing to --write")
        first = result.schedules[0]
        title = f"noloco plan's first schedule: {first.candidate.label}; use with --config"
        try:
            args.write.write_text(schedule_toml(first, title), encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"noloco plan: cannot write {args.write}: {e}") from e
        print(f"wrote {args.write}", file=sys.stderr)
    return 0


def _numbers(text: str, flag: str) -> tuple[int, ...]:
    """A comma-separated list of whole numbers >= 1."""
    try:
        numbers = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} takes whole numbers separated by commas, got {text!r}") from None
    if not numbers or min(numbers) < 1:
        raise ValueError(f"{flag} needs at least one number, each >= 1, got {text!r}")
    return numbers


def _presets() -> int:
    from rich.console import Console
    from rich.table import Table

    from noloco_swarm.model.presets import PRESETS, SCHEDULES, count_parameters

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
            f"{SCHEDULES[name]['lr']:g}",
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
