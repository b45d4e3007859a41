"""A discrete-event model of a swarm's membership: N peers, P stages, a modelled DHT, churn.

It runs our own rules, not a copy of them: every view is built by protocol.membership
(`next_view`, `credible_gone`, `Judgement`) and every joiner picks its round by
protocol.plan.join_round. What the model supplies is what a peer reads and when:

- **the DHT.** A record (an announcement, or a gone report) written at time s becomes readable
  at reader x at s + d, d drawn per (record, reader) from a lognormal (`Dht.delay_median`,
  `Dht.delay_sigma`: a heavy tail; an announcement is stored again by every heartbeat, and a
  reader has it from the first copy that arrives); a share `late` of (record, reader) pairs
  arrives `late_rounds` rounds later, every copy; a share `lost` of stores is lost: an announcement is stored again
  by the next heartbeat, a gone report is not (the peer files it once). A boundary read fails
  (twice in a row, as the peer retries once) with probability `read_fail`: the peer then reads
  nothing and keeps its members (peer/views.py).
- **partitions.** During one, a share of the peers neither reads what the others write nor
  reaches them by probes; stores made across it arrive once it heals.
- **churn.** Crashes, graceful leaves, SIGSTOP-like stalls and joiners at Poisson rates;
  stragglers read at their boundaries late.
- **what peers see of each other.** A crashed or stopped member is found by the members of
  the next and previous stage that route rows to it (each with the chance that one of its B x H
  rows of the round goes there) and by nobody else; each files a gone report in the round it
  finds it. Members missing from a read are probed (`suspects`), reported if they do not answer.
  Probes answer if the peer runs and no partition lies between.

Where the DHT holds records (`Scenario.directory`): "whole" is the peer before 6b5aa59 (one
key holds every announcement, one every gone report, and every member reads both whole at every
boundary); "spread" is the peer's layout (issue 36, item 4; peer/directory.py): a member's
heartbeats go to the key of its bucket (its place in its latest view over BUCKET_PEERS), a peer
without a view's to the run's roster, the reports of a peer to a key of that peer's; no member
reads a whole key: records reach members only as members pass them on (records="gossip"; at its
boundary a member also takes what it lacked from one adjacent-stage member), and a joiner reads
the roster and the buckets once per attempt. With `audits` (0 in the peer), each member also
checks that many members' own keys per round for an expired announcement (probed then, as a
member missing from a whole read is). Each key is held by the `replicas` live nodes first in a
fixed random order of its own (as the nodes nearest its hash).

Measured: for each round, whether every live member holds the same view; the longest split (the
most rounds in a row that one peer's view disagreed with the most common one about one member); stalls (member-rounds whose view differs from that of a member of
an adjacent stage: their requests are refused, they wait for deadlines); samples lost to those
refusals; DHT operations and bytes per peer and round and on the busiest DHT node; and the time
a newcomer takes to enter a view.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from noloco_swarm.protocol.membership import (
    BUCKET_PEERS,
    FIRST_WAVE,
    LEFT_BEHIND_ROUNDS,
    REPORT_LAG_ROUNDS,
    Judgement,
    Listing,
    MembershipView,
    Report,
    credible_gone,
    directory_bucket,
    entering,
    monitors,
    newest,
    reports_to_weigh,
)
from noloco_swarm.protocol.plan import join_round

KEY_OVERHEAD = 64  # bytes of a get or store request without its records
COPIES = 12  # heartbeat copies of an announcement the model draws delays for (two minutes' worth)


@dataclass(frozen=True)
class Dht:
    delay_median: float = 0.3  # seconds until a store is readable at a reader
    delay_sigma: float = 1.0  # lognormal shape: the tail
    late: float = 0.0  # share of (record, reader) pairs readable only `late_rounds` later
    late_rounds: float = 2.0
    lost: float = 0.0  # share of stores lost
    read_fail: float = 0.0  # share of boundary reads that fail twice
    replicas: int = 5  # nodes holding a key (hivemind's num_replicas)

    def describe(self) -> str:
        parts = [f"lognormal median {self.delay_median:g} s sigma {self.delay_sigma:g}"]
        if self.late:
            parts.append(f"{self.late:.0%} {self.late_rounds:g} rounds late")
        if self.lost:
            parts.append(f"{self.lost:.0%} lost")
        if self.read_fail:
            parts.append(f"{self.read_fail:.0%} reads fail")
        return ", ".join(parts)


@dataclass(frozen=True)
class Churn:
    crashes_per_hour: float = 0.0  # per peer
    leaves_per_hour: float = 0.0  # per peer
    stalls_per_hour: float = 0.0  # per peer
    stall_seconds: float = 90.0
    joins_per_hour: float = 0.0  # newcomers, per swarm peer
    stragglers: float = 0.0  # share of peers that reach each boundary up to `straggle_seconds` late
    straggle_seconds: float = 10.0

    @property
    def per_hour(self) -> float:
        return self.crashes_per_hour + self.leaves_per_hour + self.stalls_per_hour + self.joins_per_hour


@dataclass(frozen=True)
class Partition:
    start: float  # seconds
    seconds: float
    share: float  # of the peers, cut off from the rest


SPREADS = ("dht", "swap", "gossip")  # Scenario.records
DIRECTORIES = ("whole", "spread")  # Scenario.directory
JOINS = ("whole", "member")  # Scenario.join
REPORTERS = ("all", "monitors")  # Scenario.reporters
# join="member", as peer/neighbourhood.py: peers a joiner asks for their neighbourhood (ASKED),
# and members of its stage, and as many of the stages next to it, it hands its announcement to
# (SAMPLED).
ASKED_MEMBERS = 4
HANDOVER_PEERS = 8
JUDGED_SETS = 16  # distinct report sets whose judgement the simulator remembers


@dataclass(frozen=True)
class Scenario:
    peers: int
    stages: int = 4
    rounds: int = 30
    round_seconds: float = 60.0  # H steps
    inner_steps: int = 50
    batch: int = 8
    heartbeat_seconds: float = 10.0  # heartbeat_ttl / 3
    ttl: float = 30.0
    probe_seconds: float = 12.0  # a frozen or cut-off peer costs a prober about this long
    state_seconds: float = 20.0  # a joiner's state download
    # Bytes of one record as the DHT holds it (subkey with its RSA owner mark, value, signature):
    # bench/membership_scale.py measures real signed records (1,116 and 1,005 on 2026-12-06).
    announcement_bytes: int = 1116
    report_bytes: int = 1005
    # join="member": bytes per peer id in a member's answer (its view), and per peer it names with
    # its addresses (bench/membership_scale.py measures them from a real rpc.Neighbourhood).
    view_id_bytes: int = 48
    contact_bytes: int = 207
    dht: Dht = Dht()
    churn: Churn = Churn()
    partitions: tuple[Partition, ...] = ()
    # Scripted faults besides the churn rates: (seconds, "crash" | "leave" | "stall" | "join", peer
    # index; ignored for a join, which starts a new peer).
    faults: tuple[tuple[float, str, int], ...] = ()
    seed: int = 0
    # How records spread besides the DHT (issue 36, item 2). "dht": nothing else (the peer before
    # 2026-12-06). "swap", a design the peer does not run: two members of adjacent stages whose
    # views of a round differ (their requests are refused) hand each other the records each has.
    # "gossip", as the peer does since (peer/passing.py): every member passes the records it has to
    # its adjacent-stage neighbours, so all that one member has reach every member it is connected
    # to by the middle of the round (Model._spread), and a joiner hands its announcement to the
    # peers it asks where they are (Model.rejoin). With either, a boundary read that fails takes
    # what a neighbour read (Model._ask_a_neighbour). The peer passes a record at once, and only
    # records their writer sealed (not what it read from the DHT): see docs/membership.md.
    records: str = "dht"
    handover_seconds: float = 2.0  # "gossip": a joiner's announcement handed to the peers it asks
    # Where the DHT holds records: "whole" (today) or "spread" (with records="gossip"; see above).
    directory: str = "whole"
    audits: int = 2  # "spread": members whose own key each member reads per round
    # How a joiner finds the swarm ("spread"): "whole" (the peer before 2026-12-07: it reads the
    # roster and every bucket, and hands its announcement to every peer it read) or "member", the
    # peer since (issue 36, item 4; peer/neighbourhood.py): it asks ASKED_MEMBERS members it knows
    # (its DHT node's routing table holds random members) for their neighbourhood (the view, and
    # the addresses of its stage and the stages next to it); unless one of them is of its stage,
    # it asks a member of its stage too, found in the answer of a member of a stage next to it or
    # else in one bucket of its stage's places (a DHT read); it hands its announcement to
    # HANDOVER_PEERS of its stage and as many of the stages next to it.
    join: str = "whole"
    # Who reports a member that failed it: "all" (the peer before 2026-12-07: every member that
    # found it) or "monitors", the peer since (protocol.membership.monitors: at most MONITORS
    # members of its stage and the stages next to it).
    reporters: str = "monitors"

    def __post_init__(self) -> None:
        if self.records not in SPREADS:
            raise ValueError(f"records={self.records!r}: one of {', '.join(SPREADS)}")
        if self.directory not in DIRECTORIES:
            raise ValueError(f"directory={self.directory!r}: one of {', '.join(DIRECTORIES)}")
        if self.join not in JOINS:
            raise ValueError(f"join={self.join!r}: one of {', '.join(JOINS)}")
        if self.reporters not in REPORTERS:
            raise ValueError(f"reporters={self.reporters!r}: one of {', '.join(REPORTERS)}")
        if self.join == "member" and self.directory != "spread":
            raise ValueError("join='member' reads buckets: directory must be 'spread'")
        if self.directory == "spread" and self.records != "gossip":
            raise ValueError("a spread directory has no whole read: records must pass by gossip")


@dataclass
class Record:
    """One stored version of a record, and when each reader can read it."""

    at: float
    readable: np.ndarray  # per reader index: the time it becomes readable (inf: never)
    # directory "spread": when each reader could read it from the DHT, by reading its key (an
    # audit, a reporter's look); `readable` is then only how it reached members by gossip
    fetched: np.ndarray | None = None


@dataclass
class Peer:
    index: int
    name: str
    stage: int
    joined_round: int
    started: float
    # (record, stage, joined round, entered it): a joiner announces again once it has entered
    announced: list[tuple[Record, int, int, bool]] = field(default_factory=list)
    views: dict[int, MembershipView] = field(default_factory=dict)
    judgement: Judgement = field(default_factory=Judgement)
    dead: dict[str, int] = field(default_factory=dict)  # peers it found gone -> round
    crashed_at: float = math.inf
    left_at: float = math.inf
    stopped: tuple[float, float] = (math.inf, math.inf)
    joining_at: float | None = None  # the round-J boundary time it waits for, while it joins
    entered: list[float] = field(default_factory=list)  # join seconds, one per (re)join

    def runs(self, t: float) -> bool:
        return t < self.crashed_at and t < self.left_at and not self.stopped[0] <= t < self.stopped[1]

    def round(self) -> int:
        return max(self.views) if self.views else -1


class Model:
    """One run of a Scenario."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.rng = np.random.default_rng(sc.seed)
        churn = sc.churn
        hours = sc.rounds * sc.round_seconds / 3600
        self.scripted_joins = sum(kind == "join" for _, kind, _ in sc.faults)
        self.joins = self.rng.poisson(churn.joins_per_hour * sc.peers * hours) + self.scripted_joins
        self.capacity = sc.peers + self.joins
        self.peers: list[Peer] = []
        self.reports: list[tuple[Record, str, str, int]] = []  # (record, peer, reporter, round)
        self.ops = Counter()  # peer name -> DHT operations
        self.bytes = Counter()  # peer name -> DHT bytes sent and received
        self.node_bytes = Counter()  # DHT node (peer name) -> bytes served and stored
        self.report_keys: set[tuple[str, str, int]] = set()
        self.judged: dict[frozenset, dict[str, set[int]]] = {}
        # Scenario.reporters "monitors": view id -> (the view, peer -> its monitors), one dict per
        # set of stages (`watched`)
        self.watchers: dict[int, tuple[MembershipView, dict[str, frozenset[str]]]] = {}
        self.watched: dict[tuple, dict[str, frozenset[str]]] = {}
        self.holders: list[str] = []  # this round's holders of the run's keys
        self.sides = [
            np.array([self._side(i, x) for x in range(self.capacity)]) for i in range(len(sc.partitions))
        ]
        self.splits: list[bool] = []
        # (peer, member) -> rounds in a row that peer's view disagreed with the most common one
        # about that member (holding it where the others do not, or the reverse)
        self.apart: Counter = Counter()
        self.longest = 0
        self.stalls = 0
        self.samples_lost = 0
        self.member_rounds = 0
        self.passing_pairs = 0  # member pairs that passed records in a round (Scenario.records)
        self.passed_bytes = 0  # and the bytes they sent each other: peer to peer, not DHT traffic
        self.by_index: dict[int, Peer] = {}
        # join="member": its own draws, so that the churn and delays match join="whole"'s draw for draw
        self.join_rng = np.random.default_rng([sc.seed, 0x701E])
        if sc.directory == "spread":  # each key's nodes, first live ones first (its hash's nearest)
            orders = np.random.default_rng([sc.seed, 0x5EED])
            self.key_order = {
                kind: orders.random((self.capacity, self.capacity)).argsort(axis=1)
                for kind in ("peer", "gone", "bucket", "roster")
            }

    # ------------------------------------------------------------------ the DHT

    def _cut(self, a: int, b: int, t: float) -> bool:
        """Does a partition lie between peers a and b at time t?"""
        return any(
            p.start <= t < p.start + p.seconds and self.sides[i][a] != self.sides[i][b]
            for i, p in enumerate(self.sc.partitions)
        )

    def _side(self, partition: int, index: int) -> bool:
        share = self.sc.partitions[partition].share
        digest = hashlib.sha256(f"{self.sc.seed}/{partition}/{index}".encode()).digest()
        return int.from_bytes(digest[:4], "big") / 2**32 < share

    def store(self, writer: Peer, t: float, nbytes: int, *, repeat: bool, key: tuple[str, int]) -> Record:
        """A store by `writer` at t under `key` (its kind, and the peer it is of); a lost one is
        stored again at the next heartbeat if `repeat`."""
        dht, sc = self.sc.dht, self.sc
        if sc.directory == "spread":
            for holder in self._key_holders(key, t):
                self.node_bytes[holder] += nbytes
        self.ops[writer.name] += 1
        self.bytes[writer.name] += (nbytes + KEY_OVERHEAD) * dht.replicas
        at = t
        while self.rng.random() < dht.lost:
            if not repeat:
                return Record(t, np.full(self.capacity, math.inf))
            at += sc.heartbeat_seconds
        # A heartbeat stores an announcement again every heartbeat_seconds: a reader has it from
        # the first copy that reaches it (COPIES of them drawn); a report is stored once.
        copies = COPIES if repeat else 1
        draws = self.rng.lognormal(math.log(dht.delay_median), dht.delay_sigma, (copies, self.capacity))
        delay = (draws + sc.heartbeat_seconds * np.arange(copies)[:, None]).min(axis=0)
        late = self.rng.random(self.capacity) < dht.late  # this reader gets every copy late
        readable = at + delay + late * dht.late_rounds * sc.round_seconds
        for i, p in enumerate(sc.partitions):
            if p.start <= at < p.start + p.seconds:
                across = self.sides[i] != self.sides[i][writer.index]
                readable = np.where(across, np.maximum(readable, p.start + p.seconds + delay), readable)
        readable[writer.index] = at
        if sc.directory == "spread":  # nobody reads a whole key: members have it once it is passed on
            only = np.full(self.capacity, math.inf)
            only[writer.index] = at
            return Record(at, only, fetched=readable)
        return Record(at, readable)

    def _key_holders(self, key: tuple[str, int], t: float) -> list[str]:
        """The live nodes holding `key` at t ("spread")."""
        out = []
        for i in self.key_order[key[0]][key[1]]:
            node = self.by_index.get(int(i))
            if node is not None and node.runs(t):
                out.append(node.name)
                if len(out) == self.sc.dht.replicas:
                    break
        return out

    def announce(self, peer: Peer, t: float, entered: bool = False) -> None:
        record = self.store(peer, t, self.sc.announcement_bytes, repeat=True, key=self._place(peer))
        peer.announced.append((record, peer.stage, peer.joined_round, entered))

    def _place(self, peer: Peer) -> tuple[str, int]:
        """The key `peer`'s heartbeat goes to ("spread", as the peer: peer/directory.py): its
        bucket in its latest view, or the roster while it has none."""
        bucket = directory_bucket(peer.views.get(peer.round()), peer.name)
        return ("roster", 0) if bucket is None else ("bucket", bucket)

    def _whole_read(self, reader: Peer, t: float) -> None:
        """A joiner reads the whole directory ("spread", as the peer's directory.read_peers): the
        roster and the buckets in waves, two more after the last that holds a record. Counts its
        operations and bytes, and the load on each key's holders."""
        sc = self.sc
        live = [p for p in self.peers if p.runs(t)]
        joining = sum(p.joining_at is not None for p in live)
        buckets = math.ceil((len(live) - joining) / BUCKET_PEERS)
        read, size = 0, FIRST_WAVE
        while True:  # a wave whose last two buckets are empty ends the read
            read += size
            if read >= buckets + 2:
                break
            size *= 2
        keys = 1 + read  # and the roster
        self.ops[reader.name] += keys
        self.bytes[reader.name] += keys * KEY_OVERHEAD + len(live) * sc.announcement_bytes * sc.dht.replicas
        for holder in self._key_holders(("roster", 0), t):
            self.node_bytes[holder] += joining * sc.announcement_bytes
        for b in range(buckets):
            held = min(BUCKET_PEERS, len(live) - joining - b * BUCKET_PEERS)
            for holder in self._key_holders(("bucket", b), t):
                self.node_bytes[holder] += held * sc.announcement_bytes

    def _member_read(self, reader: Peer, t: float, reachable: list[Peer]) -> list[Peer]:
        """join="member": `reader` asks ASKED_MEMBERS random members it reaches for their
        neighbourhood; unless one is of its stage it asks a member of its stage too, found in the
        answer of one of a stage next to it, or else by reading one random bucket of its stage's
        places. The members it then hands its announcement to. Counts the DHT read, its key's
        load, and the bytes of the answers (peer to peer)."""
        sc = self.sc
        members = [q for q in reachable if q.joining_at is None and q.views]
        if not members:
            return []
        picks = self.join_rng.choice(len(members), size=min(ASKED_MEMBERS, len(members)), replace=False)
        asked = [members[int(i)] for i in picks]
        first = next((q for q in asked if q.stage == reader.stage), asked[0])
        view = first.views[first.round()]
        counts = [len(s) for s in view.stages]
        near_stages = [
            s for s in (reader.stage - 1, reader.stage, reader.stage + 1) if 0 <= s < view.num_stages
        ]
        near = {p for s in near_stages for p in view.stages[s]}
        answer = sum(counts) * sc.view_id_bytes + len(near) * sc.contact_bytes
        answers = len(asked)
        if all(q.stage != reader.stage for q in asked):
            answers += 1  # a member of its stage, asked too
            if all(abs(q.stage - reader.stage) > 1 for q in asked):  # none named one: read a bucket
                before = sum(counts[: reader.stage])
                lo = before // BUCKET_PEERS
                hi = max(before, before + counts[reader.stage] - 1) // BUCKET_PEERS
                bucket = int(self.join_rng.integers(lo, hi + 1))
                held = max(0, min(BUCKET_PEERS, sum(counts) - bucket * BUCKET_PEERS))
                self.ops[reader.name] += 1
                self.bytes[reader.name] += KEY_OVERHEAD + held * sc.announcement_bytes * sc.dht.replicas
                for holder in self._key_holders(("bucket", bucket), t):
                    self.node_bytes[holder] += held * sc.announcement_bytes
        self.passed_bytes += answers * answer
        around = [q for q in members if q.name in near]
        handed = []
        for own in (True, False):
            pool = [q for q in around if (q.stage == reader.stage) == own]
            picked = self.join_rng.choice(len(pool), size=min(HANDOVER_PEERS, len(pool)), replace=False)
            handed += [pool[int(i)] for i in picked]
        return handed

    def report(self, reporter: Peer, peer: str, round_: int, t: float) -> None:
        if (peer, reporter.name, round_) in self.report_keys:
            return
        self.report_keys.add((peer, reporter.name, round_))
        key = ("gone", int(peer[1:]))
        record = self.store(reporter, t, self.sc.report_bytes, repeat=False, key=key)
        self.reports.append((record, peer, reporter.name, round_))
        if self.sc.records == "gossip":
            self._pass_on(record, reporter, t)

    def _pass_on(self, record: Record, writer: Peer, t: float) -> None:
        """A record its writer passes at once, and each member that lacked it passes on at once
        (peer/passing.py): every member connected to the writer has it within one hop per stage.
        (Model._spread, once a round, is too coarse for a record written just before a
        partition: it reached one side only, and split the view of the next round.)"""
        sc = self.sc
        reached = np.array(
            [q.index for q in self.peers if q.views and q.joining_at is None and self.reaches(writer, q, t)],
            dtype=int,
        )
        if len(reached):
            hops = t + sc.handover_seconds * sc.stages
            self.passed_bytes += sc.report_bytes * int((record.readable[reached] > hops).sum())
            record.readable[reached] = np.minimum(record.readable[reached], hops)

    def read(self, reader: Peer, t: float) -> tuple[list[Listing], list[Report]] | None:
        """What `reader` reads at t: the live announcements and every gone report; None if the
        read fails. Counts its operations and bytes, and the key holders' load."""
        sc = self.sc
        if sc.directory == "spread":  # no DHT read: what members passed it, and one neighbour's
            return self._pull(reader, t)
        if self.rng.random() < sc.dht.read_fail:
            return self._ask_a_neighbour(reader, t) if sc.records != "dht" else None
        listings, reports = self._readable(reader, t)
        value = self._value(listings, reports)
        self.ops[reader.name] += 2
        self.bytes[reader.name] += 2 * KEY_OVERHEAD + value * sc.dht.replicas
        for holder in self.holders:
            self.node_bytes[holder] += value
        return listings, reports

    def _answering_neighbour(self, reader: Peer, t: float) -> Peer | None:
        """The first member of a stage next to `reader`'s (in its latest view) that answers it at
        t; None if it holds no view or none answers."""
        view = reader.views.get(reader.round())
        if view is None:
            return None
        near = {
            x
            for s in (reader.stage - 1, reader.stage + 1)
            if 0 <= s < view.num_stages
            for x in view.stages[s]
        }
        return next((p for p in self.peers if p.name in near and self.reaches(reader, p, t)), None)

    def _ask_a_neighbour(self, reader: Peer, t: float) -> tuple[list[Listing], list[Report]] | None:
        """A design the peer does not run (Scenario.records): a boundary read that fails
        takes what a member of an adjacent stage that answers read; None if none answers."""
        peer = self._answering_neighbour(reader, t)
        if peer is None:
            return None
        listings, reports = self._readable(peer, t)
        self.passed_bytes += self._value(listings, reports)
        return listings, reports

    def _pull(self, reader: Peer, t: float) -> tuple[list[Listing], list[Report]]:
        """In a spread directory: what `reader` holds, and what it lacked of what the first
        adjacent-stage member that answers holds (a member that was stopped or cut off at the
        round's passing gets it so). Counts an inventory of 16 bytes per record that changes a view
        (a founder's announcement does not) and each record it lacked."""
        listings, reports = self._readable(reader, t)
        peer = self._answering_neighbour(reader, t)
        if peer is None:
            return listings, reports
        theirs, their_reports = self._readable(peer, t)
        lacked = set(theirs) - set(listings)
        new_reports = set(their_reports) - set(reports)
        held = sum(x.joined_round > 0 for x in theirs) + len(their_reports)
        self.passed_bytes += 16 * held + self._value(list(lacked), list(new_reports))
        return newest([*listings, *lacked]), [*reports, *new_reports]

    def _value(self, listings: Sequence[Listing], reports: Sequence[Report]) -> int:
        """Bytes of the records a read returns."""
        return len(listings) * self.sc.announcement_bytes + len(reports) * self.sc.report_bytes

    def _readable(self, reader: Peer, t: float) -> tuple[list[Listing], list[Report]]:
        """The live announcements and every gone report readable at `reader` at t."""
        sc = self.sc
        listings = []
        for peer in self.peers:
            stopped = peer.stopped[0] if peer.stopped[0] <= t < peer.stopped[1] else math.inf
            last_heartbeat = min(t, peer.crashed_at, peer.left_at, stopped)
            if last_heartbeat < t - sc.ttl:
                continue  # expired
            seen = [(s, j, e) for record, s, j, e in peer.announced if record.readable[reader.index] <= t]
            if seen:
                listings.append(Listing(peer.name, *seen[-1]))
        reports = [(p, r, n) for record, p, r, n in self.reports if record.readable[reader.index] <= t]
        return listings, reports

    def _holders(self, t: float) -> list[str]:
        """The live peers whose DHT nodes hold the run's keys (the `replicas` nearest them)."""
        live = [p.name for p in self.peers if p.runs(t)]
        return sorted(live, key=lambda name: hashlib.sha256(f"key/{name}".encode()).digest())[
            : self.sc.dht.replicas
        ]

    # ------------------------------------------------------------------ peers

    def reaches(self, a: Peer, b: Peer, t: float) -> bool:
        """Does a's probe of b at t get an answer?"""
        return b.runs(t) and not self._cut(a.index, b.index, t)

    def member(self, peer: Peer, round_: int) -> bool:
        view = peer.views.get(round_)
        return view is not None and peer.name in view.members()

    def boundary(self, peer: Peer, t: float) -> None:
        """peer builds its view of the next round at t, by the peer's rule (peer/views.py)."""
        current = peer.views[peer.round()]
        read = self.read(peer, t)
        listings, reports = read if read is not None else ([], [])
        by_name = {p.name: p for p in self.peers}
        # members missing from the read (or, "spread", whose key an audit finds expired) are
        # probed; the dead are reported
        if self.sc.directory == "spread":
            missing = self._audit(peer, current, t)
        else:
            missing = current.members() - {item.peer for item in listings}
        for name in sorted(missing - set(peer.dead) - {peer.name}):
            if not self.reaches(peer, by_name[name], t):
                peer.dead[name] = current.round
                self.report(peer, name, current.round, t)
        seen = [(name, peer.name, r) for name, r in peer.dead.items()]
        joined = {item.peer: item.joined_round for item in listings}
        due = reports_to_weigh(current, reports, seen)
        doubtful = peer.judgement.doubtful(current, joined, due)
        answered = {n for n in doubtful - {peer.name} if self.reaches(peer, by_name[n], t)}
        answered |= {peer.name} & doubtful
        kept, _ = peer.judgement.settle(current, joined, due, answered, peer.name)
        for name in answered:
            peer.dead.pop(name, None)
        me = Listing(peer.name, peer.stage, peer.joined_round)
        view = peer.judgement.view_after(current, me, listings, kept, self._credible)
        for name in entering(current, view, listings):
            peer.dead.pop(name, None)
        if peer.name not in view.members() or not view.is_complete():
            self.rejoin(peer, t)
            return
        peer.views[view.round] = view
        for old in [r for r in peer.views if r < view.round - 2]:
            del peer.views[old]

    def _audit(self, peer: Peer, current: MembershipView, t: float) -> set[str]:
        """In a spread directory: `peer` reads `audits` members' own keys; the members whose
        announcement expired."""
        sc = self.sc
        others = sorted(current.members() - {peer.name})
        picked = self.rng.choice(len(others), size=min(sc.audits, len(others)), replace=False)
        expired = set()
        for name in (others[int(i)] for i in picked):
            q = self.by_index[int(name[1:])]
            self.ops[peer.name] += 1
            if self.rng.random() < sc.dht.read_fail:
                self.bytes[peer.name] += KEY_OVERHEAD
                continue
            stopped = q.stopped[0] if q.stopped[0] <= t < q.stopped[1] else math.inf
            live = min(t, q.crashed_at, q.left_at, stopped) >= t - sc.ttl and any(
                record.fetched is None or record.fetched[peer.index] <= t for record, *_ in q.announced
            )
            self.bytes[peer.name] += KEY_OVERHEAD + live * sc.announcement_bytes * sc.dht.replicas
            for holder in self._key_holders(("peer", q.index), t):
                self.node_bytes[holder] += live * sc.announcement_bytes
            if not live:
                expired.add(name)
        return expired

    def _credible(self, kept: Sequence[tuple[str, str, int]]) -> dict[str, set[int]]:
        """credible_gone, once per distinct set of reports (most peers hold one of a few: those of
        each side of a partition, of a late read). The last JUDGED_SETS sets are kept."""
        key = frozenset(kept)
        if key not in self.judged:
            if len(self.judged) >= JUDGED_SETS:
                del self.judged[next(iter(self.judged))]  # the oldest
            self.judged[key] = credible_gone(kept)
        return self.judged[key]

    def rejoin(self, peer: Peer, t: float) -> None:
        """peer (new, or out of the views) announces the round two after the swarm's furthest step."""
        sc = self.sc
        furthest = max((p.round() for p in self.peers if p.runs(t) and p.joining_at is None), default=0)
        target = join_round(furthest * sc.inner_steps, sc.inner_steps)
        peer.views.clear()  # its judgement stays, as in the peer (peer/views.py: Rounds.adopt)
        peer.dead.clear()
        peer.joined_round = target
        if peer.joining_at is None:  # a first attempt (a retry keeps counting from the first)
            peer.started = t
        peer.joining_at = target * sc.round_seconds
        reached = [q for q in self.peers if q is not peer and self.reaches(peer, q, t)]
        asked = reached
        if sc.join == "member":  # its neighbourhood, from one member of its stage
            asked = self._member_read(peer, t, reached)
        elif sc.directory == "spread":
            self._whole_read(peer, t)  # where the swarm is: whom to ask, and the donors of its stage
        self.announce(peer, t)
        if sc.records == "gossip":  # it hands its announcement to the live peers it asks where they are
            record = peer.announced[-1][0]
            handed = np.array([q.index for q in asked], dtype=int)
            record.readable[handed] = np.minimum(record.readable[handed], t + sc.handover_seconds)
            self.passed_bytes += sc.announcement_bytes * len(handed)
            if sc.join == "member" and len(handed):
                # Each member that gets a record it lacked passes it to the members of the stages
                # next to its own at once (peer/passing.py): every member it reaches has it within
                # one hop per stage. (Model._spread, once a round, is too coarse for a record
                # handed to a few members late in a round.)
                rest = np.array([q.index for q in reached if q.joining_at is None], dtype=int)
                hops = t + sc.handover_seconds * sc.stages
                record.readable[rest] = np.minimum(record.readable[rest], hops)

    def enter(self, peer: Peer, t: float) -> None:
        """At its round's boundary, a joiner adopts a donor's view of that round, if one admits it."""
        round_ = peer.joined_round
        donors = [
            p
            for p in self.peers
            if p is not peer and p.stage == peer.stage and p.runs(t) and p.joined_round < round_
            and self.member(p, round_) and peer.name in p.views[round_].members() and self.reaches(peer, p, t)
        ]  # fmt: skip
        if not donors:
            self.rejoin(peer, t)  # not admitted: try a later round
            return
        peer.views = {round_: donors[0].views[round_]}
        peer.judgement.adopt(peer.views[round_])
        self.announce(peer, t + self.sc.state_seconds, entered=True)  # once its state is in
        peer.joining_at = None
        peer.entered.append(t + self.sc.state_seconds - peer.started)

    # ------------------------------------------------------------------ the run

    def start(self) -> None:
        sc = self.sc
        for i in range(sc.peers):
            peer = Peer(i, f"p{i:04d}", i % sc.stages, 0, 0.0)
            self.peers.append(peer)
            self.by_index[i] = peer
            peer.announced.append((Record(0.0, np.zeros(self.capacity)), peer.stage, 0, True))
        founders = MembershipView.from_announcements(0, sc.stages, [(p.name, p.stage) for p in self.peers])
        for peer in self.peers:
            peer.views[0] = founders
        self._schedule()

    def _schedule(self) -> None:
        """Churn at Poisson times over the run (after round 0)."""
        sc, churn = self.sc, self.sc.churn
        end = sc.rounds * sc.round_seconds
        self.events: list[tuple[float, str, int]] = []
        for kind, rate in (
            ("crash", churn.crashes_per_hour),
            ("leave", churn.leaves_per_hour),
            ("stall", churn.stalls_per_hour),
        ):
            count = self.rng.poisson(rate * sc.peers * (end - sc.round_seconds) / 3600)
            for _ in range(count):
                self.events.append(
                    (float(self.rng.uniform(sc.round_seconds, end)), kind, int(self.rng.integers(sc.peers)))
                )
        for i, partition in enumerate(sc.partitions):
            self.events.append((partition.start, "cut", i))
        scripted = iter(range(sc.peers, sc.peers + self.scripted_joins))
        for t, kind, index in sc.faults:
            self.events.append((t, kind, next(scripted) if kind == "join" else index))
        for j in range(sc.peers + self.scripted_joins, sc.peers + self.joins):
            self.events.append((float(self.rng.uniform(sc.round_seconds, end)), "join", j))
        self.events.sort()

    def _churn(self, peer_index: int, kind: str, t: float) -> None:
        sc = self.sc
        if kind == "join":
            counts = Counter(p.stage for p in self.peers if p.runs(t))
            stage = min(range(sc.stages), key=lambda s: (counts[s], s))
            peer = Peer(peer_index, f"p{peer_index:04d}", stage, 0, t)
            self.peers.append(peer)
            self.by_index[peer_index] = peer
            self.rejoin(peer, t)
            return
        peer = self.peers[peer_index]
        if not peer.runs(t):
            return
        if kind == "leave":  # it reports itself and trains on until the views drop it
            if peer.views and peer.joining_at is None:
                self.report(peer, peer.name, peer.round(), t)
                peer.left_at = (peer.round() + REPORT_LAG_ROUNDS) * sc.round_seconds
            else:
                peer.left_at = t
            return
        if kind == "crash":
            peer.crashed_at = t
        else:
            peer.stopped = (t, t + sc.churn.stall_seconds)
        self._detect(peer, t)

    def _detect(self, gone: Peer, t: float) -> None:
        """Members of adjacent stages that route rows to `gone` find it and report it."""
        until = gone.stopped[1] if gone.stopped[0] <= t else math.inf  # a stall ends
        for peer in self.peers:
            if peer is not gone and peer.runs(t) and peer.views:
                self._find(peer, [gone], t, until)

    def _cut_off(self, index: int) -> None:
        """A partition starts: members find the adjacent-stage members across it gone, as they
        would a crashed one, if they find out before it heals."""
        partition, sides = self.sc.partitions[index], self.sides[index]
        end = partition.start + partition.seconds
        for peer in self.peers:
            if peer.runs(partition.start) and peer.views:
                across = [
                    q for q in self.peers if sides[q.index] != sides[peer.index] and q.runs(partition.start)
                ]
                self._find(peer, across, partition.start, end)

    def _find(self, peer: Peer, gone: list[Peer], t: float, until: float) -> None:
        """`peer` finds those of `gone` it routes rows to (adjacent stages, members of its view)
        in the round after t, and reports each it finds before `until` (and before it stops itself)."""
        sc = self.sc
        view = peer.views[peer.round()]
        for q in gone:
            if abs(peer.stage - q.stage) != 1 or q.name not in view.stages[q.stage]:
                continue
            if sc.reporters == "monitors" and peer.name not in self._monitors(view, q.name):
                continue  # it routes around q, and leaves reporting it to q's monitors
            n = len(view.stages[q.stage])
            if self.rng.random() < 1 - (1 - 1 / n) ** (sc.batch * sc.inner_steps):
                found = t + float(self.rng.uniform(0, sc.round_seconds)) + sc.probe_seconds
                if found < until and peer.runs(found):
                    round_ = int(found // sc.round_seconds)
                    peer.dead[q.name] = round_
                    self.report(peer, q.name, round_, found)

    def _monitors(self, view: MembershipView, peer: str) -> frozenset[str]:
        """protocol.membership.monitors, once per peer and set of stages (each peer builds its own
        view objects, mostly equal)."""
        held = self.watchers.get(id(view))
        if held is None or held[0] is not view:
            if len(self.watchers) > 64 * JUDGED_SETS:
                self.watchers.clear()
            if len(self.watched) > JUDGED_SETS:
                self.watched.clear()
            held = self.watchers[id(view)] = (view, self.watched.setdefault(view.stages, {}))
        if peer not in held[1]:
            held[1][peer] = monitors(view, peer)
        return held[1][peer]

    def run(self) -> dict:
        sc = self.sc
        self.start()
        queue = list(self.events)
        for r in range(1, sc.rounds + 1):
            t_boundary = r * sc.round_seconds
            while queue and queue[0][0] < t_boundary:
                t, kind, index = queue.pop(0)
                if kind == "cut":
                    self._cut_off(index)
                else:
                    self._churn(index, kind, t)
            self.holders = self._holders(t_boundary)
            joiners = []
            for peer in list(self.peers):
                t = t_boundary + self._straggle()
                if not peer.runs(t):
                    continue
                if peer.joining_at is not None:
                    joiners.append((peer, t))
                elif peer.round() < r - LEFT_BEHIND_ROUNDS:  # it was stopped: it fell behind
                    self.rejoin(peer, t)
                else:
                    while peer.joining_at is None and peer.round() < r:  # missed boundaries too
                        self.boundary(peer, t)
            for peer, t in joiners:  # after the members, whose views of this round admit them
                if peer.joining_at is not None and peer.joining_at <= t_boundary:
                    self.enter(peer, t)
            self._measure(r)
            if sc.records != "dht":
                self._spread(r)
        return self.result()

    def _spread(self, r: int) -> None:
        """Records pass between members during round r (Scenario.records): what each read at the
        boundary and the records it wrote itself (a joiner's announcement that it entered, among
        them) become readable, by the middle of the round, at the other member of every pair of
        adjacent-stage members whose views differ ("swap"), or at every member connected to the
        holder through such pairs, agreeing or not ("gossip"); never across a partition."""
        sc = self.sc
        t = r * sc.round_seconds
        at = t + sc.round_seconds / 2
        holding = [p for p in self.peers if p.runs(at) and self.member(p, r)]
        digest = {p.name: p.views[r].digest() for p in holding}
        pairs = [
            (a.index, b.index)
            for a in holding
            for b in holding
            if b.stage == a.stage + 1
            and (sc.records == "gossip" or digest[a.name] != digest[b.name])
            and not self._cut(a.index, b.index, at)
        ]
        if not pairs:
            return
        members = np.array(sorted({x for pair in pairs for x in pair}))
        if sc.records == "gossip":  # the connected groups of members: a union-find
            group = np.arange(self.capacity)
            for i, j in pairs:
                gi, gj = _root(group, i), _root(group, j)
                group[max(gi, gj)] = min(gi, gj)
            group = np.array([_root(group, i) for i in range(self.capacity)])
        index = {p.name: p.index for p in self.peers}
        stored = [(record, p.index, sc.announcement_bytes) for p in self.peers for record, *_ in p.announced]
        stored += [(record, index[reporter], sc.report_bytes) for record, _, reporter, _ in self.reports]
        a, b = (np.array(x) for x in zip(*pairs, strict=True))
        for record, writer, size in stored:
            had = record.readable <= t
            had[writer] |= record.at <= at
            gets = np.zeros(len(record.readable), dtype=bool)
            if sc.records == "gossip":
                gets[members] = np.isin(group[members], group[members][had[members]])
            else:
                gets[a[had[b]]] = True
                gets[b[had[a]]] = True
            gets &= ~had
            # each record once to each peer that lacked it then (not one that has it by `at`: a
            # record its writer passed on at once, `_pass_on`, was counted there)
            self.passed_bytes += size * int((gets & (record.readable > at)).sum())
            record.readable = np.where(gets, np.minimum(record.readable, at), record.readable)
        self.passing_pairs += len(pairs)

    def _straggle(self) -> float:
        churn = self.sc.churn
        return churn.straggle_seconds * self.rng.random() if self.rng.random() < churn.stragglers else 0.0

    def _measure(self, r: int) -> None:
        """Agreement in round r among the live members that hold a view of it."""
        sc = self.sc
        t = r * sc.round_seconds
        holding = [p for p in self.peers if p.runs(t) and self.member(p, r)]
        digest = {p.name: p.views[r].digest() for p in holding}
        self.splits.append(len(set(digest.values())) > 1)
        common = Counter(digest.values()).most_common(1)[0][0] if digest else None
        usual = next((p.views[r].members() for p in holding if digest[p.name] == common), set())
        differ = {
            (p.name, x) for p in holding if digest[p.name] != common for x in p.views[r].members() ^ usual
        }
        self.apart = Counter({pair: self.apart[pair] + 1 for pair in differ})
        self.longest = max(self.longest, max(self.apart.values(), default=0))
        self.member_rounds += len(holding)
        stages = Counter(p.stage for p in holding)
        alike = Counter((p.stage, digest[p.name]) for p in holding)
        for peer in holding:
            mine, s = digest[peer.name], peer.stage
            neighbours = stages[s - 1] + stages[s + 1]
            differ = neighbours - alike[(s - 1, mine)] - alike[(s + 1, mine)]
            if differ:
                self.stalls += 1
                self.samples_lost += round(sc.batch * sc.inner_steps * differ / neighbours)
        heartbeats = sc.round_seconds / sc.heartbeat_seconds
        for peer in holding:  # a live peer's heartbeats in a round (a new announcement is counted apart)
            self.ops[peer.name] += heartbeats
            self.bytes[peer.name] += (
                heartbeats * (self.sc.announcement_bytes + KEY_OVERHEAD) * sc.dht.replicas
            )
        if sc.directory == "spread":
            joining = [p for p in self.peers if p.runs(t) and p.joining_at is not None]
            for peer in joining:  # a joiner heartbeats to the roster until it enters
                self.ops[peer.name] += heartbeats
                self.bytes[peer.name] += heartbeats * (sc.announcement_bytes + KEY_OVERHEAD) * sc.dht.replicas
            for peer in [*holding, *joining]:
                for holder in self._key_holders(self._place(peer), t):
                    self.node_bytes[holder] += heartbeats * sc.announcement_bytes
            return
        for holder in self.holders:
            self.node_bytes[holder] += len(holding) * heartbeats * self.sc.announcement_bytes

    def result(self) -> dict:
        sc = self.sc
        rounds = len(self.splits)
        joins = [s for p in self.peers for s in p.entered]
        peer_rounds = max(1, self.member_rounds)
        return (
            {
                "peers": sc.peers,
                "stages": sc.stages,
                "churn_per_hour": sc.churn.per_hour * sc.peers,
                "dht_delay": "; ".join(
                    [sc.dht.describe()]
                    + [
                        f"{p.share:.0%} of peers cut off for {p.seconds:g} s at {p.start:g} s"
                        for p in sc.partitions
                    ]
                ),
                "rounds": rounds,
                "rounds_all_agree": rounds - sum(self.splits),
                "longest_split_rounds": self.longest,
                "stalls": self.stalls,
                "samples_lost": self.samples_lost,
                "dht_ops_per_peer_round": sum(self.ops.values()) / peer_rounds,
                "dht_bytes_per_peer_round": sum(self.bytes.values()) / peer_rounds,
                "busiest_dht_node_bytes_per_round": max(self.node_bytes.values(), default=0) / max(1, rounds),
                "join_seconds_median": statistics.median(joins) if joins else None,
                "joins": len(joins),
                # gone reports filed, and the peers they accuse (a partition's grow as N squared)
                "gone_reports": len(self.reports),
                "accused": len({peer for _, peer, _, _ in self.reports}),
            }
            | (
                {
                    "passing_pairs": self.passing_pairs,
                    "passed_bytes_per_peer_round": self.passed_bytes / peer_rounds,
                }
                if sc.records != "dht"
                else {}
            )
            | ({"directory": sc.directory} if sc.directory != "whole" else {})
            | ({"join": sc.join} if sc.join != "whole" else {})
        )


def _root(group: np.ndarray, i: int) -> int:
    while group[i] != i:
        group[i] = group[group[i]]
        i = int(group[i])
    return i


def simulate(scenario: Scenario) -> dict:
    """One run of `scenario`: the row bench/membership_scale.py writes."""
    return Model(scenario).run()
