"""The run's directory in the hivemind DHT: the manifest, and the peers announced per stage.

Keys (all under the run id, so runs never see each other's records, but the list of runs):
  noloco/runs            [run id + owner mark]           a RunListing, by each peer that publishes a manifest
  noloco/<run>/manifest  [owner mark]                    the RunManifest, by the peer that starts the run
  noloco/<run>/peers     [peer id + owner mark]          the roster: announcements of peers without a view
                                                         (joiners, founders before round 0)
  noloco/<run>/peers/<b> [peer id + owner mark]          bucket b: the announcements of the members at
                                                         places 16b to 16b + 15 of their latest view
  noloco/<run>/gone/<p>  [peer/reporter/round + mark]    GoneReports of peer p: a member failed p in a round
A peer re-stores its announcement every heartbeat, under the key its latest view gives it
(membership.directory_bucket): each key is written by a bounded number of peers, so the load on
the DHT nodes that hold it stays flat as the swarm grows (issue 36, item 4). A reader of the whole
directory reads the roster and the buckets in waves until the last ones are empty; a joiner asks
a member instead (peer/neighbourhood.py), and reads one bucket at most.
Every subkey ends with its writer's owner mark (peer/net/identity.py): DHT nodes store, and readers
accept, a record only with that writer's signature, and a reader trusts a record only if it speaks
for its writer (an announcement of the writer itself, a report by the writer). Nobody can forge,
overwrite or replay with another expiry another peer's records; a stranger's records name only
the stranger, whom no member counts.
Records expire, so a peer that stops heartbeating drops out of the next round's membership; a
gone report takes a crashed peer out sooner, at the next round boundary. Each reporter's report of
each round is a record of its own: two members that saw the same death in different rounds both
stay on record, and every peer applies the same rule to all of them.
Everything read back is decoded with the message codec; a malformed, unsigned or misattributed
record is skipped (and counted), never trusted. The frozen per-round view itself is built by
protocol.membership.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID
from hivemind.utils import MPFuture, ValueWithExpiration, get_dht_time

from noloco_swarm.peer.net.identity import Identity, owner_of
from noloco_swarm.protocol import codec, records
from noloco_swarm.protocol.membership import FIRST_WAVE, credible_gone

if TYPE_CHECKING:
    from noloco_swarm.peer.net.node import LoopDHT

# The manifest outlives any one peer (a run longer than a week re-publishes it).
MANIFEST_TTL = 7 * 24 * 3600.0
DEFAULT_HEARTBEAT_TTL = 30.0
R = TypeVar("R", records.PeerAnnouncement, records.GoneReport)
T = TypeVar("T")
GONE_TTL = 3600.0  # long enough to outlast any announcement the gone peer left behind
# A DHT call waits at most this long. hivemind's blocking get/store wait on a future that the DHT
# process completes; one still pending when that process shuts down would never complete, and the
# worker thread waiting on it would keep the peer from exiting.
DHT_CALL_TIMEOUT = 30.0


class ManifestMismatchError(RuntimeError):
    """This peer's config differs from the run's manifest; the message lists the differences."""


# The list of runs (`noloco runs`, peer/catalog.py): one RunListing per run and manifest author.
RUNS_KEY = "noloco/runs"


def manifest_key(run_id: str) -> str:
    return f"noloco/{run_id}/manifest"


def peers_key(run_id: str) -> str:
    """The roster: where peers without a view announce themselves."""
    return f"noloco/{run_id}/peers"


def bucket_key(run_id: str, bucket: int) -> str:
    return f"noloco/{run_id}/peers/{bucket}"


def gone_key(run_id: str, peer_id: str) -> str:
    return f"noloco/{run_id}/gone/{peer_id}"


@dataclass
class DhtCalls:
    """What this peer asked of the DHT through its directory: stores and key reads, and the bytes
    of the records they carried (values only; the DHT's own lookups and replication are not
    counted). For comparing a real swarm's load with the membership simulator's."""

    stores: int = 0
    reads: int = 0
    bytes_stored: int = 0
    bytes_read: int = 0

    def read(self, found: ValueWithExpiration | None) -> None:
        self.reads += 1
        value = None if found is None else found.value
        if isinstance(value, dict):
            self.bytes_read += sum(
                len(item.value) for item in value.values() if isinstance(item.value, bytes)
            )

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass
class DirectoryReadout:
    """What one read of the peers key found."""

    announcements: list[records.PeerAnnouncement]
    malformed: int  # records that failed to decode or named another run


class RunDirectory:
    """Publish and read a run's records through a running hivemind DHT.

    Writing needs this peer's `identity` (by default the DHT's own, `dht.identity`, set by
    `start_dht` and the peer's launch), whose key the DHT's record validator signs with (see
    `signed_dht_kwargs`); a directory without one (`noloco status`) only reads."""

    def __init__(
        self,
        dht: DHT | LoopDHT,
        run_id: str,
        *,
        ttl: float = DEFAULT_HEARTBEAT_TTL,
        identity: Identity | None = None,
    ) -> None:
        if ttl <= 0:
            raise ValueError(f"ttl must be > 0, got {ttl}")
        records.RunManifest.create(run_id, {})  # validates the run id early, with a clear message
        self.dht, self.run_id, self.ttl = dht, run_id, ttl
        self.identity = identity or getattr(dht, "identity", None)
        self.calls = DhtCalls()

    # ---------------------------------------------------------------- manifest

    def manifests(self) -> list[tuple[str, records.RunManifest]]:
        """(author, manifest) of every signed, well-formed manifest of this run, sorted by author.
        Several authors may have stored one (the peers that were started with --new-run)."""
        found = self._get(manifest_key(self.run_id))
        return signed_manifests(None if found is None else found.value, self.run_id)[0]

    def fetch_manifest(self) -> records.RunManifest | None:
        """The run's manifest, or None if nobody published one (or none is readable). When authors
        disagree, the config the most of them stored (the first author's on a tie): for display;
        a joiner checks its own config against every one (`join_manifest`)."""
        found = self.manifests()
        return most_stored([m for _, m in found]) if found else None

    def publish_manifest(self, manifest: records.RunManifest) -> None:
        if manifest.run_id != self.run_id:
            raise ValueError(f"manifest is for run {manifest.run_id!r}, this directory is {self.run_id!r}")
        # The manifest, then its entry in the list of runs; both live as long.
        expires = get_dht_time() + MANIFEST_TTL
        listing = records.RunListing(self.run_id, manifest.config_hash)
        for key, record, subkey, what in (
            (manifest_key(self.run_id), manifest, self._writer().mark, "manifest"),
            (RUNS_KEY, listing, self._writer().owned(self.run_id), "run's listing"),
        ):
            ok = answer(self.dht.store(key, codec.encode(record), expires, subkey=subkey, return_future=True))
            if not ok:
                raise RuntimeError(f"the DHT did not accept the {what}; is any DHT peer reachable?")

    def join_manifest(self, mine: records.RunManifest, *, new_run: bool) -> records.RunManifest:
        """Check our config against the run's manifest; publish it first if we start the run.

        Accepted when any signed manifest of the run has our config: a stranger who stores
        another config under the run's id cannot replace the creator's record, only add one.
        Raises ManifestMismatchError (listing the differing keys) when the run exists with another
        config, and LookupError when it does not exist and we were not asked to start it.
        """
        found = self.manifests()
        if not found:
            if not new_run:
                raise LookupError(
                    f"run {self.run_id!r} has no manifest in the DHT: check --run-id and --initial-peers, "
                    "or start the run with --new-run"
                )
            self.publish_manifest(mine)
            return mine
        for _, existing in found:
            if existing.config_hash == mine.config_hash:
                return existing
        lines = []
        for author, existing in found:
            diff = "\n    ".join(existing.differences(mine))
            lines.append(f"manifest stored by {author}:\n    {diff}")
        raise ManifestMismatchError(
            f"run {self.run_id!r} was started with another config; differences (run != yours):\n  "
            + "\n  ".join(lines)
        )

    def _writer(self) -> Identity:
        if self.identity is None:
            raise RuntimeError("this directory has no identity: it can read records, not write them")
        return self.identity

    # ---------------------------------------------------------------- peers

    def announce(self, announcement: records.PeerAnnouncement, bucket: int | None = None) -> bool:
        """Store (or refresh) our announcement; call it every ttl/3 seconds as the heartbeat.
        `bucket` is ours in our latest view (membership.directory_bucket); None (no view) stores
        it in the roster."""
        if announcement.run_id != self.run_id:
            raise ValueError("announcement names another run")
        if announcement.peer_id != self._writer().peer_id:
            raise ValueError("a peer announces only itself")
        if bucket is not None and bucket < 0:
            raise ValueError(f"bucket must be >= 0, got {bucket}")
        key = peers_key(self.run_id) if bucket is None else bucket_key(self.run_id, bucket)
        return self._store(key, announcement, self.ttl)

    def read_peers(self) -> DirectoryReadout:
        """Every live, well-formed announcement of this run (subkey must equal the peer id), from
        the roster and the buckets; of a peer found under several keys (its place moved within a
        heartbeat ttl), the one stored last."""
        return read_announcements(self.run_id, self._get_many)

    def read_bucket(self, bucket: int | None) -> list[records.PeerAnnouncement]:
        """The live, well-formed announcements under one key: bucket `bucket` of the members'
        places (membership.directory_bucket), or the roster with None. One DHT read, where
        read_peers reads every key: for a joiner that asks a member (peer/neighbourhood.py)."""
        key = peers_key(self.run_id) if bucket is None else bucket_key(self.run_id, bucket)
        return self._records(self._get_many([key]).get(key), records.PeerAnnouncement)[0]

    def known_nodes(self) -> list[str]:
        """Peer ids in our DHT node's routing table (random peers of the DHT: members, mostly),
        where the node runs on this process's loop (LoopDHT); call it on that loop. Empty for a
        DHT in its own process."""
        node = getattr(self.dht, "node", None)
        if node is None:
            return []
        return [str(p) for p in node.protocol.routing_table.peer_id_to_uid]

    def rebootstrap(self, peer_ids: Sequence[str]) -> int:
        """Ping `peer_ids` (the run's entry points) from our DHT node and look up our neighbours
        again, as hivemind does at start: a node that was cut off from everyone has emptied its
        routing table, and would otherwise find no record again. How many answered."""
        ping = functools.partial(_ping_entry_points, tuple(peer_ids))  # runs where the DHT node runs
        return answer(self.dht.run_coroutine(ping, return_future=True))

    def _store(self, key: str, record: records.PeerAnnouncement | records.GoneReport, ttl: float) -> bool:
        """Store `record` under its subkey with our owner mark: the DHT signs it with our key."""
        subkey, expiration = self._writer().owned(subkey_of(record)), get_dht_time() + ttl
        value = codec.encode(record)
        self.calls.stores += 1
        self.calls.bytes_stored += len(value)
        return bool(answer(self.dht.store(key, value, expiration, subkey=subkey, return_future=True)))

    def _get(self, key: str) -> ValueWithExpiration | None:
        found = answer(self.dht.get(key, latest=True, return_future=True))
        self.calls.read(found)
        return found

    def _get_many(self, keys: Sequence[str]) -> dict[str, ValueWithExpiration | None]:
        """The latest value of every key of `keys`, in one traversal."""
        found = latest_values(self.dht, keys)
        for key in keys:
            self.calls.read(found.get(key))
        return found

    def _records(self, found: ValueWithExpiration | None, cls: type[R]) -> tuple[list[R], int]:
        return signed_records(None if found is None else found.value, cls, self.run_id)

    # ---------------------------------------------------------------- failures

    def report_gone(self, report: records.GoneReport) -> bool:
        """Tell the swarm a member failed us, so that everyone drops it at the next boundary."""
        if report.run_id != self.run_id:
            raise ValueError("report names another run")
        if report.reporter != self._writer().peer_id:
            raise ValueError("a peer files reports only as itself")
        return self._store(gone_key(self.run_id, report.peer_id), report, GONE_TTL)

    def read_gone(self, members: set[str], seen: Iterable[tuple[str, str, int]] = ()) -> dict[str, set[int]]:
        """peer id -> every round it was credibly reported gone in (`membership.credible_gone`), for
        the peers of `members`, from the reports on record and those in `seen` (peer, reporter,
        round), e.g. our own; only members' reports count (a stranger cannot evict anyone: a report
        counts as its signer's, whatever it says)."""
        return credible_gone(item for item in [*self.read_reports(members), *seen] if item[1] in members)

    def read_reports(self, peers: Iterable[str]) -> list[tuple[str, str, int]]:
        """(peer, reporter, round) of every signed gone report on record of `peers` (each by its
        reporter, under the key of the peer it names)."""
        keys = {gone_key(self.run_id, p): p for p in peers}
        if not keys:
            return []
        out = []
        for key, found in self._get_many(list(keys)).items():
            reports, _ = self._records(found, records.GoneReport)
            out += [(r.peer_id, r.reporter, r.round) for r in reports if r.peer_id == keys.get(key)]
        return out


def read_announcements(
    run_id: str, get_many: Callable[[Sequence[str]], Mapping[str, ValueWithExpiration | None]]
) -> DirectoryReadout:
    """The readout of `run_id`'s roster and buckets, read with `get_many` (the latest value of each
    of some keys) in waves: the roster and FIRST_WAVE buckets, then twice as many buckets as the
    wave before, until the last two buckets of a wave hold nothing. Of a peer found under several
    keys, the record that expires last (the one stored last: every heartbeat has the same ttl)."""
    latest: dict[str, tuple[float, records.PeerAnnouncement]] = {}
    malformed = 0
    keys, first = [peers_key(run_id)], 0
    size = FIRST_WAVE
    while True:
        wave = [bucket_key(run_id, b) for b in range(first, first + size)]
        found = get_many([*keys, *wave])
        held = []
        for key in [*keys, *wave]:
            value = found.get(key)
            good, bad = signed_items(None if value is None else value.value, records.PeerAnnouncement, run_id)
            malformed += bad
            held.append(bool(good))
            for announcement, expires in good:
                if announcement.peer_id not in latest or expires > latest[announcement.peer_id][0]:
                    latest[announcement.peer_id] = (expires, announcement)
        if not any(held[-2:]):
            break
        keys, first, size = [], first + size, 2 * size
    return DirectoryReadout(sorted((a for _, a in latest.values()), key=lambda a: a.peer_id), malformed)


def answer(future: MPFuture[T] | concurrent.futures.Future[T]) -> T:
    """A DHT call's answer within DHT_CALL_TIMEOUT; TimeoutError (and the call cancelled) after, and
    RuntimeError if the node shuts down first."""
    try:
        return future.result(timeout=DHT_CALL_TIMEOUT)
    except TimeoutError:
        future.cancel()
        raise TimeoutError(f"the DHT did not answer within {DHT_CALL_TIMEOUT:.0f} s") from None
    except concurrent.futures.CancelledError:  # the node shut down (LoopDHT.shutdown)
        raise RuntimeError("the DHT node shut down before it answered") from None


def latest_values(dht: DHT, keys: Sequence[str]) -> dict[str, ValueWithExpiration | None]:
    """The latest value of every key of `keys` on `dht`, in one traversal (`answer`'s limits)."""
    return answer(dht.run_coroutine(functools.partial(get_latest, tuple(keys)), return_future=True))


async def get_latest(keys: tuple[str, ...], _: DHT, node: DHTNode) -> dict[str, ValueWithExpiration | None]:
    # as DHT.get(key, latest=True) for each key, in one traversal (runs where the DHT node runs)
    return dict(await node.get_many(keys, sufficient_expiration_time=float("inf")))


async def _ping_entry_points(peer_ids: tuple[str, ...], _: DHT, node: DHTNode) -> int:
    # Every peer that failed us while we were cut off is banned from lookups, for a time that
    # doubles with each failure: the bans, not the peers, would keep us blind once the link is back.
    node.blacklist.clear()
    answers = await asyncio.gather(*(node.protocol.call_ping(PeerID.from_base58(p)) for p in peer_ids))
    await node.find_nearest_nodes([node.node_id])
    return sum(a is not None for a in answers)


def signed_manifests(
    value: object, run_id: str
) -> tuple[list[tuple[str, records.RunManifest]], codec.MessageError | None]:
    """(author, manifest) of every signed, well-formed manifest of `run_id` in the DHT's value of
    its manifest key, sorted by author; and why the last of the signed others could not be used
    (a manifest of another protocol version, or of another run), for `noloco doctor` to name."""
    out, unreadable = [], None
    for subkey, item in (value if isinstance(value, dict) else {}).items():
        owned = owner_of(subkey)
        if owned is None or owned[0] != "":
            continue
        try:
            manifest = codec.decode(item.value, records.RunManifest)
        except codec.MessageError as e:
            unreadable = e
            continue
        if manifest.run_id != run_id:
            unreadable = codec.MessageError(f"it names run {manifest.run_id!r}")
            continue
        out.append((owned[1], manifest))
    return sorted(out, key=lambda pair: pair[0]), unreadable


def signed_records(value: object, cls: type[R], run_id: str) -> tuple[list[R], int]:
    """Well-formed records of `cls` in `value` (what the DHT holds under one key) that name
    `run_id`, sit under their own subkey and speak for the peer who signed them, and how many
    others there were (garbage, another run, unsigned, a subkey that lies about its record, a
    writer speaking for someone else)."""
    good, bad = signed_items(value, cls, run_id)
    return [record for record, _ in good], bad


def signed_items(value: object, cls: type[R], run_id: str) -> tuple[list[tuple[R, float]], int]:
    """As signed_records, each record with the time its DHT entry expires."""
    if not isinstance(value, dict):
        return [], 0
    good, bad = [], 0
    for subkey, item in value.items():
        owned = owner_of(subkey)
        try:
            record = codec.decode(item.value, cls)
        except codec.MessageError:
            bad += 1
            continue
        if owned is None or record.run_id != run_id or owned != (subkey_of(record), author(record)):
            bad += 1
            continue
        good.append((record, float(item.expiration_time)))
    return good, bad


def most_stored(manifests: Sequence[records.RunManifest]) -> records.RunManifest:
    """Of `manifests` (one per author, none empty), the config the most authors stored; the first
    of them on a tie."""
    votes = Counter(m.config_hash for m in manifests)
    best = max(votes.values())
    return next(m for m in manifests if votes[m.config_hash] == best)


def author(record: records.PeerAnnouncement | records.GoneReport) -> str:
    """The peer a record speaks for, who alone may write it: the announced peer, or the reporter."""
    return record.reporter if isinstance(record, records.GoneReport) else record.peer_id


def signed_dht_kwargs(identity: Identity | None) -> dict[str, object]:
    """hivemind DHT arguments that sign our records with `identity` and check everyone's (with
    None, only check: a node that reads and never writes)."""
    return {"record_validators": [identity.validator() if identity else RSASignatureValidator()]}


def subkey_of(record: records.PeerAnnouncement | records.GoneReport) -> str:
    """The DHT subkey a record is stored under (before its writer's owner mark): one per peer for
    announcements (a heartbeat replaces the last), one per reporter and round for gone reports
    (none replaces another)."""
    if isinstance(record, records.GoneReport):
        return f"{record.peer_id}/{record.reporter}/{record.round}"
    return record.peer_id
