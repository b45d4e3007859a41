"""The list of runs (peer/catalog.py) from DHT values built here: what a run needs, and which
listings are skipped. The same values on a real DHT: tests/integration/test_runs.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hivemind.utils import get_dht_time
from rich.console import Console

from noloco_swarm.cli.auto import choose
from noloco_swarm.cli.doctor_local import Check
from noloco_swarm.cli.runs import catalog_json, render_runs
from noloco_swarm.model.presets import count_parameters, get_preset
from noloco_swarm.peer.catalog import Catalog, RunSummary, backing, listings, summarize
from noloco_swarm.peer.directory import signed_records, subkey_of
from noloco_swarm.peer.net import identity
from noloco_swarm.protocol import codec, records
from noloco_swarm.train.config import RunConfig


@pytest.fixture(scope="module")
def people(tmp_path_factory: pytest.TempPathFactory) -> list[identity.Identity]:
    """Three identities: an organiser, a member, a stranger."""
    out = []
    for name in ("organiser", "member", "stranger"):
        path = Path(tmp_path_factory.mktemp("keys")) / name
        identity.generate(path)
        out.append(identity.load(path))
    return out


def item(message: codec.Message | bytes) -> SimpleNamespace:
    """A DHT subkey's stored value, as hivemind hands it back (a ValueWithExpiration)."""
    value = message if isinstance(message, bytes) else codec.encode(message)
    return SimpleNamespace(value=value, expiration_time=get_dht_time() + 30)


def manifest(run_id: str, **overrides: object) -> records.RunManifest:
    return records.RunManifest.create(run_id, RunConfig.create("tiny", "noloco", **overrides).manifest())


def listed_run(
    run_id: str, listed: list[tuple[str, str]], manifests_value: object, peers_value: object
) -> RunSummary | None:
    """What read_catalog makes of one listed run: its summary, or None when it is not listed."""
    manifest, _ = backing(run_id, listed, manifests_value)
    announced, _ = signed_records(peers_value, records.PeerAnnouncement, run_id)
    return None if manifest is None else summarize(manifest, announced)


def announce(who: identity.Identity, run_id: str, stage: int, step: int) -> tuple[str, SimpleNamespace]:
    record = records.PeerAnnouncement(run_id, who.peer_id, stage, 0, step=step)
    return who.owned(subkey_of(record)), item(record)


def test_a_listed_run_shows_its_peers_per_stage_and_the_stages_short_of_them(people: list) -> None:
    organiser, member, _ = people
    m = manifest("r1", num_stages=3, stage_replicas=(2, 1, 2), description="tiny for tests")
    listed, bad = listings({organiser.owned("r1"): item(records.RunListing("r1", m.config_hash))})
    assert (listed, bad) == ({"r1": [(organiser.peer_id, m.config_hash)]}, 0)
    peers = dict([announce(organiser, "r1", 0, 12), announce(member, "r1", 2, 15)])
    run = listed_run("r1", listed["r1"], {organiser.mark: item(m)}, peers)
    assert run is not None
    # Every stage is one short; stage 1 has nobody, which stops the pipeline: it needs a peer most.
    assert (run.wanted, run.peers, run.short, run.neediest_stage()) == ((2, 1, 2), (1, 0, 1), (0, 1, 2), 1)
    assert (run.step, run.round, run.closed, run.method, run.preset) == (15, 0, False, "noloco", "tiny")
    cfg = RunConfig.create("tiny", "noloco")
    assert run.tokens == 15 * cfg.inner.batch_size * cfg.model.seq_len * 1
    assert run.parameters == count_parameters(get_preset("tiny")) > 0
    assert run.description == "tiny for tests"


def test_neediest_stage_is_the_largest_shortfall_then_the_fewest_peers(people: list) -> None:
    organiser, member, stranger = people
    m = manifest("r2", num_stages=3, stage_replicas=(3, 1, 2))
    listed = [(organiser.peer_id, m.config_hash)]
    peers = dict(
        [announce(organiser, "r2", 0, 1), announce(member, "r2", 1, 1), announce(stranger, "r2", 2, 1)]
    )
    run = listed_run("r2", listed, {organiser.mark: item(m)}, peers)
    assert run is not None
    # stage 0: 1 of 3 (short by 2); stage 2: 1 of 2 (short by 1); stage 1 is full
    assert (run.short, run.neediest_stage()) == ((0, 2), 0)
    full = listed_run("r2", listed, {organiser.mark: item(manifest("r2", num_stages=1, num_replicas=1))}, {})
    assert full is None  # the listed digest is not the manifest's: not listed


def test_forged_malformed_and_unbacked_listings_are_skipped_and_counted(people: list) -> None:
    organiser, member, stranger = people
    real = manifest("r3")
    fake = manifest("r3", num_stages=1, num_replicas=1)
    value = {
        organiser.owned("r3"): item(records.RunListing("r3", real.config_hash)),
        stranger.owned("r3"): item(records.RunListing("r3", fake.config_hash)),  # no manifest of its own
        member.owned("r4"): item(records.RunListing("r3", real.config_hash)),  # under another run's subkey
        member.owned("r5"): item(b"\x93not a message"),
        "r6": item(records.RunListing("r6", real.config_hash)),  # no owner mark: unsigned
    }
    listed, bad = listings(value)
    assert bad == 3
    assert sorted(listed) == ["r3"] and len(listed["r3"]) == 2
    # The stranger's listing names a config no manifest it signed has; the organiser's is backed.
    assert backing("r3", listed["r3"], {organiser.mark: item(real)}) == (real, 1)  # 1 forged
    run = listed_run("r3", listed["r3"], {organiser.mark: item(real)}, {})
    assert run is not None and run.config_hash == real.config_hash
    # A manifest the stranger signs for its own digest backs its listing only for that digest.
    both = {organiser.mark: item(real), stranger.mark: item(fake)}
    assert listed_run("r3", [(stranger.peer_id, fake.config_hash)], both, {}).wanted == (1,)
    assert listed_run("r3", [(stranger.peer_id, real.config_hash)], both, {}) is None
    # Garbage where the manifests and announcements should be lists nothing and raises nothing.
    for manifests_value in (None, b"x", {organiser.mark: item(b"junk")}, {"no mark": item(real)}):
        assert listed_run("r3", listed["r3"], manifests_value, {}) is None
    assert listed_run("r3", listed["r3"], {organiser.mark: item(real)}, {"x": item(b"junk")}).peers == (0, 0)


