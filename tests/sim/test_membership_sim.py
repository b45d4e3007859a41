"""The membership simulator (noloco_swarm/sim/membership.py): our view rules over a modelled DHT."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from noloco_swarm.protocol.membership import BUCKET_PEERS, CORROBORATION, MONITORS
from noloco_swarm.sim.membership import KEY_OVERHEAD, Churn, Dht, Model, Partition, Scenario, simulate

QUIET = Scenario(peers=8, rounds=6)


def test_a_quiet_swarm_agrees_every_round_and_its_dht_traffic_adds_up() -> None:
    row = simulate(QUIET)
    assert row["rounds"] == 6 and row["rounds_all_agree"] == 6
    assert row["longest_split_rounds"] == 0 and row["stalls"] == 0 and row["samples_lost"] == 0
    # every peer-round: one read of two keys, and a heartbeat every 10 s of the 60 s round
    heartbeats = QUIET.round_seconds / QUIET.heartbeat_seconds
    assert row["dht_ops_per_peer_round"] == pytest.approx(2 + heartbeats)
    value = QUIET.peers * QUIET.announcement_bytes  # no reports: the value is every announcement
    read = 2 * KEY_OVERHEAD + value * QUIET.dht.replicas
    beats = heartbeats * (QUIET.announcement_bytes + KEY_OVERHEAD) * QUIET.dht.replicas
    assert row["dht_bytes_per_peer_round"] == pytest.approx(read + beats)
    # a node holding the run's keys serves every read and takes every heartbeat
    assert row["busiest_dht_node_bytes_per_round"] == pytest.approx(
        QUIET.peers * (value + heartbeats * QUIET.announcement_bytes)
    )


def test_a_crashed_peer_leaves_every_view_at_the_same_boundary() -> None:
    crash = Scenario(peers=8, rounds=8, faults=((130.0, "crash", 5),))
    model = Model(crash)
    row = model.run()
    assert row["rounds_all_agree"] == 8
    survivors = [p for p in model.peers if p.name != "p0005"]
    assert all("p0005" not in p.views[8].members() for p in survivors)
    # its neighbours (stages 0 and 2) found it first; once its announcement expired, everyone
    # whose read lacked it probed it and reported it too
    first = min((record.at, reporter) for record, peer, reporter, _ in model.reports if peer == "p0005")
    assert int(first[1][1:]) % 4 in {0, 2}


def test_a_graceful_leaver_and_a_joiner_enter_and_leave_in_agreement() -> None:
    churn = Scenario(peers=8, rounds=10, faults=((100.0, "leave", 2), (150.0, "join", 0)))
    model = Model(churn)
    row = model.run()
    assert row["rounds_all_agree"] == 10 and row["stalls"] == 0
    final = {p.views[10].digest() for p in model.peers if p.runs(600.0) and 10 in p.views}
    assert len(final) == 1
    view = next(p.views[10] for p in model.peers if 10 in p.views)
    assert "p0002" not in view.members() and "p0008" in view.members()
    assert row["joins"] == 1 and row["join_seconds_median"] is not None


def test_a_joiner_that_some_peers_read_late_splits_the_views_only_until_they_read_it() -> None:
    late = Scenario(
        peers=16, rounds=12, dht=Dht(late=0.3, late_rounds=2), faults=((150.0, "join", 0), (200.0, "join", 0))
    )
    row = simulate(late)
    assert row["longest_split_rounds"] <= 2 + 1  # the late readers admit it once they read it
    assert row["rounds_all_agree"] >= 12 - 2 * 3


def test_runs_are_reproducible_and_a_partition_evicts_the_cut_off_side_which_rejoins() -> None:
    cut = Scenario(peers=16, rounds=14, partitions=(Partition(start=300.0, seconds=90.0, share=0.3),), seed=3)
    first, second = simulate(cut), simulate(cut)
    assert first == second
    assert first["joins"] > 0  # the cut-off peers were reported gone and joined again
    model = Model(cut)
    model.run()
    final = {p.views[14].digest() for p in model.peers if p.runs(14 * 60.0) and 14 in p.views}
    assert len(final) == 1


def test_a_leaver_stays_out_while_its_announcement_outlives_rounds_shorter_than_its_ttl() -> None:
    """Rounds of 10 s against a 30 s TTL: the leaver's announcement is still listed rounds after
    the views dropped it, and only its own report keeps it out (nobody else reports a leaver)."""
    short = Scenario(peers=8, rounds=12, round_seconds=10.0, faults=((25.0, "leave", 3),))
    model = Model(short)
    row = model.run()
    assert row["rounds_all_agree"] == 12 and row["stalls"] == 0
    assert {reporter for _, peer, reporter, _ in model.reports if peer == "p0003"} == {"p0003"}
    assert all("p0003" not in p.views[12].members() for p in model.peers if 12 in p.views)
    assert all("p0003" in p.views[3].members() for p in model.peers if 3 in p.views)


def test_churn_at_scale_on_a_fast_dht_splits_rarely_and_briefly() -> None:
    busy = Scenario(
        peers=64,
        rounds=10,
        churn=Churn(
            crashes_per_hour=0.5, leaves_per_hour=0.5, stalls_per_hour=0.5, joins_per_hour=1.0, stragglers=0.2
        ),
    )
    row = simulate(busy)
    assert row["joins"] > 0
    assert row["rounds_all_agree"] >= 8 and row["longest_split_rounds"] <= 2, row


@pytest.mark.parametrize("spread", ["swap", "gossip"])
def test_records_passed_between_members_heal_a_failed_read_by_the_next_boundary(spread: str) -> None:
    """A peer whose boundary read fails keeps its members while the others admit joiners and drop
    the dead: a split of one round at least. Taking a neighbour's read instead (both designs of
    Scenario.records) leaves none."""
    fails = Scenario(
        peers=16,
        rounds=12,
        dht=Dht(read_fail=0.2),
        faults=((150.0, "join", 0), (250.0, "crash", 5), (330.0, "join", 0)),
    )
    today = simulate(fails)
    assert today["stalls"] > 0 and today["longest_split_rounds"] >= 1, today
    healed = simulate(dataclasses.replace(fails, records=spread))
    assert healed["longest_split_rounds"] == 0 and healed["stalls"] == 0, healed
    assert healed["passed_bytes_per_peer_round"] > 0


def test_gossip_heals_stores_two_rounds_late_where_a_swap_between_disagreeing_members_does_not() -> None:
    """Records that reach a third of their readers two rounds late split today's views for up to
    three rounds. Members that disagree swapping what they have heal most of it, but a member whose
    neighbours lacked the record too keeps it apart one more round; members passing every record
    on along the round's traffic (gossip) agree at every boundary."""
    late = Scenario(
        peers=16,
        rounds=14,
        dht=Dht(late=0.3, late_rounds=2),
        faults=((150.0, "join", 0), (200.0, "join", 0), (420.0, "crash", 3)),
    )
    rows = {
        spread: simulate(dataclasses.replace(late, records=spread)) for spread in ("dht", "swap", "gossip")
    }
    assert rows["dht"]["longest_split_rounds"] >= 2, rows["dht"]
    assert rows["swap"]["stalls"] < rows["dht"]["stalls"] and rows["swap"]["longest_split_rounds"] >= 1, rows
    assert rows["gossip"]["longest_split_rounds"] == 0 and rows["gossip"]["stalls"] == 0, rows["gossip"]


