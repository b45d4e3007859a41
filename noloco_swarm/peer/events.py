"""Typed metric events of a peer, and the sinks they go to (JSON lines here; Prometheus: metrics.py).

A peer reports what it did as frozen records (`Step`, `Outer`, `Membership`, ...) through one
`Events` object, which hands each record to every sink. `JsonLines` writes one JSON object per
line, `{"event": KIND, "time": unix seconds, **fields}`; `read` turns such a file back into the
same records, so the live view, `noloco local`'s summary, the benchmarks and the tests all read
typed records and no one parses free-form dicts by string.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

KINDS: dict[str, type[Event]] = {}  # kind -> record class; each subclass registers itself


@dataclass(frozen=True)
class Event:
    """Base of every event: its kind (the JSON `event` field) and when it happened."""

    KIND: ClassVar[str] = ""
    time: float = field(default=0.0, kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.KIND in KINDS or not cls.KIND:
            raise TypeError(f"event class {cls.__name__} needs a KIND of its own, not {cls.KIND!r}")
        KINDS[cls.KIND] = cls

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "time"}


@dataclass(frozen=True)
class Step(Event):
    """One inner step done. Every replica serves B samples of T tokens per step, whatever its stage."""

    KIND: ClassVar[str] = "step"
    step: int  # inner steps taken, this one included
    loss: float | None  # mean loss of the samples whose loss came back (None: none did)
    lr: float
    seconds: float
    tokens: int  # tokens fed into the pipeline so far (stage 0; 0 on later stages)
    tokens_per_second: float


@dataclass(frozen=True)
class Outer(Event):
    """One outer step: the group, who failed, the bytes moved and the resulting state. `step` is
    the boundary (the group's draw, the tensors exchanged); `seconds` is the exchange's duration
    from there; `waited`, how long training stood still for it (all of it without overlap; with
    `outer.overlap_steps` = k, the part still in flight after inner step step + k)."""

    KIND: ClassVar[str] = "outer"
    step: int
    group: list[int]  # ranks that averaged, this replica included
    partners: list[str]  # their peer ids, this replica excluded
    failed: list[int]  # ranks whose tensors never arrived
    sent_bytes: int
    received_bytes: int
    seconds: float
    state_hash: str  # comparable with the simulator's
    applied_at: int = 0  # the inner step after which it was applied: step, or step + k with overlap
    waited: float = 0.0
    # NoLoCo: RMS distance (per weight) of this replica's fast weights to its group's mean, before
    # the step: how far the replicas drifted apart; None for other methods
    spread: float | None = None
    pace: float = 0.0  # bytes/s our tensors went out at (exchange_pacing, exchange_max_mbit); 0: unpaced
    # bytes/s our link carried our last measured exchange at, as partners timed it (peer/net/uplink.py);
    # 0: not measured yet. The next exchanges are capped at 97% of it unless peer.exchange_max_mbit is set.
    uplink: float = 0.0


@dataclass(frozen=True)
class Started(Event):
    """The peer runs: its id, its stage (the chosen one, for --stage auto) and the addresses it
    announces to other peers."""

    KIND: ClassVar[str] = "started"
    peer_id: str
    stage: int
    addresses: list[str]


@dataclass(frozen=True)
class Membership(Event):
    """The frozen view of a round, as this peer holds it."""

    KIND: ClassVar[str] = "membership"
    round: int
    stages: list[list[str]]
    rank: int
    peer_id: str


@dataclass(frozen=True)
class Joining(Event):
    """This peer announced itself for `round`, which starts at `step`. `through`: the member whose
    answer named the peers it joins with (peer/neighbourhood.py), or "directory" (it read all)."""

    KIND: ClassVar[str] = "joining"
    round: int
    step: int
    through: str = ""


@dataclass(frozen=True)
class JoinPostponed(Event):
    """Our download would outlast the round we announced (`round`): we announced `to` instead
    (peer/postpone.py), projecting the download to end `download_seconds` from now and the swarm
    to reach `round` in `swarm_seconds`."""

    KIND: ClassVar[str] = "join_postponed"
    round: int
    to: int
    download_seconds: float
    swarm_seconds: float


@dataclass(frozen=True)
class Joined(Event):
    """This peer loaded its stage's state for `round`, which starts at inner step `step`:
    `server`'s snapshot of step `from_step` (the boundary before `round`, or `round`'s own when
    the server read our announcement only there), whose chunks came from the donors in `sent`
    (donor -> chunks)."""

    KIND: ClassVar[str] = "joined"
    round: int
    step: int
    server: str
    state_hash: str
    peer_id: str
    snapshot: str = ""  # the manifest's digest of the whole state (weights, momenta, counters)
    sent: dict[str, int] = field(default_factory=dict)
    from_step: int = -1


@dataclass(frozen=True)
class Joiners(Event):
    """Peers that enter this peer's stage at `round`; this peer keeps its state for them."""

    KIND: ClassVar[str] = "joiners"
    round: int
    peers: list[str]
    snapshot: str = ""  # the digest of the state kept for them (StateManifest.snapshot)