def test_a_closed_run_and_the_table(people: list) -> None:
    organiser, member, _ = people
    authority = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7"
    open_run, closed_run = (
        manifest("open-1", description="anyone may join"),
        manifest("closed-1", authority=authority),
    )
    runs = []
    for m, peers in ((open_run, [announce(member, "open-1", 0, 40)]), (closed_run, [])):
        run = listed_run(
            m.run_id, [(organiser.peer_id, m.config_hash)], {organiser.mark: item(m)}, dict(peers)
        )
        assert run is not None
        runs.append(run)
    assert [r.closed for r in runs] == [False, True]
    catalog = Catalog(tuple(runs), skipped=2)
    console = Console(width=100, record=True, color_system=None)
    console.print(render_runs(catalog))
    text = console.export_text()
    for expected in (
        "open-1  [open]  anyone may join",
        "closed-1  [closed: a join ticket is needed]",
        f"tiny 2.1M parameters, noloco, 2 stages, round 0, {40 * 8 * 128 / 1000:.1f}k tokens",
        "peers per stage 1/2 0/2: stages 0, 1 short of peers",
        "peers per stage 0/2 0/2",
        "2 listings skipped",
    ):
        assert expected in text, text
    assert '"skipped": 2' in catalog_json(catalog) and '"short": [' in catalog_json(catalog)
    empty = Console(width=100, record=True, color_system=None)
    empty.print(render_runs(Catalog((), 1)))
    assert "no runs listed on this DHT (1 listings skipped" in empty.export_text()


def test_a_manifest_whose_config_makes_no_run_is_not_listed(people: list) -> None:
    organiser, *_ = people
    for pairs in ((("num_stages", "10**9"),), (("num_stages", "5000"),), (("num_stages", "'two'"),)):
        odd = records.RunManifest("r7", pairs, records.config_digest(pairs))
        assert (
            listed_run("r7", [(organiser.peer_id, odd.config_hash)], {organiser.mark: item(odd)}, {}) is None
        )
    pairs = (("model.hidden_size", "'wide'"), ("num_replicas", "-3"), ("num_stages", "2"))
    odd = records.RunManifest("r7", pairs, records.config_digest(pairs))
    run = listed_run("r7", [(organiser.peer_id, odd.config_hash)], {organiser.mark: item(odd)}, {})
    assert run is not None and (run.parameters, run.wanted, run.preset) == (0, (1, 1), "?")


def test_the_description_is_one_short_line() -> None:
    assert RunConfig.create("tiny", "noloco", description="x" * 120).description == "x" * 120
    for bad in ("x" * 121, "two\nlines"):
        with pytest.raises(ValueError, match="description"):
            RunConfig.create("tiny", "noloco", description=bad)


def test_auto_takes_the_open_run_whose_stage_lacks_the_most_peers_and_says_why(people: list) -> None:
    organiser, member, stranger = people

    def run(run_id: str, peers: list[tuple[identity.Identity, int]], **overrides: object) -> RunSummary:
        m = manifest(run_id, **overrides)
        announced = dict(announce(who, run_id, stage, 5) for who, stage in peers)
        summary = listed_run(
            run_id, [(organiser.peer_id, m.config_hash)], {organiser.mark: item(m)}, announced
        )
        assert summary is not None
        return summary

    key = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7"
    runs = (
        run("a-full", [(organiser, 0), (member, 0), (stranger, 1)], stage_replicas=(2, 1)),
        run("b-short", [(organiser, 0), (member, 0), (stranger, 1)]),  # stage 1: 1 of 2
        run("c-closed", [], authority=key),  # lacks most, but needs a ticket
        run("d-big", [], num_stages=1, num_replicas=4),  # lacks 4, but does not fit
    )
    fits = {"a-full": True, "b-short": True, "d-big": False}

    def check(summary: RunSummary, stage: int) -> Check:
        return Check("memory", fits[summary.run_id], f"{summary.run_id} stage {stage}")

    choice = choose(Catalog(runs, 0), check)
    assert (choice.run.run_id if choice.run else None, choice.stage) == ("b-short", 1)
    text = "\n".join(choice.reasons)
    assert choice.reasons[0].startswith("b-short: chosen: stage 1 has 1 of the 2 peers"), text
    assert "c-closed: passed over: closed" in text and "d-big: passed over: stage 0 does not fit" in text
    assert "a-full: passed over" in text
    nothing = choose(Catalog((runs[2], runs[3]), 0), check)
    assert nothing.run is None and len(nothing.reasons) == 2
    assert choose(Catalog((), 0), check).reasons == ("no runs listed on this DHT",)