def test_an_unknown_way_of_spreading_records_is_refused() -> None:
    with pytest.raises(ValueError, match="records='rumour'"):
        Scenario(peers=8, records="rumour")


def test_a_spread_directory_keeps_each_peers_dht_load_flat_as_the_swarm_grows() -> None:
    """Directory "spread" (issue 36, item 4): no whole read, heartbeats to a key per bucket of
    BUCKET_PEERS members, audits. In a quiet swarm each peer's DHT traffic is its heartbeats and
    its audits at any N, and the busiest node holds a few buckets' keys, not every peer's: from 32
    to 128 peers neither grows with N, where the whole layout grows both (per peer as N, the
    busiest node as N squared)."""
    rows = {
        (n, d): simulate(Scenario(peers=n, rounds=6, records="gossip", directory=d))
        for n in (32, 128)
        for d in ("whole", "spread")
    }
    heartbeats = QUIET.round_seconds / QUIET.heartbeat_seconds
    beats = heartbeats * (QUIET.announcement_bytes + KEY_OVERHEAD) * QUIET.dht.replicas
    for n in (32, 128):
        row = rows[(n, "spread")]
        assert row["rounds_all_agree"] == 6 and row["stalls"] == 0, row
        assert row["dht_ops_per_peer_round"] == pytest.approx(heartbeats + QUIET.audits)
        assert row["dht_bytes_per_peer_round"] == pytest.approx(
            beats + QUIET.audits * (KEY_OVERHEAD + QUIET.announcement_bytes * QUIET.dht.replicas)
        )
    busiest = {key: row["busiest_dht_node_bytes_per_round"] for key, row in rows.items()}
    bucket = BUCKET_PEERS * heartbeats * QUIET.announcement_bytes  # one full bucket's heartbeats
    assert busiest[(32, "spread")] >= bucket, busiest  # a node of a full bucket takes all of them
    assert busiest[(128, "spread")] < 1.5 * busiest[(32, "spread")], busiest
    assert busiest[(128, "spread")] <= 3 * bucket, busiest  # a few buckets (and audits) at most
    assert busiest[(128, "whole")] > 10 * busiest[(32, "whole")], busiest
    per_peer = {key: row["dht_bytes_per_peer_round"] for key, row in rows.items()}
    assert per_peer[(128, "whole")] > 3 * per_peer[(32, "whole")], per_peer