@dataclass(frozen=True)
class ServedState(Event):
    """One chunk of this replica's state sent to a joiner."""

    KIND: ClassVar[str] = "served_state"
    round: int
    peer: str
    chunk: int


@dataclass(frozen=True)
class StateFetch(Event):
    """A joiner assembles `target`'s snapshot of `round` from chunks sent by `donors` (again,
    with another target, if the first one fails)."""

    KIND: ClassVar[str] = "state_fetch"
    round: int
    target: str
    donors: list[str]
    snapshot: str
    snapshot_round: int = -1  # the round of the boundary the snapshot was taken at


@dataclass(frozen=True)
class ChunkFetched(Event):
    """A joiner received and checked chunk `index` (of state part `part`; `of` in all) from `donor`."""

    KIND: ClassVar[str] = "chunk_fetched"
    round: int
    donor: str
    index: int
    part: str
    of: int = 0


@dataclass(frozen=True)
class DonorLost(Event):
    """A joiner dropped a donor mid-download (dead, refused, or sent a chunk that did not match)."""

    KIND: ClassVar[str] = "donor_lost"
    round: int
    donor: str
    reason: str


@dataclass(frozen=True)
class Excluded(Event):
    """The swarm's next view leaves this live peer out; it joins again."""

    KIND: ClassVar[str] = "excluded"
    step: int
    reason: str


@dataclass(frozen=True)
class Rerouted(Event):
    """Rows of step `step` this replica sent on hop `hop` to the stand-in of a next-stage replica
    it routes around (gone: protocol.plan, StepPlan.around) instead of dropping them."""

    KIND: ClassVar[str] = "rerouted"
    step: int
    hop: int
    samples: int
    around: list[int]  # the ranks of stage hop + 1 routed around
    to: list[int]  # the stand-ins that got their rows


@dataclass(frozen=True)
class StoodIn(Event):
    """Stage 0 fed `samples` rows of step `step` from the shards of gone stage-0 replicas it
    stands in for (`replicas`: their ranks), besides its own (protocol.plan, StepPlan.around)."""

    KIND: ClassVar[str] = "stood_in"
    step: int
    samples: int
    replicas: list[int]


@dataclass(frozen=True)
class Carried(Event):
    """Stage 0 fed `samples` rows of step `step` - 1 again at step `step`, with its own: their
    gradient had not come back (a replica on their route died, or refused them)."""

    KIND: ClassVar[str] = "carried"
    step: int
    samples: int
    sample_ids: list[int] = field(default_factory=list)
    """Their sample indices (routing.sample_index of the step they were first fed at)."""


@dataclass(frozen=True)
class Unsent(Event):
    """What this peer did not send `peer` for step `step`, which it had passed or was done
    collecting rows of (it was at step `at`) and would have refused as late: `samples` rows of a
    forward, or (`call` "exchange") our weights for the outer step after inner step `step`. Such
    a peer fell behind: a stall, a cut link."""

    KIND: ClassVar[str] = "unsent"
    step: int
    peer: str
    at: int
    samples: int = 0
    call: str = "forward"


@dataclass(frozen=True)
class Dropped(Event):
    """Samples of step `step` lost on hop `hop` (their gradient is zero this step).

    side "sender": rows this replica sent whose gradient never came back (`reasons`: why, per
    receiver that failed; `sample_ids`: their sample indices, a carried row's from the step it was
    first fed at, so a row lost twice shows as one sample); side "receiver": rows this replica
    expected from `senders`, who sent nothing in time, and that no stand-in of theirs brought
    either (said once the step's rows are collected).
    """

    KIND: ClassVar[str] = "dropped"
    step: int
    hop: int
    samples: int
    side: str
    senders: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    sample_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Refused(Event):
    """A live peer refused our rows of step `step` (e.g. it holds another view)."""

    KIND: ClassVar[str] = "refused"
    step: int
    peer: str
    reason: str


@dataclass(frozen=True)
class Rejected(Event):
    """A partner's outer-step tensor (theta, phi or shard) of the outer step after inner step
    `step` failed a plausibility check (protocol/plausible.py) and was left out of the step.

    `reason`: nonfinite, shape, dtype or distance; `ratio`: for distance, ||received - phi|| over
    our own ||theta - phi|| (None otherwise); `avoid_until`: the last outer step (its boundary)
    at which the peer is avoided as a partner (`outer.avoid_rounds`; equal to `step`: not at all).
    """

    KIND: ClassVar[str] = "rejected"
    step: int
    peer: str
    reason: str
    ratio: float | None = None
    avoid_until: int = 0
    detail: str = ""


