"""The run's directory in the hivemind DHT: the manifest, and the peers announced per stage.

Keys (all under the run id, so runs never see each other's records):
  noloco/<run>/manifest           the RunManifest (stored by the peer that starts the run)
  noloco/<run>/peers  [peer id]   a PeerAnnouncement per peer, re-stored every heartbeat
  noloco/<run>/gone   [peer id/reporter/round]   a GoneReport: a member failed another in a round
Records expire, so a peer that stops heartbeating drops out of the next round's membership; a
gone report takes a crashed peer out sooner, at the next round boundary. Each reporter's report of
each round is a record of its own: two members that saw the same death in different rounds both
stay on record, and every peer applies the same rule to all of them.
Everything read back is decoded with the message codec; a malformed record is skipped (and
counted), never trusted. The frozen per-round view itself is built by protocol.membership.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID
from hivemind.utils import MPFuture, ValueWithExpiration, get_dht_time

from noloco_swarm.protocol import messages
from noloco_swarm.protocol.membership import credible_gone

MANIFEST_TTL = 7 * 24 * 3600.0  # the manifest outlives any one peer; re-stored by every heartbeat
DEFAULT_HEARTBEAT_TTL = 30.0
R = TypeVar("R", messages.PeerAnnouncement, messages.GoneReport)
T = TypeVar("T")
GONE_TTL = 3600.0  # long enough to outlast any announcement the gone peer left behind
# A DHT call waits at most this long. hivemind's blocking get/store wait on a future that the DHT
# process completes; one still pending when that process shuts down would never complete, and the
# worker thread waiting on it would keep the peer from exiting.
DHT_CALL_TIMEOUT = 30.0


class ManifestMismatchError(RuntimeError):
    """This peer's config differs from the run's manifest; the message lists the differences."""


def manifest_key(run_id: str) -> str:
    return f"noloco/{run_id}/manifest"


def peers_key(run_id: str) -> str:
    return f"noloco/{run_id}/peers"


def gone_key(run_id: str) -> str:
    return f"noloco/{run_id}/gone"


@dataclass
class DirectoryReadout:
    """What one read of the peers key found."""

    announcements: list[messages.PeerAnnouncement]
    malformed: int  # records that failed to decode or named another run


class RunDirectory:
    """Publish and read a run's records through a running hivemind DHT."""

    def __init__(self, dht: DHT, run_id: str, *, ttl: float = DEFAULT_HEARTBEAT_TTL) -> None:
        if ttl <= 0:
            raise ValueError(f"ttl must be > 0, got {ttl}")
        messages.RunManifest.create(run_id, {})  # validates the run id early, with a clear message
        self.dht, self.run_id, self.ttl = dht, run_id, ttl

    # ---------------------------------------------------------------- manifest

    def fetch_manifest(self) -> messages.RunManifest | None:
        """The run's manifest, or None if nobody published one (or it is unreadable)."""
        found = self._get(manifest_key(self.run_id))
        if found is None or not isinstance(found.value, bytes):
            return None
        try:
            manifest = messages.decode(found.value, messages.RunManifest)
        except messages.MessageError:
            return None
        return manifest if manifest.run_id == self.run_id else None

    def publish_manifest(self, manifest: messages.RunManifest) -> None:
        if manifest.run_id != self.run_id:
            raise ValueError(f"manifest is for run {manifest.run_id!r}, this directory is {self.run_id!r}")
        ok = self._wait(
            self.dht.store(
                manifest_key(self.run_id),
                messages.encode(manifest),
                get_dht_time() + MANIFEST_TTL,
                return_future=True,
            )
        )
        if not ok:
            raise RuntimeError("the DHT did not accept the manifest; is any DHT peer reachable?")

    def join_manifest(self, mine: messages.RunManifest, *, new_run: bool) -> messages.RunManifest:
        """Check our config against the run's manifest; publish it first if we start the run.

        Raises ManifestMismatchError (listing the differing keys) when the run exists with another
        config, and LookupError when it does not exist and we were not asked to start it.
        """
        existing = self.fetch_manifest()
        if existing is None:
            if not new_run:
                raise LookupError(
                    f"run {self.run_id!r} has no manifest in the DHT: check --run-id and --initial-peers, "
                    "or start the run with --new-run"
                )
            self.publish_manifest(mine)
            return mine
        if existing.config_hash != mine.config_hash:
            diff = "\n  ".join(existing.differences(mine))
            raise ManifestMismatchError(
                f"run {self.run_id!r} was started with another config; differences (run != yours):\n  {diff}"
            )
        return existing

    # ---------------------------------------------------------------- peers

    def announce(self, announcement: messages.PeerAnnouncement) -> bool:
        """Store (or refresh) our announcement; call it every ttl/3 seconds as the heartbeat."""
        if announcement.run_id != self.run_id:
            raise ValueError("announcement names another run")
        return self._store(peers_key(self.run_id), announcement, announcement.peer_id, self.ttl)

    def read_peers(self) -> DirectoryReadout:
        """Every live, well-formed announcement of this run (subkey must equal the peer id)."""
        good, bad = self._read(peers_key(self.run_id), messages.PeerAnnouncement)
        good.sort(key=lambda a: a.peer_id)
        return DirectoryReadout(good, bad)

    def rebootstrap(self, peer_ids: Sequence[str]) -> int:
        """Ping `peer_ids` (the run's entry points) from our DHT node and look up our neighbours
        again, as hivemind does at start: a node that was cut off from everyone has emptied its
        routing table, and would otherwise find no record again. How many answered."""
        ping = functools.partial(_ping_entry_points, tuple(peer_ids))  # runs in the DHT process
        return self._wait(self.dht.run_coroutine(ping, return_future=True))

    def _store(self, key: str, record: messages.Message, subkey: str, ttl: float) -> bool:
        expiration = get_dht_time() + ttl
        return bool(
            self._wait(
                self.dht.store(key, messages.encode(record), expiration, subkey=subkey, return_future=True)
            )
        )

    def _get(self, key: str) -> ValueWithExpiration | None:
        return self._wait(self.dht.get(key, latest=True, return_future=True))

    def _wait(self, future: MPFuture[T]) -> T:
        """The DHT's answer within DHT_CALL_TIMEOUT; TimeoutError (and the call cancelled) after."""
        try:
            return future.result(timeout=DHT_CALL_TIMEOUT)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"the DHT did not answer within {DHT_CALL_TIMEOUT:.0f} s") from None

    def _read(self, key: str, cls: type[R]) -> tuple[list[R], int]:
        """Well-formed records of `cls` under `key` naming this run and their own subkey, and how
        many others there were (garbage, another run, a subkey that lies about its record)."""
        found = self._get(key)
        if found is None or not isinstance(found.value, dict):
            return [], 0
        good, bad = [], 0
        for subkey, item in found.value.items():
            try:
                record = messages.decode(item.value, cls)
            except messages.MessageError:
                bad += 1
                continue
            if record.run_id != self.run_id or subkey_of(record) != subkey:
                bad += 1
                continue
            good.append(record)
        return good, bad

    # ---------------------------------------------------------------- failures

    def report_gone(self, report: messages.GoneReport) -> bool:
        """Tell the swarm a member failed us, so that everyone drops it at the next boundary."""
        if report.run_id != self.run_id:
            raise ValueError("report names another run")
        return self._store(gone_key(self.run_id), report, subkey_of(report), GONE_TTL)

    def read_gone(
        self, members: set[str] | None = None, seen: Iterable[tuple[str, str, int]] = ()
    ) -> dict[str, set[int]]:
        """peer id -> every round it was credibly reported gone in (`membership.credible_gone`),
        from the reports on record and those in `seen` (peer, reporter, round), e.g. our own;
        reports by non-members are ignored when `members` is given (a stranger cannot evict anyone)."""
        reports, _ = self._read(gone_key(self.run_id), messages.GoneReport)
        on_record = [(r.peer_id, r.reporter, r.round) for r in reports]
        return credible_gone(item for item in [*on_record, *seen] if members is None or item[1] in members)


async def _ping_entry_points(peer_ids: tuple[str, ...], _: DHT, node: DHTNode) -> int:
    # Every peer that failed us while we were cut off is banned from lookups, for a time that
    # doubles with each failure: the bans, not the peers, would keep us blind once the link is back.
    node.blacklist.clear()
    answers = await asyncio.gather(*(node.protocol.call_ping(PeerID.from_base58(p)) for p in peer_ids))
    await node.find_nearest_nodes([node.node_id])
    return sum(a is not None for a in answers)


def subkey_of(record: messages.PeerAnnouncement | messages.GoneReport) -> str:
    """The DHT subkey a record is stored under: one per peer for announcements (a heartbeat
    replaces the last), one per reporter and round for gone reports (none replaces another)."""
    if isinstance(record, messages.GoneReport):
        return f"{record.peer_id}/{record.reporter}/{record.round}"
    return record.peer_id
