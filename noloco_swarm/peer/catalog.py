"""The runs a DHT knows (`noloco runs`, `noloco join --auto`): what each trains and where it needs peers.

Every peer that publishes a run's manifest also stores a RunListing (run id, config digest) under
one key for all runs, RUNS_KEY (peer/directory.py). A reader takes every listing, reads every listed
run's manifest in one DHT traversal, then each run's announcements (its roster and buckets, in a
few traversals: directory.read_announcements), and lists a run only when the listing's
writer also signed a manifest of that run with the listed digest: a stranger can add a listing, but
not one that names another's run or config. A listing that fails this, or does not decode, or sits
under a subkey that is not its own run's, is skipped and counted.

What a run needs comes from its own config: `stage_replicas` (or `num_replicas` for every stage) is
how many peers each stage asks for; the stages with fewer announced peers are short of peers.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from noloco_swarm.model.presets import ModelConfig, count_parameters
from noloco_swarm.peer.directory import (
    RUNS_KEY,
    answer,
    latest_values,
    manifest_key,
    most_stored,
    read_announcements,
    signed_manifests,
)
from noloco_swarm.peer.net.identity import owner_of
from noloco_swarm.protocol import codec, records

# A manifest that asks for more stages than this is not listed (its config is not a real run's).
MAX_STAGES = 1024
# Runs whose directories `read_catalog` reads at once (each read is a few DHT traversals).
READERS = 8

if TYPE_CHECKING:
    from hivemind import DHT


@dataclass(frozen=True)
class RunSummary:
    """One listed run as `noloco runs` shows it."""

    run_id: str
    description: str
    preset: str
    parameters: int  # of the whole model (0: the manifest's model keys are not ones we know)
    method: str
    wanted: tuple[int, ...]  # peers each stage asks for (its replicas)
    peers: tuple[int, ...]  # peers announced on each stage now
    closed: bool  # a closed run admits only peers with a join ticket from its authority
    step: int  # the furthest inner step any announced peer has reported
    round: int  # step // H
    tokens: int  # about: step x batch x sequence x the stage-0 peers now
    config_hash: str
    config: dict[str, object] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """The manifest's config as values (dotted key -> value): what a peer that joins it runs."""

    @property
    def stages(self) -> int:
        return len(self.wanted)

    @property
    def short(self) -> tuple[int, ...]:
        """The stages with fewer peers than they ask for."""
        return tuple(
            s for s, (want, have) in enumerate(zip(self.wanted, self.peers, strict=True)) if have < want
        )

    def need(self, stage: int) -> int:
        """How many peers `stage` lacks (negative: how many it has beyond what it asks for)."""
        return self.wanted[stage] - self.peers[stage]

    def neediest_stage(self) -> int:
        """The stage that needs a peer most: the largest shortfall, then the fewest peers, then the
        lowest stage."""
        return min(range(self.stages), key=lambda s: (-self.need(s), self.peers[s], s))

    def as_json(self) -> dict[str, object]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}
        return fields | {
            "wanted": list(self.wanted),
            "peers": list(self.peers),
            "stages": self.stages,
            "short": list(self.short),
        }


@dataclass(frozen=True)
class Catalog:
    """What one read of the list of runs found."""

    runs: tuple[RunSummary, ...]
    skipped: int  # listings that did not decode, were not their run's, or had no signed manifest behind them


def listings(value: object) -> tuple[dict[str, list[tuple[str, str]]], int]:
    """run id -> [(writer, config digest), ...] of every well-formed listing in `value` (what the DHT
    holds under RUNS_KEY) stored under its own run's subkey by its signer; and how many others."""
    if not isinstance(value, dict):
        return {}, 0
    runs: dict[str, list[tuple[str, str]]] = defaultdict(list)
    bad = 0
    for subkey, item in value.items():
        owned = owner_of(subkey)
        try:
            listing = codec.decode(item.value, records.RunListing)
        except codec.MessageError:
            bad += 1
            continue
        if owned is None or owned[0] != listing.run_id:
            bad += 1
            continue
        runs[listing.run_id].append((owned[1], listing.config_hash))
    return dict(runs), bad