@dataclass(frozen=True)
class Declined(Event):
    """A partner avoids us at the outer step after inner step `step` (it rejected our weights
    lately: its `rejected` event) and said so, at once: we stepped without it, without waiting."""

    KIND: ClassVar[str] = "declined"
    step: int
    peer: str


@dataclass(frozen=True)
class Retried(Event):
    """A forward or outer exchange call whose stream broke was made again (the peer still answers)."""

    KIND: ClassVar[str] = "retried"
    step: int
    peer: str
    reason: str
    call: str = "forward"  # or "exchange" (the outer step after inner step `step`)


@dataclass(frozen=True)
class ViewMismatch(Event):
    """A forward request came under another view of its round; it was refused."""

    KIND: ClassVar[str] = "view_mismatch"
    step: int
    peer: str


@dataclass(frozen=True)
class SlowPeer(Event):
    """A peer failed us but answers a probe: slow, not gone."""

    KIND: ClassVar[str] = "slow_peer"
    peer: str
    reason: str


@dataclass(frozen=True)
class PeerGone(Event):
    """A peer failed us and does not answer; reported gone in the DHT."""

    KIND: ClassVar[str] = "peer_gone"
    peer: str
    round: int
    reason: str


@dataclass(frozen=True)
class FalseReport(Event):
    """`reporter` reported `peer` gone in `round`, but `peer` answered our probe: the report is
    void (`ignored_until`: the round until which the reporter's reports go unheard, if it keeps
    reporting live peers)."""

    KIND: ClassVar[str] = "false_report"
    reporter: str
    peer: str
    round: int
    ignored_until: int = 0


@dataclass(frozen=True)
class Left(Event):
    """This peer left the swarm at a boundary, as it had announced in `announced_round`."""

    KIND: ClassVar[str] = "left"
    step: int
    announced_round: int


@dataclass(frozen=True)
class Checkpointed(Event):
    """This replica wrote its full state at a round boundary."""

    KIND: ClassVar[str] = "checkpointed"
    step: int
    round: int
    path: str


@dataclass(frozen=True)
class Resumed(Event):
    """This replica came back from its checkpoint of `step` with the other members of its round."""

    KIND: ClassVar[str] = "resumed"
    step: int
    round: int
    state_hash: str


@dataclass(frozen=True)
class Final(Event):
    """The peer's summary when it finishes."""

    KIND: ClassVar[str] = "final"
    stage: int
    rank: int
    peer_id: str
    joined_round: int
    steps: int
    outer_steps: int
    dropped_partners: int
    dropped_samples: int
    gone: list[str]
    final_view: list[list[str]]
    train_seconds: float
    tokens: int
    val_loss: float | None
    state_hash: str
    bytes: dict[str, dict[str, int]]
    # this peer's DHT calls through its directory: stores, reads and their records' bytes
    dht: dict[str, int] = field(default_factory=dict)


E = TypeVar("E", bound=Event)


class Sink(Protocol):
    """Where events go: a JSON-lines file, a Prometheus registry, a test's list."""

    def emit(self, event: Event) -> None: ...

    def close(self) -> None: ...


class JsonLines:
    """One JSON object per line, appended and flushed per line (readers follow it live)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = self.path.open("a", buffering=1)

    def emit(self, event: Event) -> None:
        self._file.write(json.dumps(to_dict(event)) + "\n")

    def close(self) -> None:
        self._file.close()


class Events:
    """The peer's one event interface: stamps each record with the time and fans it out."""

    def __init__(self, sinks: Iterable[Sink] = ()) -> None:
        self.sinks = list(sinks)

    def emit(self, event: Event) -> None:
        stamped = dataclasses.replace(event, time=time.time())
        for sink in self.sinks:
            sink.emit(stamped)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def to_dict(event: Event) -> dict[str, Any]:
    return {"event": event.KIND, "time": event.time, **event.fields()}


def from_dict(obj: dict[str, Any]) -> Event:
    """The record a JSON line holds; ValueError if it is not one of ours."""
    if not isinstance(obj, dict):  # any JSON value parses, e.g. a stray `[...]` or number line
        raise ValueError(f"an event is a JSON object, not {type(obj).__name__}")
    kind = obj.get("event")
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in obj.items() if k in names})
    except TypeError as e:
        raise ValueError(f"malformed {cls.KIND} event: {e}") from e


def read(path: str | Path) -> list[Event]:
    """Every complete event in a JSON-lines file so far (a torn last line, mid-write, is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(from_dict(json.loads(line)))
        except (json.JSONDecodeError, ValueError):
            continue
    return out


def of_kind(events: Iterable[Event], kind: type[E]) -> list[E]:
    """The events of one type, in order."""
    return [e for e in events if isinstance(e, kind)]
