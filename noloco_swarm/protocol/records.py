"""The DHT records of a run: its manifest, peer announcements, join tickets and gone reports, and
the listing that puts a run in the DHT's list of runs (`noloco runs`).

Each is a message of the codec (codec.py), signed by its writer where peer/directory.py stores it.
A `Sealed` record carries its writer's signature inside it, so that members can pass it on to
each other (peer/passing.py) and every receiver can check who wrote it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import ClassVar

from noloco_swarm.protocol.codec import Message, check_counters, check_run_id, encode

Scalar = str | int | float | bool | None


@dataclass(frozen=True)
class RunManifest(Message):
    """A run's identity and configuration, stored in the DHT under the run id.

    `config` is the run's flattened config tree as sorted (key, repr) pairs; `config_hash` is its
    sha256, so a joining peer compares one string and can print the first differing key.
    """

    TAG: ClassVar[str] = "manifest"
    run_id: str
    config: tuple[tuple[str, str], ...]
    config_hash: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        keys = [k for k, _ in self.config]
        if keys != sorted(set(keys)):
            raise ValueError("config keys must be sorted and unique")
        if self.config_hash != config_digest(self.config):
            raise ValueError("config_hash does not match config")

    @classmethod
    def create(cls, run_id: str, flat_config: dict[str, Scalar]) -> RunManifest:
        pairs = tuple(sorted((str(k), repr(v)) for k, v in flat_config.items()))
        return cls(run_id=run_id, config=pairs, config_hash=config_digest(pairs))

    def differences(self, other: RunManifest) -> list[str]:
        """Human-readable differences, for the error a mismatched peer prints."""
        mine, theirs = dict(self.config), dict(other.config)
        return [
            f"{k}: {mine.get(k, '<absent>')} != {theirs.get(k, '<absent>')}"
            for k in sorted(set(mine) | set(theirs))
            if mine.get(k) != theirs.get(k)
        ]


def config_digest(pairs: tuple[tuple[str, str], ...]) -> str:
    h = hashlib.sha256()
    for key, value in pairs:
        h.update(key.encode() + b"\0" + value.encode() + b"\0")
    return h.hexdigest()


@dataclass(frozen=True)
class RunListing(Message):
    """A run's entry in the DHT's list of runs, stored by a peer that published the run's manifest:
    the run and the digest of that manifest's config. A reader lists the run only when the entry's
    writer also signed a manifest of the run with this digest, so nobody lists a run under another's
    name or config."""

    TAG: ClassVar[str] = "listing"
    run_id: str
    config_hash: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if len(self.config_hash) != 64 or any(c not in "0123456789abcdef" for c in self.config_hash):
            raise ValueError("config_hash must be 64 lowercase hex digits (a sha256)")


@dataclass(frozen=True)
class PeerAnnouncement(Message):
    """A peer's heartbeat record: which stage it serves, from which round, and where to reach it."""

    TAG: ClassVar[str] = "announce"
    run_id: str
    peer_id: str
    stage: int
    joined_round: int
    addresses: tuple[str, ...] = field(default=())
    device: str = "cpu"
    step: int = 0  # inner steps this peer has completed (refreshed by every heartbeat)
    ticket: bytes = b""  # an encoded JoinTicket: what a closed run asks of its members

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if not self.peer_id:
            raise ValueError("peer_id must not be empty")
        if self.stage < 0 or self.joined_round < 0 or self.step < 0:
            raise ValueError("stage, joined_round and step must be >= 0")


@dataclass(frozen=True)
class JoinTicket(Message):
    """The authority of a closed run lets `peer_id` serve in `run_id` until `expires` (unix
    seconds): `signature` is its RSA signature of `signed_bytes()` (peer/tickets.py)."""

    TAG: ClassVar[str] = "ticket"
    run_id: str
    peer_id: str
    expires: float
    signature: bytes = b""

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if not self.peer_id:
            raise ValueError("peer_id must not be empty")
        if not math.isfinite(self.expires):
            raise ValueError("expires must be a finite time")

    def signed_bytes(self) -> bytes:
        """What the authority signs: every field but the signature, unambiguously."""
        return encode(dataclasses.replace(self, signature=b""))


@dataclass(frozen=True)
class GoneReport(Message):
    """A member's note in the DHT that `peer_id` failed it in `round`: it leaves the next view.

    A peer that is reported gone but alive finds itself outside the next view and joins again,
    announcing a later round (a report only removes memberships that began at or before its round).
    """

    TAG: ClassVar[str] = "gone"
    run_id: str
    peer_id: str
    reporter: str
    round: int

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if not self.peer_id or not self.reporter:
            raise ValueError("peer_id and reporter must not be empty")
        check_counters(self.round)


@dataclass(frozen=True)
class Sealed(Message):
    """An announcement or a gone report (`record`, encoded) with its writer's RSA public key (ssh
    form) and signature of `record`: anyone can check it without the DHT (peer/net/identity.py,
    `opened`). The DHT strips the signature it checks, so records read there cannot be passed on."""

    TAG: ClassVar[str] = "sealed"
    record: bytes
    key: bytes
    signature: bytes

    def __post_init__(self) -> None:
        if not self.record or not self.key or not self.signature:
            raise ValueError("a sealed record needs its record, its writer's key and a signature")