def backing(
    run_id: str, listed: list[tuple[str, str]], manifests_value: object
) -> tuple[records.RunManifest | None, int]:
    """The manifest a run is listed with, from the DHT's value of its manifest key: of the
    listings (writer, digest) that their writer backs with a signed manifest of that digest, the
    digest the most of them give; and how many listings no such manifest backs (forged). Pure."""
    signed, _ = signed_manifests(manifests_value, run_id)
    mine = {(writer, m.config_hash): m for writer, m in signed}
    backed = [mine[pair] for pair in listed if pair in mine]
    if not backed:
        return None, len(listed)
    return most_stored(backed), len(listed) - len(backed)


def summarize(
    manifest: records.RunManifest, announced: Sequence[records.PeerAnnouncement]
) -> RunSummary | None:
    """The summary of a run listed with `manifest`, from its peers' announcements; None when the
    manifest's config makes no run (no stages, or more than MAX_STAGES). Pure."""
    run_id = manifest.run_id
    config = {k: _value(v) for k, v in manifest.config}
    stages = _int(config.get("num_stages"), 0)
    if not 1 <= stages <= MAX_STAGES:
        return None
    per_stage = config.get("stage_replicas")
    if isinstance(per_stage, list) and len(per_stage) == stages:
        wanted = tuple(_int(n, 1) for n in per_stage)
    else:
        wanted = (_int(config.get("num_replicas"), 1),) * stages
    peers = [0] * stages
    for a in announced:
        if a.stage < stages:
            peers[a.stage] += 1
    step = max((a.step for a in announced), default=0)
    inner_steps = max(1, _int(config.get("outer.inner_steps"), 1))
    tokens = step * _int(config.get("inner.batch_size"), 0) * _int(config.get("model.seq_len"), 0) * peers[0]
    return RunSummary(
        run_id=run_id,
        description=str(config.get("description") or ""),
        preset=str(config.get("model.name") or "?"),
        parameters=_parameters(config),
        method=str(config.get("outer.method") or "?"),
        wanted=wanted,
        peers=tuple(peers),
        closed=bool(config.get("authority")),
        step=step,
        round=step // inner_steps,
        tokens=tokens,
        config_hash=manifest.config_hash,
        config=config,
    )


def read_catalog(dht: DHT) -> Catalog:
    """Every listed run on the DHT `dht` reaches, sorted by run id (DHT traversals: the list, every
    listed run's manifest together, then the runs' announcements, all runs' reads side by side)."""
    found = answer(dht.get(RUNS_KEY, latest=True, return_future=True))
    listed, skipped = listings(None if found is None else found.value)
    if not listed:
        return Catalog((), skipped)
    get_many = functools.partial(latest_values, dht)
    values = {
        key: None if value is None else value.value
        for key, value in get_many([manifest_key(run_id) for run_id in sorted(listed)]).items()
    }
    manifests = {}
    for run_id in sorted(listed):
        manifest, forged = backing(run_id, listed[run_id], values.get(manifest_key(run_id)))
        skipped += forged
        if manifest is not None:
            manifests[run_id] = (manifest, len(listed[run_id]) - forged)
    if not manifests:
        return Catalog((), skipped)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(READERS, len(manifests))) as pool:
        readouts = pool.map(lambda run_id: read_announcements(run_id, get_many), manifests)
        announced = dict(zip(manifests, readouts, strict=True))
    runs = []
    for run_id, (manifest, listings_of_it) in manifests.items():
        summary = summarize(manifest, announced[run_id].announcements)
        if summary is not None:
            runs.append(summary)
        else:  # a signed config that makes no run: every listing of it
            skipped += listings_of_it
    return Catalog(tuple(runs), skipped)


def _value(text: str) -> object:
    """A manifest value (the repr of a config value) back as the value; the text if it is not a literal."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def _parameters(config: dict[str, object]) -> int:
    """The model's parameter count from the manifest's model.* keys; 0 if they do not make a model."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model = {
        k.split(".", 1)[1]: v
        for k, v in config.items()
        if k.startswith("model.") and k.split(".", 1)[1] in fields
    }
    try:
        return count_parameters(ModelConfig(**model))
    except (TypeError, ValueError):
        return 0
