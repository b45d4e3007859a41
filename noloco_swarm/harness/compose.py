"""The docker-compose testbed run and judged: up, watch, `noloco status`, wait, check, always down.

`scripts/compose_testbed.sh` gets an engine, Compose and the image ready, then runs this module.
It brings up docker-compose.yml's bootstrap and 2x2 peers, samples each peer's TCP connections
while they train (from /proc/net/tcp: the image has no `ss`), looks at the swarm with `noloco
status` from the bootstrap container from the moment it is up until a view shows every peer,
waits for the peers to exit, copies their event
files out and judges them: every peer ran its steps, each stage's replicas end with equal state
hashes, the training loss fell, and the peers talked over their container addresses, not
loopback. A peer that wrote its `Final` summary but does not exit is a hang: its threads and
Python stacks (faulthandler, on SIGABRT) are dumped before the run fails. The figures go to a
JSON file. The judging functions are pure (events and connection tables in, a verdict out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from noloco_swarm.peer.events import Event, Final, Outer, Step, of_kind, read

PEERS = ("stage0-a", "stage0-b", "stage1-a", "stage1-b")
PORT = 31337  # every container listens here (docker-compose.yml)
ESTABLISHED = "01"  # the state column of /proc/net/tcp
VIEW_AFTER = 90  # seconds the status loop may go on after the peers exit (their announcements last 30)
EXIT_GRACE = 60.0  # seconds a peer may take from its Final summary to its exit before it is a hang
# one look at a running peer: has it finished, and its TCP connections
LOOK = """grep -q '"event": "final"' /tmp/events.jsonl && echo FINAL
cat /proc/net/tcp"""
# `noloco status` from the moment the testbed is up, looking every second (one DHT node for all
# looks) until every peer is announced and answers its status call, then printing it (a view of
# peers announced but not yet answering once showed "0 answering" here): a look after the run can
# miss them (their announcements expire 30 s after their last heartbeat), and so can a look
# made only once every peer is seen stepping, or looks a fresh process each (about 20 s apiece
# on a loaded machine) against a run of 20 s. Started again after 60 s without them (and if it
# fails), each run's view printed after a marker: the last one is there for the report even when
# the loop is stopped (VIEW_AFTER seconds after the peers exit).
STATUS = (
    f"COLUMNS=120 noloco status --run-id compose --until-answering {len(PEERS)} --interval 1 "
    '--wait 60 --initial-peers "$(cat /shared/bootstrap.addr)" 2>&1'
)
VIEW_MARK = "== noloco status view"
STATUS_LOOP = f"""end=$(( $(date +%s) + {{seconds}} ))
while [ "$(date +%s)" -lt "$end" ]; do
  view=$({STATUS}); code=$?; echo "{VIEW_MARK} at $(date +%T)"; echo "$view"
  [ "$code" = 0 ] && exit 0
  sleep 2
done; exit 1"""
# every thread of the peer: name, state, kernel wait channel; then Python's own stacks
DIAGNOSE = r"""for p in /proc/[0-9]*; do
  c=$(tr '\0' ' ' < $p/cmdline 2>/dev/null); [ -n "$c" ] && echo "pid ${p#/proc/}: $c"; done
