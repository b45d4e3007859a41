"""The `noloco` argument parser, built one command at a time: each command's options in its own function."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from noloco_swarm.cli.flags import (
    PRECEDENCE,
    add_metrics_port,
    add_network,
    add_peer,
    add_pin,
    add_run,
    add_sources,
    add_testbed,
)
from noloco_swarm.cli.logs import LOG_FORMATS

DESCRIPTION = "`noloco`: the command line of noloco-swarm."
DEFAULT_IDENTITY = Path("~/.config/noloco-swarm/dht.key")
SIM_METHODS = "noloco,diloco,allreduce,local"

EPILOG = f"""Every setting is a config key (`noloco keys` lists them), given in a TOML file (--config),
in NOLOCO_SET="KEY=VALUE;KEY=VALUE" or as --set KEY=VALUE (repeatable); a named flag sets its key
only when given. Precedence: {PRECEDENCE}. --print-config shows what a run will use."""

Subparsers = argparse._SubParsersAction  # what add_subparsers returns: one add_parser per command


def local_command(sub: Subparsers) -> None:
    local = sub.add_parser(
        "local",
        help="train the tiny preset on the embedded corpus on this machine (the main job)",
        description="A whole swarm on this machine: P stages x D replicas of the tiny preset, trained "
        "on the embedded corpus with NoLoCo, with a live view and a final summary.",
        epilog=EPILOG,
    )
    add_run(local, replicas=4, steps=200)
    add_sources(local)
    local.add_argument("--plain", action="store_true", help="print progress lines instead of the live view")
    local.add_argument(
        "--in-process",
        action="store_true",
        help="run the swarm inside this process (the simulator), no network",
    )
    local.add_argument("--keep", type=Path, default=None, help="keep peer logs and metrics in this folder")
    add_pin(local, default=True)
    local.add_argument(
        "--plot",
        action="store_true",
        help="at the end, write the run's charts (noloco plot) to KEEP/plots, or runs/local-<time>/plots",
    )
    add_metrics_port(
        local,
        "serve each peer's Prometheus metrics: the first at PORT, the next at PORT+1, ... (default: off)",
    )


def join_command(sub: Subparsers) -> None:
    join = sub.add_parser(
        "join",
        help="run one peer: host one stage of a run and train with the swarm",
        description="Join a run through any live peer (--initial-peers), host one pipeline stage, train.",
        epilog=EPILOG,
    )
    add_run(join, replicas=2, steps=300)
    add_sources(join)
    add_peer(join)
    add_network(join, identity_default=None, peers_help="multiaddrs of live peers")
    join.add_argument(
        "--new-run", action="store_true", help="publish the run's manifest if it does not exist"
    )
    join.add_argument(
        "--auto",
        action="store_true",
        help="without --run-id: join the open run and stage that need a peer most among those this "
        "machine can host, and say why (without --auto, no --run-id lists the open runs)",
    )
    join.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir (a stopped swarm restarts "
        "from it; a running one is joined as a late joiner)",
    )
    join.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="json: one JSON object per line on stderr, for systemd, Docker and log collectors (default: text)",
    )
    join.add_argument(
        "--plain",
        action="store_true",
        help="no live panel on a terminal: only the peer's own lines (start, warnings, end)",
    )
    join.add_argument("--run-config", type=Path, default=None, help=argparse.SUPPRESS)  # from noloco local
    join.add_argument("--die-with-parent", action="store_true", help=argparse.SUPPRESS)


def testbed_command(sub: Subparsers) -> None:
    testbed = sub.add_parser(
        "testbed",
        help="a local swarm with each peer in its own network namespace: shaped, cut, delayed links",
        description="Like noloco local, but the bootstrap node and every peer run in their own network "
        "namespace on one bridge (needs root), with links that can be shaped, cut and delayed.",
        epilog=EPILOG,
    )
    add_run(testbed, replicas=2, steps=30)
    add_sources(testbed)
    add_testbed(testbed)
    add_pin(testbed, default=False)


def sim_command(sub: Subparsers) -> None:
    sim = sub.add_parser(
        "sim",
        help="compare methods in the in-process simulator; writes JSON, CSV and a PNG plot",
        epilog=EPILOG,
    )
    add_run(sim, replicas=4, steps=300, method=False)
    add_sources(sim)
    sim.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated: noloco, diloco (heavy-ball), diloco-heavyball, diloco-nesterov, allreduce, "
        f"local, noloco-fixed and local-fixed (random routing off) "
        f"(default: the config's method if a source sets one, else {SIM_METHODS})",
    )
    sim.add_argument("--out", type=Path, default=None, help="output folder (default: runs/sim-<time>)")


def dht_command(sub: Subparsers) -> None:
    dht = sub.add_parser(
        "dht",
        help="run a bootstrap node and print the --initial-peers address to share",
        epilog=EPILOG,
    )
    add_sources(dht)
    add_network(dht, identity_default=str(DEFAULT_IDENTITY), peers_help="other bootstrap nodes to join")
    dht.add_argument(
        "--address-file", type=Path, default=None, help="also write the --initial-peers address here"
    )
    dht.add_argument(
        "--swarm-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write a swarm file of this node's addresses, to ship to volunteers: they give it "
        "as --initial-peers FILE (with --run RUN, it also names the run to join)",
    )
    dht.add_argument("--run", default=None, metavar="RUN", help="the run the --swarm-file names")


def status_command(sub: Subparsers) -> None:
    status = sub.add_parser(
        "status", help="a live view of a running swarm: every peer's stage, step and loss", epilog=EPILOG
    )
    add_sources(status)
    add_network(status, identity_default=None, peers_help="multiaddrs of live peers (required)")
    status.add_argument("--run-id", default=None, help="the run to show (required; key peer.run_id)")
    status.add_argument("--once", action="store_true", help="print one snapshot and exit")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    status.add_argument(
        "--until-announced",
        type=int,
        default=0,
        metavar="N",
        help="look every --interval seconds until N peers are announced, then print that snapshot "
        "and exit 0 (exit 1 with the last one after --wait seconds): wait for a swarm to form",
    )
    status.add_argument(
        "--until-answering",
        type=int,
        default=0,
        metavar="N",
        help="as --until-announced, until N peers answer the status call (not only announced)",
    )
    status.add_argument(
        "--wait",
        type=float,
        default=60.0,
        help="seconds --until-announced/--until-answering wait at most (default 60)",
    )


def runs_command(sub: Subparsers) -> None:
    runs = sub.add_parser(
        "runs",
        help="list the runs on a DHT: what each trains, its peers per stage, where it needs peers",
        description="List the runs announced on the DHT reached through --initial-peers: model, "
        "method, peers per stage against what each stage asks for, open or closed, round and tokens. "
        "Only runs whose manifest is signed by the peer that listed them; others are skipped and counted.",
        epilog=EPILOG,
    )
    add_sources(runs)
    add_network(runs, identity_default=None, peers_help="multiaddrs of live peers (required)")
    runs.add_argument("--json", action="store_true", help='print {"runs": [...], "skipped": n} instead')


def doctor_command(sub: Subparsers) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="preflight checks before joining: daemon, port, bootstrap peers, memory, versions",
        description="Check that this machine can join a swarm: p2pd starts, the port is free, the "
        "bootstrap peers answer, the run's manifest matches (with --run-id), the stage fits in memory, "
        "the installed versions match. Each failure comes with a one-line fix; exit 0 only if all pass.",
        epilog=EPILOG,
    )
    add_run(doctor, replicas=2, steps=300)
    add_sources(doctor)
    add_peer(doctor)
    add_network(doctor, identity_default=None, peers_help="multiaddrs of the bootstrap peers to dial")
    doctor.add_argument("--port", type=int, default=None, help="the TCP port noloco join will listen on")
    doctor.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        metavar="GIB",
        help="memory this peer may use, if less than what is free (e.g. to leave room for other work)",
    )
    doctor.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for each bootstrap peer (default: 10)"
    )


def plot_command(sub: Subparsers) -> None:
    plot = sub.add_parser(
        "plot",
        help="PNG charts of a run from its peers' event files (noloco local --keep DIR)",
        description="Charts of loss, validation perplexity, tokens/s and bytes per peer, against steps and "
        "wall-clock time, from the *.jsonl event files in RUN_DIR.",
    )
    plot.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="a folder of *.jsonl event files, or one file"
    )
    plot.add_argument("--out", type=Path, default=None, help="output folder (default: RUN_DIR/plots)")


def closed_run_commands(sub: Subparsers) -> None:
    """`noloco authority` and `noloco ticket`: a closed run's organiser admits peers by ticket."""
    authority = sub.add_parser(
        "authority",
        help="make a closed run's authority key (the organiser's): only peers with its tickets serve",
        description="Write a new authority key and print the `authority` line for the run's config.",
    )
    authority.add_argument("--out", type=Path, required=True, help="where to write the key (keep it private)")
    ticket = sub.add_parser(
        "ticket",
        help="issue a join ticket of a closed run for one peer",
        description="Sign a ticket that lets one peer id serve in a closed run until it expires.",
    )
    ticket.add_argument("--authority", type=Path, required=True, help="the run's authority key file")
    ticket.add_argument("--run-id", required=True, help="the run the ticket admits to")
    ticket.add_argument("--peer-id", default=None, help="the peer's id (or give --identity)")
    ticket.add_argument("--identity", type=Path, default=None, help="the peer's identity key file")
    ticket.add_argument("--hours", type=float, default=24.0 * 30, help="validity in hours (default: 720)")
    ticket.add_argument("--out", type=Path, required=True, help="where to write the ticket")