def test_a_spread_directory_drops_a_crashed_peer_in_agreement_with_fewer_reports() -> None:
    """With no whole read a crashed peer is found by its neighbours and by audits, not by every
    member whose read lacks it once its announcement expires: fewer reports, the same views."""
    crash = Scenario(peers=16, rounds=10, records="gossip", directory="spread", faults=((130.0, "crash", 5),))
    model = Model(crash)
    row = model.run()
    assert row["rounds_all_agree"] == 10 and row["stalls"] == 0, row
    assert all("p0005" not in p.views[10].members() for p in model.peers if p.name != "p0005")
    whole = Model(dataclasses.replace(crash, directory="whole"))
    whole.run()
    filed = {m: sum(peer == "p0005" for _, peer, _, _ in m.reports) for m in (model, whole)}
    assert CORROBORATION <= filed[model] < filed[whole], filed


def test_a_spread_directory_heals_a_partition_as_the_whole_one_does() -> None:
    """A quarter of the swarm cut off for 90 s: each side reports the other, and credible_gone
    lets the side with more reporters stand (docs/membership.md). (Capping the reports filed per
    accused at CORROBORATION, a reporter reading the accused's key and filing only while fewer
    stand, tied the two sides, and every peer of both left; monitors cap them otherwise: below.)"""
    cut = Scenario(
        peers=32,
        rounds=16,
        records="gossip",
        directory="spread",
        partitions=(Partition(start=240.0, seconds=90.0, share=0.25),),
    )
    row = simulate(cut)
    assert row["rounds_all_agree"] == 16 and row["stalls"] == 0, row


def test_monitors_file_fewer_reports_and_still_heal_a_partition() -> None:
    """Scenario.reporters "monitors" (the peer since 2026-12-07): only a peer's monitors report it
    (protocol.membership.monitors: MONITORS of the stages next to it, and its own stage), not
    every member that finds it. At N = 128 (64 members next to each stage but the ends), with a
    quarter cut off: every round agrees and the cut-off side rejoins, as when everyone reports,
    from fewer reports, and no peer is reported in a round by more than its monitors."""
    cut = Scenario(
        peers=128,
        rounds=8,
        records="gossip",
        directory="spread",
        audits=0,
        partitions=(Partition(start=240.0, seconds=90.0, share=0.25),),
    )
    models = {who: Model(dataclasses.replace(cut, reporters=who)) for who in ("all", "monitors")}
    rows = {who: model.run() for who, model in models.items()}
    for who, row in rows.items():
        assert row["rounds_all_agree"] == 8 and row["stalls"] == 0, (who, row)
        assert row["joins"] > 24, (who, row)  # the cut-off quarter rejoined
    assert rows["monitors"]["gone_reports"] < 0.8 * rows["all"]["gone_reports"], rows
    filed = {
        who: Counter((peer, round_) for _, peer, reporter, round_ in m.reports if peer != reporter)
        for who, m in models.items()
    }
    assert max(filed["monitors"].values()) <= MONITORS < max(filed["all"].values()), filed
    with pytest.raises(ValueError, match="reporters='some'"):
        Scenario(peers=8, reporters="some")


def test_a_spread_directory_needs_gossip_and_a_known_layout() -> None:
    with pytest.raises(ValueError, match="gossip"):
        Scenario(peers=8, directory="spread")
    with pytest.raises(ValueError, match="directory='flat'"):
        Scenario(peers=8, records="gossip", directory="flat")


def test_a_joiner_that_asks_a_member_reads_one_bucket_and_still_enters_in_agreement() -> None:
    """join="member" (the peer since 2026-12-07; issue 36, item 4): a joiner asks members for their
    neighbourhood, reads at most one bucket of its stage's places to find a member of its stage,
    and hands its announcement to a few members; gossip takes it to the rest. Every joiner
    enters, every round agrees, and a join costs the DHT at most one key's read, where a whole
    read costs every bucket's."""
    joins = tuple((150.0 + 30.0 * i, "join", 0) for i in range(6))
    base = Scenario(peers=64, rounds=10, records="gossip", directory="spread", audits=0, faults=joins)
    models = {join: Model(dataclasses.replace(base, join=join)) for join in ("whole", "member")}
    rows = {join: model.run() for join, model in models.items()}
    for join, row in rows.items():
        assert row["rounds_all_agree"] == 10 and row["stalls"] == 0, (join, row)
        assert row["joins"] == 6, (join, row)
    # The joiners' own DHT traffic: their heartbeats, and each join's reads.
    joiners = {j: [p.name for p in m.peers if p.index >= base.peers] for j, m in models.items()}
    ops = {j: sum(models[j].ops[name] for name in joiners[j]) for j in models}
    read = {j: sum(models[j].bytes[name] for name in joiners[j]) for j in models}
    assert ops["member"] < ops["whole"] and read["member"] < read["whole"], (ops, read)
    busiest = {j: row["busiest_dht_node_bytes_per_round"] for j, row in rows.items()}
    assert busiest["member"] <= busiest["whole"], busiest
    with pytest.raises(ValueError, match="directory must be 'spread'"):
        Scenario(peers=8, records="gossip", join="member")
    with pytest.raises(ValueError, match="join='rumour'"):
        Scenario(peers=8, join="rumour")
