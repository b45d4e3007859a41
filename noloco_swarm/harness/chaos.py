"""A seeded fault schedule played against a running swarm on the namespace testbed (the chaos test
in tests/integration/test_chaos.py and bench/chaos.py).

The schedule holds the six faults a volunteer swarm meets, in this order: a peer killed (SIGKILL:
nothing of its own runs), a joiner on the dead peer's stage, a peer frozen with its daemon (SIGSTOP)
for longer than the step deadline, a link cut, a delay spike on one link, and a graceful leave
(SIGTERM). The seed picks the victims and the step each fault starts at. One peer, the
reference, is never a victim: its steps are the swarm's clock.

`Chaos.play` measures the swarm's healthy pace first (inner steps per second over a window of the
reference's steps), then for each fault: waits for its step, applies it, ends it after its
duration, waits until the swarm has healed, and measures the pace over the next window. Healed: every
running peer holds the same view of the latest round they all reached, that view holds exactly
the running peers, each of them has taken a step of it, and it is at least two rounds after the
one the fault ended in (a gone report takes effect at the boundary after the next, so a thawed
peer still in the view of its round may yet be dropped, and rejoin). The
windows between faults are what "keeps its pace between faults" compares with the healthy one.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

from noloco_swarm.harness.local import PeerProcess
from noloco_swarm.harness.namespaces import NamespaceSwarm, peer_host
from noloco_swarm.peer.events import Carried, Dropped, Event, Left, Membership, Step, StoodIn, Unsent, of_kind
from noloco_swarm.train.config import RunConfig
from noloco_swarm.train.layering import build_config

KINDS = ("kill", "join", "stop", "cut", "spike", "leave")
STAGES, REPLICAS, INNER_STEPS, BATCH, SEQ_LEN = 2, 3, 5, 4, 128


def chaos_config(steps: int, method: str = "noloco") -> RunConfig:
    """The swarm the chaos schedule runs against: the tiny preset, 2 stages x 3 replicas, H = 5,
    4 windows of 128 tokens per replica and step (steps of a few tenths of a second here)."""
    return build_config(
        "tiny",
        method,
        assignments={
            "num_stages": str(STAGES),
            "num_replicas": str(REPLICAS),
            "model.seq_len": str(SEQ_LEN),
            "inner.batch_size": str(BATCH),
            "outer.inner_steps": str(INNER_STEPS),
            "inner.warmup_steps": "2",
            "inner.total_steps": str(steps),
            "eval_windows": "4",
        },
        env={},
    )


@dataclass(frozen=True)
class Fault:
    """One fault: `kind` on the peer of `stage`, `replica` (a joiner: the spare host it starts on),
    once the reference has taken `at_step` steps; a stop, cut or spike lasts `seconds`."""

    kind: str
    stage: int
    replica: int
    at_step: int
    seconds: float = 0.0
    delay_ms: float = 0.0

    @property
    def host(self) -> str:
        return peer_host(self.stage, self.replica)


def schedule(
    seed: int,
    stages: int,
    replicas: int,
    *,
    inner_steps: int,
    reference: tuple[int, int] = (1, 0),
    gap_rounds: int = 3,
    stop_s: float = 15.0,
    cut_s: float = 20.0,
    spike_s: float = 10.0,
    spike_ms: float = 300.0,
) -> list[Fault]:
    """The six faults for a `stages` x `replicas` swarm, victims and start steps drawn from `seed`:
    each fault starts at least `gap_rounds` rounds after the one before (plus 0-2 steps), and
    never on the reference peer. The killed peer's stage gets the joiner, on a spare host."""
    rng = random.Random(seed)
    candidates = [(s, r) for s in range(stages) for r in range(replicas) if (s, r) != reference]
    if len(candidates) < 5:
        raise ValueError(f"a {stages} x {replicas} swarm has too few peers for five distinct victims")
    killed = rng.choice(candidates)
    stopped, cut, spiked, leaver = rng.sample([c for c in candidates if c != killed], 4)
    step = 0
    faults = []
    for kind, (s, r), seconds in (
        ("kill", killed, 0.0),
        ("join", (killed[0], replicas), 0.0),
        ("stop", stopped, stop_s),
        ("cut", cut, cut_s),
        ("spike", spiked, spike_s),
        ("leave", leaver, 0.0),
    ):
        step += gap_rounds * inner_steps + rng.randint(0, 2)
        faults.append(Fault(kind, s, r, step, seconds, spike_ms if kind == "spike" else 0.0))
    return faults