def plan_command(sub: Subparsers) -> None:
    plan = sub.add_parser(
        "plan",
        help="rank schedules (wire format, microbatches, overlap, H, batch) by projected time to a target",
        description="Project candidate schedules of a NoLoCo swarm with the wall-clock model: tokens/s, "
        "utilisation of the GPUs, bytes per step of the busiest peer and time to the target loss (tokens "
        "from the measured token costs, docs/results/token_cost.json), best first, each with the config "
        "keys that run it.",
    )
    plan.add_argument("--preset", default="medium", help="model preset (default: medium)")
    plan.add_argument("--stages", type=int, default=4, help="pipeline stages P (default: 4)")
    plan.add_argument("--replicas", type=int, default=4, help="replicas D of every stage (default: 4)")
    plan.add_argument("--rate-mbit", type=float, required=True, help="every peer's link rate, each way")
    plan.add_argument("--rtt-ms", type=float, required=True, help="round-trip time between two peers")
    plan.add_argument(
        "--gpu", default="h100", help="h100, a100, l4, rtx4090, rtx3090, or a peak dense bf16 TFLOP/s"
    )
    plan.add_argument(
        "--gpu-memory-gb", type=float, default=None, help="the GPU's memory (default: the table's)"
    )
    plan.add_argument(
        "--mfu", type=float, default=0.4, help="share of the peak a stage sustains (default: 0.4)"
    )
    plan.add_argument(
        "--hop-rtts",
        type=float,
        default=1.0,
        help="round trips the stack adds to every activation or gradient message (default: 1)",
    )
    plan.add_argument(
        "--no-cap", action="store_true", help="plan without capping the exchange at 93%% of the link"
    )
    plan.add_argument(
        "--target-tokens",
        type=float,
        default=None,
        help="the dense run's tokens to the target loss (default: the preset's steps x D x 8 x seq)",
    )
    plan.add_argument(
        "--token-cost", type=Path, default=None, help="token costs (default: docs/results/token_cost.json)"
    )
    for flag, default, what in (
        ("--batches", "8,16,32,64", "batch sizes per replica to try (those the GPU's memory holds)"),
        ("--microbatches", "1,4,8,16,32", "microbatch counts to try (those that divide the batch)"),
        ("--ranks", "32,64,128,256", "subspace ranks to try (those below the hidden size)"),
        ("--inner-steps", "50,100,250", "H to try; each blocking and with k = H/2 overlapped"),
    ):
        plan.add_argument(flag, default=default, metavar="N,N,...", help=f"{what} (default: {default})")
    plan.add_argument(
        "--top", type=int, default=10, help="schedules shown of the measured and of the unmeasured (0: all)"
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of the table")
    plan.add_argument(
        "--write",
        type=Path,
        metavar="FILE",
        default=None,
        help="also write the first schedule as a TOML config file, for the organiser's --config",
    )


def listing_commands(sub: Subparsers) -> None:
    """`noloco presets` and `noloco keys`: what a run can be configured with."""
    sub.add_parser("presets", help="list model presets and their parameter counts")
    keys = sub.add_parser("keys", help="list the config keys a volunteer or organiser sets")
    keys.add_argument("--all", action="store_true", help="also list the experimental keys")


# In the order `noloco --help` lists them.
COMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    local_command,
    join_command,
    testbed_command,
    sim_command,
    dht_command,
    status_command,
    runs_command,
    doctor_command,
    plot_command,
    plan_command,
    closed_run_commands,
    listing_commands,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="noloco", description=DESCRIPTION, epilog=EPILOG)
    sub = p.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return p