for p in /proc/[0-9]*; do case "$(tr '\0' ' ' < $p/cmdline 2>/dev/null)" in *noloco\ join*)
  echo "== python pid ${p#/proc/}"; grep -E 'State|Threads' $p/status
  for t in $p/task/*; do echo "thread ${t##*/} $(cat $t/comm) $(cut -d' ' -f3 $t/stat) wchan=$(cat $t/wchan)"; done
  kill -ABRT ${p#/proc/};; esac; done"""


def parse_proc_net_tcp(text: str) -> list[tuple[str, int, str, int]]:
    """Established IPv4 connections in a /proc/net/tcp table: (local ip, port, remote ip, port).

    Rows start with their slot number (`0:`); the header and any other line are skipped."""
    out = []
    for line in text.splitlines():
        cols = line.split()
        if len(cols) < 4 or not cols[0].endswith(":") or cols[3] != ESTABLISHED:
            continue
        (lip, lport), (rip, rport) = (c.split(":") for c in cols[1:3])
        out.append((_ip(lip), int(lport, 16), _ip(rip), int(rport, 16)))
    return out


def _ip(little_endian_hex: str) -> str:
    return socket.inet_ntoa(int(little_endian_hex, 16).to_bytes(4, "little"))


@dataclass(frozen=True)
class Verdict:
    """What a finished testbed run showed: the failed checks (none: it passed) and its figures."""

    problems: list[str]
    figures: dict[str, float | int | None]
    state_hashes: dict[str, str]
    talked_to: dict[str, list[str]] = field(default_factory=dict)  # peer -> peers it had TCP with


def judge(
    events: Mapping[str, Sequence[Event]],
    steps: int,
    addresses: Mapping[str, str],
    connections: Mapping[str, set[tuple[str, int, str, int]]],
) -> Verdict:
    """Judge a run from each peer's events, its container address and the connections it held."""
    problems = []
    finals = {}
    for peer in PEERS:
        f = of_kind(events.get(peer, ()), Final)
        if not f:
            problems.append(f"{peer} wrote no final summary")
        elif f[-1].steps != steps:
            problems.append(f"{peer} ended after {f[-1].steps} of {steps} steps")
        if f:
            finals[peer] = f[-1]
    for stage in (0, 1):
        hashes = {p: f.state_hash for p, f in finals.items() if f.stage == stage}
        if len(set(hashes.values())) > 1:
            problems.append(f"stage {stage} replicas ended with different states: {hashes}")
    by_step: dict[int, list[float]] = {}
    for peer_events in events.values():
        for s in of_kind(peer_events, Step):
            if s.loss is not None:
                by_step.setdefault(s.step, []).append(s.loss)
    losses = [sum(v) / len(v) for _, v in sorted(by_step.items())]
    k = max(1, min(10, len(losses) // 4))
    first = sum(losses[:k]) / k if losses else None
    last = sum(losses[-k:]) / k if losses else None
    if first is None or last is None or not last < first:
        problems.append(f"the training loss did not fall: first {first}, last {last}")
    by_address = {ip: peer for peer, ip in addresses.items()}
    talked_to = {}
    for peer in PEERS:
        mine = addresses.get(peer)
        others = sorted(
            {
                by_address[rip]
                for lip, lport, rip, rport in connections.get(peer, set())
                if lip == mine and rip in by_address and PORT in (lport, rport) and by_address[rip] != peer
            }
        )
        talked_to[peer] = others
        missing = [p for p in PEERS if p != peer and p not in others]
        if missing:
            problems.append(f"{peer} ({mine}) held no TCP connection at the container address of {missing}")
    return Verdict(
        problems,
        figures(events, finals, first, last),
        {p: f.state_hash for p, f in finals.items()},
        talked_to,
    )


def figures(
    events: Mapping[str, Sequence[Event]],
    finals: Mapping[str, Final],
    first: float | None,
    last: float | None,
) -> dict[str, float | int | None]:
    """Throughput and time per outer step: tokens enter at stage 0, every replica steps together."""
    stage0 = [f for f in finals.values() if f.stage == 0]
    seconds = max((f.train_seconds for f in finals.values()), default=0.0)
    outer = [o.seconds for ev in events.values() for o in of_kind(ev, Outer)]
    per_outer = [f.train_seconds / f.outer_steps for f in finals.values() if f.outer_steps]
    val = [f.val_loss for f in finals.values() if f.val_loss is not None]
    return {
        "train_seconds": round(seconds, 1),
        "tokens": sum(f.tokens for f in stage0),
        "tokens_per_second": round(sum(f.tokens for f in stage0) / seconds, 1) if seconds else None,
        "outer_steps": max((f.outer_steps for f in finals.values()), default=0),
        "seconds_per_outer_step": round(sum(per_outer) / len(per_outer), 2) if per_outer else None,
        "exchange_seconds_mean": round(sum(outer) / len(outer), 3) if outer else None,
        "train_loss_first": None if first is None else round(first, 4),
        "train_loss_last": None if last is None else round(last, 4),
        "val_loss_mean": round(sum(val) / len(val), 4) if val else None,
        "dropped_samples": sum(f.dropped_samples for f in finals.values()),
        "dropped_partners": sum(f.dropped_partners for f in finals.values()),
    }


class Testbed:
    """One compose project: its containers, always taken down by `down` (volumes and network too)."""

    def __init__(self, compose: Sequence[str], project: str, env: Mapping[str, str]) -> None:
        self.compose = [*compose, "-p", project]
        self.env = {**os.environ, **env}

    def sh(self, *argv: str, check: bool = True, timeout: float = 120) -> str:
        done = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def up(self) -> dict[str, str]:
        self.sh(*self.compose, "up", "--detach", "--no-build", timeout=300)
        ids = {s: self.sh(*self.compose, "ps", "-q", s).strip() for s in ("bootstrap", *PEERS)}
        return ids

    def down(self) -> None:
        self.sh(
            *self.compose,
            "down",
            "--volumes",
            "--remove-orphans",
            "--timeout",
            "10",
            check=False,
            timeout=180,
        )

    def running(self, cid: str) -> bool:
        return self.sh("docker", "inspect", "-f", "{{.State.Running}}", cid, check=False).strip() == "true"

    def logs(self, cid: str) -> str:
        argv = ["docker", "logs", cid]
        return subprocess.run(
            argv,
            capture_output=False,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        ).stdout

    def exec(self, cid: str, script: str, timeout: float = 30) -> str:
        return self.sh("docker", "exec", cid, "sh", "-c", script, check=False, timeout=timeout)

    def start(self, cid: str, script: str) -> subprocess.Popen[str]:
        """`script` run in the container in the background; its output (stderr too) on a pipe."""
        argv = ["docker", "exec", cid, "sh", "-c", script]
        return subprocess.Popen(
            argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )


class Interrupted(Exception):
    """SIGTERM, raised where the run is so that `finally` takes the testbed down."""


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signal.Signals(signum).name)


@dataclass
class Watch:
    """What watching the peers until they exit found."""

    connections: dict[str, set[tuple[str, int, str, int]]]
    hang: str = ""  # why the run counts as hung; "" if it ended


def watch(bed: Testbed, ids: Mapping[str, str], args: argparse.Namespace, out: Path) -> Watch:
    """Sample each peer's connections until every peer has exited.

    A peer whose events hold its `Final` summary but which still runs EXIT_GRACE later is a hang:
    its processes, threads and (faulthandler, SIGABRT) Python stacks are saved for the report.
    """
    seen = Watch({p: set() for p in PEERS})
    final_at: dict[str, float] = {}
    started = time.monotonic()
    while running := [p for p in PEERS if bed.running(ids[p])]:
        now = time.monotonic()
        if now - started > args.timeout:
            seen.hang = f"the run did not end within {args.timeout:.0f} s"
        for p in running:
            table = bed.exec(ids[p], LOOK)
            seen.connections[p].update(parse_proc_net_tcp(table))
            if "FINAL\n" in table:
                final_at.setdefault(p, now)
        stuck = [p for p in running if p in final_at and now - final_at[p] > EXIT_GRACE]
        if stuck:
            seen.hang = f"{stuck} wrote a final summary but did not exit within {EXIT_GRACE:.0f} s"
        if seen.hang:
            print(f"compose: HANG: {seen.hang}; saving each running peer's threads and stacks", flush=True)
            for p in running:
                (out / f"{p}.diagnosis.txt").write_text(bed.exec(ids[p], DIAGNOSE))
            time.sleep(3)  # faulthandler writes the stacks to the container's log
            return seen
        time.sleep(args.poll)
    return seen


def last_view(output: str) -> str:
    """The status loop's last view (its whole output if it printed none)."""
    views = re.split(f"^{VIEW_MARK}.*\n", output, flags=re.MULTILINE)[1:]
    return views[-1].rstrip() if views else output.strip()


def finish(process: subprocess.Popen[str], timeout: float) -> str:
    """Everything `process` printed, waiting at most `timeout` seconds for it to end on its own."""
    try:
        return process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()[0]


def run(args: argparse.Namespace) -> int:
    env = {"NOLOCO_IMAGE": args.image, "NOLOCO_STEPS": str(args.steps), "NOLOCO_SET": args.set}
    for item in args.slow:
        peer, _, rate = item.partition("=")
        if peer not in PEERS or not rate:
            print(f"compose: --slow takes PEER=RATE with PEER one of {', '.join(PEERS)}", file=sys.stderr)
            return 2
        env[f"NOLOCO_RATE_{peer.upper().replace('-', '_')}"] = rate
    bed = Testbed(shlex.split(args.compose), args.project, env)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _raise_interrupted)  # Ctrl-C raises KeyboardInterrupt already
    started = time.monotonic()
    viewer: subprocess.Popen[str] | None = None
    try:
        ids = bed.up()
        ip = "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
        addresses = {p: bed.sh("docker", "inspect", "-f", ip, ids[p]).strip() for p in PEERS}
        at = ", ".join(f"{p} {a}" for p, a in addresses.items())
        print(f"compose: up: bootstrap + {len(PEERS)} peers, {args.steps} steps, at {at}", flush=True)
        viewer = bed.start(ids["bootstrap"], STATUS_LOOP.format(seconds=int(args.timeout) + VIEW_AFTER))
        seen = watch(bed, ids, args, out)
        views = finish(viewer, VIEW_AFTER)
        shown = viewer.returncode == 0  # noloco status --until-answering: every peer answered
        (out / "status_views.txt").write_text(views)
        view = last_view(views)
        print(view, flush=True)
        (out / "status.txt").write_text(view + "\n")
        for p in PEERS:
            (out / f"{p}.log").write_text(bed.logs(ids[p]))
            bed.sh("docker", "cp", f"{ids[p]}:/tmp/events.jsonl", str(out / f"{p}.events.jsonl"), check=False)
        codes = {p: bed.sh("docker", "inspect", "-f", "{{.State.ExitCode}}", ids[p]).strip() for p in PEERS}
    except (KeyboardInterrupt, Interrupted):
        print("compose: interrupted; taking the testbed down", file=sys.stderr)
        return 130
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"compose: {e}", file=sys.stderr)
        return 1
    finally:
        if viewer is not None and viewer.poll() is None:
            viewer.kill()
            viewer.communicate()
        bed.down()
    events = {p: read(out / f"{p}.events.jsonl") for p in PEERS}
    verdict = judge(events, args.steps, addresses, seen.connections)
    problems = [f"the run hung: {seen.hang} (see *.diagnosis.txt and *.log)"] if seen.hang else []
    problems += verdict.problems + [f"{p} exited with code {c}" for p, c in codes.items() if c != "0"]
    if not shown:
        problems.append(
            f"noloco status never showed the {len(PEERS)} peers announced (status.txt: its last view)"
        )
    result = {
        "command": args.command or shlex.join(sys.argv),
        "steps": args.steps,
        "set": args.set,
        "slow": args.slow,
        "wall_seconds": round(time.monotonic() - started, 1),
        "status_shown_every_peer": shown,
        **asdict(verdict),
        "passed": not problems,
        "problems": problems,
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    for line in problems:
        print(f"compose: FAILED: {line}", file=sys.stderr)
    return 0 if not problems else (2 if seen.hang else 1)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compose_testbed", description=__doc__.splitlines()[0])
    p.add_argument(
        "--compose", default="docker compose", help="the Compose command (default: docker compose)"
    )
    p.add_argument("--image", default="noloco-swarm:latest", help="the image the services run")
    p.add_argument("--project", default="noloco-testbed", help="the compose project name")
    p.add_argument("--steps", type=int, default=120, help="inner steps of the run (default: 120)")
    p.add_argument("--set", default="outer.inner_steps=20", help="extra config for every peer, KEY=VALUE;...")
    p.add_argument(
        "--slow",
        action="append",
        default=[],
        metavar="PEER=RATE",
        help="shape one peer's uplink, e.g. stage1-b=4mbit",
    )
    p.add_argument(
        "--out", type=Path, default=Path("runs/compose"), help="logs, events and result.json go here"
    )
    p.add_argument("--timeout", type=float, default=1200, help="seconds before the run counts as hung")
    p.add_argument("--poll", type=float, default=3.0, help="seconds between looks at the peers")
    p.add_argument("--command", default="", help=argparse.SUPPRESS)  # the user's command, for result.json
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
