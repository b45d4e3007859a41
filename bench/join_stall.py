"""What a join costs the swarm it joins: the joiner's round and the rounds before it while the
donors serve it, against the same rounds of the same swarm left alone, side by side in one run.

A 2 x 2 swarm (tiny's vocabulary, widened so that a stage's state, phi + delta + AdamW's two
moments, is about 300 MB) trains; a fifth peer starts on stage 1 after the swarm's first steps
and joins at round J (two rounds ahead, peer/joining.py). Four runs per repetition:

  early   the donors keep their state for the joiner at the boundary before J, where they read
          its announcement, and the joiner downloads it while the swarm trains round J-1 (the
          rule since 2026-12-07)
  kept    early, with failpoint keep_round:rpc_fetch_state on the joiner: a download that would
          outlast round J-1 keeps round J anyway, and the swarm waits for it at J (the early path
          until peer/postpone.py); early moves its round further off instead
  late    early, with failpoint miss_joiners:rpc_fetch_state on both donors: they keep nothing
          there, so they keep their state at J's boundary and round J waits for the download (every
          join before 2026-12-07; now the fallback for a donor that reads the joiner late)
  calm    no joiner

Per run, with A the round the joiner announced first and J the round it entered (A, unless its
download would outlast round A-1 and it moved: peer/postpone.py):

  announced_round   A; `postponed` lists every move (from, to, the projections behind it)
  round_seconds     wall time of every round r but the first on the four first peers (median of
                    each): from their step r*H (a boundary, its outer step included) to the end of
                    step r*H + H
  serving_seconds   from the donors' snapshot (`joiners` event) to the last chunk they served
  ready_seconds     from the snapshot to the joiner's `joined` event (downloaded, checked, loaded,
                    and, on the early path, its view of J received at J's boundary)
  from_step         the step of the state the joiner loaded: (A-1)*H early, J*H late
  slowest_step      the longest step of rounds A-1 to J on the first peers, and which step it was

  cpu_seconds       CPU time over rounds A-1 to J (calm: the early run's) of each group of
                    processes: the two donors (stage 1), the two stage-0 peers and the joiner,
                    each split into the peers' event loops, their compute threads and their p2pd
                    daemons (read from /proc every 0.25 s, as bench/cpu_accounting.py reads it)

The cost of a join is its run's time for rounds A-1 to J
minus calm's (`extra_seconds`), with each round's part beside it, and its CPU time over calm's
(`early_extra_cpu_seconds`, by group and part): what the donors' own processes spend serving, against
what their daemons and the joiner spend, which a volunteer's machines would not take from the
same cores. On this 2-core machine the
joiner's own download, hashing and loading take CPU from the four donors and neighbours, which a
volunteer's joiner on its own machine would not: `--joiner-cpu 1` runs the joiner on CPU 1
and the four others on CPU 0 (`--swarm-cpus`), in every run, so that only the donors' serving
and the swarm's waiting can slow the swarm. `--serve-rate` caps each donor's serving
(`peer.state_serve_rate`, MiB/s), as a slow link to the joiner would.

    python bench/join_stall.py --reps 2 --out docs/results/join_stall.json
    python bench/join_stall.py --reps 2 --joiner-cpu 1 --out docs/results/join_stall_pinned.json
    python bench/join_stall.py --reps 2 --serve-rate 30 --out docs/results/join_stall_paced.json
    python bench/join_stall.py --reps 2 --steps 100 --inner-steps 10 --serve-rate 2 \
        --out docs/results/join_stall_slow_link.json

(The first three were run before the kept mode existed, 2026-12-07, at 02fdbf0 and before.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from cpu_accounting import by_part

from noloco_swarm.harness.local import local_swarm, until
from noloco_swarm.peer.events import Joined, Joiners, Joining, JoinPostponed, ServedState, Step, of_kind
from noloco_swarm.train.layering import build_config

MODES = ("early", "kept", "late")
WIDE = {
    "model.hidden_size": "512",
    "model.intermediate_size": "2048",
    "model.num_layers": "8",
    "model.num_heads": "8",
}


def config(args: argparse.Namespace):
    rate = {"peer.state_serve_rate": str(args.serve_rate)} if args.serve_rate else {}
    return build_config(
        "tiny",
        "noloco",
        assignments={
            "num_stages": "2",
            "num_replicas": "2",
            "model.seq_len": "64",
            "inner.batch_size": "4",
            "outer.inner_steps": str(args.inner_steps),
            "inner.total_steps": str(args.steps),
            **WIDE,
            **rate,
        },
        env={},
    )


class CpuLog(threading.Thread):
    """CPU seconds so far of each group of peers (and their daemons), by part, every `period` s."""

    def __init__(self, groups: dict[str, list[int]], period: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.groups, self.period = groups, period
        self.samples: list[tuple[float, dict[str, dict[str, float]]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period):
            self.samples.append((time.time(), {g: by_part(pids) for g, pids in self.groups.items()}))

    def between(self, start: float, end: float) -> dict[str, dict[str, float]]:
        """CPU seconds of each group and part from the last sample at or before `start` to the
        first at or after `end`."""
        a = max((s for s in self.samples if s[0] <= start), default=self.samples[0], key=lambda s: s[0])
        b = min((s for s in self.samples if s[0] >= end), default=self.samples[-1], key=lambda s: s[0])
        return {
            g: {part: round(b[1][g].get(part, 0.0) - a[1][g].get(part, 0.0), 2) for part in b[1][g]}
            for g in b[1]
        }


def run(args: argparse.Namespace, mode: str, cpu_rounds: tuple[int, int] | None = None) -> dict:
    """One swarm; early or late, a stage-1 joiner; calm, none. Measures every round but the first."""
    cfg = config(args)

    def env(stage: int | None, replica: int) -> dict[str, str]:
        joiner = replica == 2  # the first four peers are replicas 0 and 1 of each stage
        late = (
            {"NOLOCO_FAILPOINTS": "miss_joiners:rpc_fetch_state=1"} if mode == "late" and stage == 1 else {}
        )
        if mode == "kept" and joiner:
            late = {"NOLOCO_FAILPOINTS": "keep_round:rpc_fetch_state=1000"}
        pinned = {"NOLOCO_SET": f"peer.cpus={args.joiner_cpu if joiner else args.swarm_cpus}"}
        return late | (pinned if args.joiner_cpu is not None else {})

    with local_swarm(cfg, args.steps, step_timeout=60, peer_env=env) as swarm:
        first = list(swarm.peers)
        until(lambda: all(len(of_kind(p.events(), Step)) >= 3 for p in first), 600, "every peer's third step")
        groups = {f"stage {s}": [p.proc.pid for p in first if p.stage == s] for s in (0, 1)}
        joiner = swarm.start_peer(1) if mode != "calm" else None
        cpu = CpuLog(groups | ({"joiner": [joiner.proc.pid]} if joiner is not None else {}))
        cpu.start()
        until(lambda: all(p.proc.poll() is not None for p in swarm.peers), 1800, "the run's end")
        cpu.done.set()
        cpu.join()
        if any(p.proc.returncode != 0 for p in swarm.peers):
            raise RuntimeError("a peer failed:\n" + "\n".join(p.log_tail(10) for p in swarm.peers))
        events = {id(p): p.events() for p in swarm.peers}
    row: dict = {"mode": mode}
    round_ = None
    if joiner is not None:
        joined = of_kind(events[id(joiner)], Joined)[0]
        round_ = joined.round
        donors = [p for p in first if of_kind(events[id(p)], Joiners)]
        snapshot = min(of_kind(events[id(p)], Joiners)[0].time for p in donors)
        served = [e.time for p in donors for e in of_kind(events[id(p)], ServedState)]
        postponed = of_kind(events[id(joiner)], JoinPostponed)
        row |= {
            "announced_round": of_kind(events[id(joiner)], Joining)[0].round,
            "postponed": [
                {
                    "round": e.round,
                    "to": e.to,
                    "download_seconds": e.download_seconds,
                    "swarm_seconds": e.swarm_seconds,
                }
                for e in postponed
            ],
            "chunks_served": len(served),
            "serving_seconds": max(served) - snapshot,
            "ready_seconds": joined.time - snapshot,
            "from_step": joined.from_step,
        }
    h = args.inner_steps
    steps_at = [{e.step: e.time for e in of_kind(events[id(p)], Step)} for p in first]
    rounds = range(1, args.steps // h)
    row["round_seconds"] = {
        str(r): statistics.median(at[r * h + h] - at[r * h] for at in steps_at) for r in rounds
    }
    if round_ is not None:
        start, end = (row["announced_round"] - 1) * h, round_ * h + h
        slowest = max((at[s] - at[s - 1], s) for at in steps_at for s in range(start + 1, end + 1))
        row |= {"round": round_, "slowest_step": {"seconds": slowest[0], "step": slowest[1]}}
    # CPU from the first peers' step (A-1)*H to J*H + H (medians), A the round the joiner first
    # announced and J the one it entered (calm: the early run's)
    first, J = (row["announced_round"], round_) if round_ is not None else (cpu_rounds or (None, None))
    if J is not None:
        start = statistics.median(at[(first - 1) * h] for at in steps_at)
        row["cpu_seconds"] = cpu.between(start, statistics.median(at[J * h + h] for at in steps_at))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--inner-steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--serve-rate", type=float, default=0.0, help="peer.state_serve_rate, MiB/s (0: no cap)")
    ap.add_argument("--joiner-cpu", default=None, help="run the joiner (and its p2pd) on these CPUs only")
    ap.add_argument("--swarm-cpus", default="0", help="with --joiner-cpu: the four first peers' CPUs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    reps = []
    for _ in range(args.reps):
        rep: dict = {mode: run(args, mode) for mode in MODES}
        rep["calm"] = run(args, "calm", cpu_rounds=(rep["early"]["announced_round"], rep["early"]["round"]))
        calm = rep["calm"]["round_seconds"]
        for mode in MODES:
            first, J = rep[mode]["announced_round"], rep[mode]["round"]
            extra = {
                str(r): rep[mode]["round_seconds"][str(r)] - calm[str(r)] for r in range(first - 1, J + 1)
            }
            rep |= {f"{mode}_extra_seconds": sum(extra.values()), f"{mode}_extra_by_round": extra}
        rep["early_extra_cpu_seconds"] = {  # the early run's CPU over its rounds A-1 to J, over calm's
            group: {
                part: round(cpu - rep["calm"]["cpu_seconds"].get(group, {}).get(part, 0.0), 2)
                for part, cpu in parts.items()
            }
            for group, parts in rep["early"]["cpu_seconds"].items()
        }
        reps.append(rep)
        print(json.dumps({k: v for k, v in rep.items() if "extra" in k}), flush=True)
    result = {
        "command": "python bench/join_stall.py " + " ".join(sys.argv[1:]),
        "config": {
            "preset": "tiny",
            "shape": WIDE,
            "stages": 2,
            "replicas": 2,
            "seq_len": 64,
            "batch_size": 4,
            "inner_steps": args.inner_steps,
            "steps": args.steps,
        },
        "serve_rate_mib_s": args.serve_rate,
        "cpus": None if args.joiner_cpu is None else {"swarm": args.swarm_cpus, "joiner": args.joiner_cpu},
        "reps": reps,
    }
    for mode in MODES:
        result[f"{mode}_extra_seconds_median"] = statistics.median(r[f"{mode}_extra_seconds"] for r in reps)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