@dataclass
class Window:
    """The reference's inner steps `first` .. `first + steps` took `seconds` (event times)."""

    after: str  # "healthy", or the fault it followed
    first: int
    steps: int
    seconds: float

    @property
    def pace(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class Record:
    """What a played schedule did: when each fault started and ended (time.time()), the windows,
    and the peers it killed, started and made leave."""

    faults: list[Fault]
    started: dict[str, float] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)
    healed: dict[str, float] = field(default_factory=dict)
    windows: list[Window] = field(default_factory=list)
    killed: list[PeerProcess] = field(default_factory=list)
    joiners: list[PeerProcess] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "faults": [asdict(f) for f in self.faults],
            "started": self.started,
            "ended": self.ended,
            "healed": self.healed,
            "windows": [asdict(w) | {"pace": w.pace} for w in self.windows],
        }


class Chaos:
    """Plays `faults` (from `schedule`) on `ns`; `window_steps` reference steps per pace window;
    `phase_timeout`: the longest any one wait (a fault's step, healing, a window) may take."""

    def __init__(
        self,
        ns: NamespaceSwarm,
        faults: Sequence[Fault],
        *,
        inner_steps: int,
        window_steps: int,
        reference: tuple[int, int] = (1, 0),
        phase_timeout: float = 300.0,
    ) -> None:
        self.ns, self.swarm = ns, ns.swarm
        self.H, self.window_steps, self.phase_timeout = inner_steps, window_steps, phase_timeout
        self.record = Record(list(faults))
        self.ref = next(p for p in self.swarm.peers if (p.stage, p.replica) == reference)

    def play(self) -> Record:
        self._until(lambda: self._step() >= self.H, "the reference's first round")
        self._window("healthy")
        for fault in self.record.faults:
            self._until(
                lambda f=fault: self._step() >= f.at_step, f"step {fault.at_step} for the {fault.kind}"
            )
            self.record.started[fault.kind] = time.time()
            self._apply(fault)
            self.record.ended[fault.kind] = time.time()
            since = self._step() // self.H + 2
            self._until(
                lambda r=since: self.healed(r), f"the swarm to heal after the {fault.kind} of {fault.host}"
            )
            self.record.healed[fault.kind] = time.time()
            self._window(fault.kind)
        return self.record

    def _apply(self, fault: Fault) -> None:
        victim = self._peer(fault.stage, fault.replica) if fault.kind != "join" else None
        match fault.kind:
            case "kill":
                os.kill(victim.proc.pid, signal.SIGKILL)
                self.record.killed.append(victim)
            case "join":
                self.record.joiners.append(self.swarm.start_peer(fault.stage))
                self._until(
                    lambda: any(of_kind(self.record.joiners[-1].events(), Membership)), "the joiner's view"
                )
            case "stop":
                os.killpg(victim.proc.pid, signal.SIGSTOP)  # the peer and its daemon: a laptop asleep
                try:
                    time.sleep(fault.seconds)
                finally:
                    os.killpg(victim.proc.pid, signal.SIGCONT)
            case "cut":
                self.ns.bed.cut(fault.host)
                try:
                    time.sleep(fault.seconds)
                finally:
                    self.ns.bed.restore(fault.host)
            case "spike":
                normal = self.ns.relay.lags[self.ns.relayed.index(fault.host)].forward_s * 1000
                self.ns.set_delay(fault.host, fault.delay_ms)
                try:
                    time.sleep(fault.seconds)
                finally:
                    self.ns.set_delay(fault.host, normal)
            case "leave":
                os.kill(victim.proc.pid, signal.SIGTERM)
                self._until(lambda: victim.proc.poll() is not None, "the leaver's exit")
                if victim.proc.returncode != 0 or not of_kind(victim.events(), Left):
                    raise RuntimeError(f"the leaver exited {victim.proc.returncode}:\n{victim.log_tail()}")
            case _:
                raise ValueError(f"unknown fault {fault.kind!r}; the kinds are {', '.join(KINDS)}")

    def healed(self, since: int = 0) -> bool:
        """Every running peer holds the same view of the latest round they all reached, which is
        `since` or later; it holds exactly the running peers, and each of them has taken a step of it."""
        live = [p for p in self.swarm.peers if p.proc.poll() is None]
        rounds: list[dict[int, Membership]] = []
        steps: list[int] = []
        for p in live:
            events = p.events()
            views = {m.round: m for m in of_kind(events, Membership)}  # the last one of each round
            if not views:
                return False
            rounds.append(views)
            steps.append(max((e.step for e in of_kind(events, Step)), default=0))
        latest = min(max(v) for v in rounds)
        if latest < since:
            return False
        held = {tuple(tuple(s) for s in v[latest].stages) for v in rounds if latest in v}
        if len(held) != 1 or any(latest not in v for v in rounds):
            return False
        members = {peer for stage in next(iter(held)) for peer in stage}
        ids = {v[max(v)].peer_id for v in rounds}
        return members == ids and min(steps) > latest * self.H

    def _window(self, after: str) -> None:
        first = self._step()
        self._until(lambda: self._step() >= first + self.window_steps, f"the pace window after {after}")
        times = {e.step: e.time for e in of_kind(self.ref.events(), Step)}
        last = first + self.window_steps
        self.record.windows.append(Window(after, first, self.window_steps, times[last] - times[first]))

    def _step(self) -> int:
        return max((e.step for e in of_kind(self.ref.events(), Step)), default=0)

    def _peer(self, stage: int, replica: int) -> PeerProcess:
        return next(p for p in self.swarm.peers if (p.stage, p.replica) == (stage, replica))

    def _until(self, check: Callable[[], bool], what: str) -> None:
        """Poll `check`; fail at once with the logs if a peer we did not kill failed or the run
        ended, or after `phase_timeout` seconds."""
        deadline = time.monotonic() + self.phase_timeout
        while not check():
            bad = [
                p for p in self.swarm.peers if p.proc.poll() not in (None, 0) and p not in self.record.killed
            ]
            ended = self.ref.proc.poll() is not None  # the reference ran all its steps
            if bad or ended or time.monotonic() > deadline:
                tails = "\n".join(f"--- {p.log.name}\n{p.log_tail(12)}" for p in self.swarm.peers)
                why = "timed out"
                if bad:
                    why = f"{bad[0].log.name} exited {bad[0].proc.returncode}"
                elif ended:
                    why = "the run ended first (give it more steps)"
                raise RuntimeError(f"chaos: {why} waiting for {what}\n{tails}")
            time.sleep(0.2)


def trained_samples(peer_events: Sequence[list[Event]], batch: int, since: float, until: float) -> int:
    """Samples whose gradient came back to stage 0 in [since, until): every stage-0 step feeds
    `batch` rows of its own, plus the rows it stood in for and carried, less the rows it did not
    send (their receiver had passed them) and those whose gradient never came back. Give the
    events of every stage-0 peer."""
    total = 0
    for events in peer_events:
        inside = [e for e in events if since <= e.time < until]
        total += batch * len(of_kind(inside, Step))
        total += sum(e.samples for e in of_kind(inside, StoodIn)) + sum(
            e.samples for e in of_kind(inside, Carried)
        )
        total -= sum(e.samples for e in of_kind(inside, Unsent))
        total -= sum(e.samples for e in of_kind(inside, Dropped) if e.side == "sender")
    return total


def views_since(
    peer_events: Iterable[list[Event]], since: float = float("-inf")
) -> dict[int, set[tuple[tuple[str, ...], ...]]]:
    """Every distinct view of each round that a peer built after `since` (time.time(); by default
    every view they reported)."""
    views: dict[int, set[tuple[tuple[str, ...], ...]]] = {}
    for events in peer_events:
        for m in of_kind(events, Membership):
            if m.time > since:
                views.setdefault(m.round, set()).add(tuple(tuple(s) for s in m.stages))
    return views


def splits(views: dict[int, set[tuple[tuple[str, ...], ...]]]) -> str:
    """The rounds of `views` (views_since) that peers saw differently, each view as its stages of
    short peer ids, for a failed test to say where the swarm split ('' when it never did)."""
    lines = []
    for round_, seen in sorted(views.items()):
        if len(seen) > 1:
            shown = sorted(" | ".join(",".join(p[-6:] for p in stage) for stage in view) for view in seen)
            lines.append(f"round {round_}: " + "  vs  ".join(shown))
    return "\n".join(lines)
