"""Who reports a member gone: its monitors (protocol.membership.monitors), and the peer that
files reports only as one of them (views.Rounds.files)."""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

from noloco_swarm.peer import events
from noloco_swarm.peer.views import Rounds
from noloco_swarm.protocol import records
from noloco_swarm.protocol.membership import MONITORS, MembershipView, credible_gone, monitors


def view_of(replicas: int, stages: int = 4, round_: int = 7) -> MembershipView:
    ids = [(f"p{s}-{i:03d}", s) for s in range(stages) for i in range(replicas)]
    return MembershipView.from_announcements(round_, stages, ids)


def test_in_a_small_swarm_every_member_of_a_stage_or_next_to_it_monitors_a_peer() -> None:
    view = view_of(4)  # 8 members in the stages next to any stage
    assert monitors(view, "p1-002") == {p for s in (0, 1, 2) for p in view.stages[s] if p != "p1-002"}
    assert monitors(view, "p0-000") == (set(view.stages[0]) | set(view.stages[1])) - {"p0-000"}
    assert monitors(view, "not-a-member") == set()
    one_stage = view_of(40, stages=1)
    assert monitors(one_stage, "p0-000") == set(one_stage.stages[0]) - {"p0-000"}


def test_in_a_large_swarm_a_peer_has_at_most_monitors_of_the_stages_next_to_it() -> None:
    view = view_of(250)
    watchers = monitors(view, "p1-100")
    near = [p for p in watchers if p[1] in "02"]
    assert len(near) == MONITORS
    assert set(watchers) - set(near) == set(view.stages[1]) - {"p1-100"}  # its own stage, all
    assert monitors(view_of(250), "p1-100") == watchers  # every member names the same ones


def test_a_peers_monitors_stay_put_as_others_come_and_go() -> None:
    view = view_of(100)
    watchers = monitors(view, "p2-050") - set(view.stages[2])
    others = [p for s in (1, 3) for p in view.stages[s] if p not in watchers]
    a_monitor = sorted(watchers)[0]

    def without(gone: set[str]) -> MembershipView:
        return MembershipView(8, tuple(tuple(p for p in s if p not in gone) for s in view.stages))

    left = set(others[:30])
    assert monitors(without(left), "p2-050") - set(view.stages[2]) == watchers
    replaced = monitors(without({a_monitor}), "p2-050") - set(view.stages[2])
    assert len(replaced) == MONITORS and len(replaced - watchers) == 1 and a_monitor not in replaced


def test_monitors_still_tell_the_cut_off_quarter_of_a_thousand_apart() -> None:
    """A quarter of 1,000 peers (4 stages) cut off: every monitor in a stage next to a peer across
    the cut reports it, from both sides, as routing finds them. credible_gone judges the cut-off
    quarter gone and nobody else, from about MONITORS reports per accused instead of N/2."""
    view = view_of(250)
    members = sorted(view.members())
    cut = {p for p in members if hashlib.sha256(p.encode()).digest()[0] < 64}
    stage = {p: s for s, peers in enumerate(view.stages) for p in peers}
    reports = []
    for peer in members:
        for watcher in monitors(view, peer):
            if abs(stage[watcher] - stage[peer]) == 1 and (watcher in cut) != (peer in cut):
                reports.append((peer, watcher, 4))
    assert len(reports) < MONITORS * len(members)
    assert set(credible_gone(reports)) == cut


class Directory:
    run_id, identity = "run", None

    def __init__(self) -> None:
        self.stored: list[records.GoneReport] = []

    def report_gone(self, report: records.GoneReport) -> bool:
        self.stored.append(report)
        return True


def test_a_member_reports_a_peer_that_failed_it_only_as_one_of_its_monitors() -> None:
    view = view_of(40, stages=3)
    me = "p1-000"
    theirs = [p for p in view.stages[2] if me not in monitors(view, p)]
    mine = [p for p in view.stages[2] if me in monitors(view, p)]
    assert theirs and mine
    directory = Directory()
    transport = SimpleNamespace(peer_id=me, register=lambda verb, handler: None)

    async def fail_both() -> Rounds:
        rounds = Rounds(me, 1, 3, transport, directory, events.Events())  # type: ignore[arg-type]
        await rounds.passing.close()  # it passes records to nobody here
        rounds.set(view)
        rounds.mark_dead(theirs[0], "failed a forward")
        rounds.mark_dead(mine[0], "failed a forward")
        rounds.mark_dead("p1-001", "failed our outer exchange")  # our stage: always
        await rounds.close()
        return rounds

    rounds = asyncio.run(fail_both())
    assert set(rounds.dead) == {theirs[0], mine[0], "p1-001"}  # routed around, all three
    assert rounds.filed == {mine[0], "p1-001"}
    assert sorted(r.peer_id for r in directory.stored) == sorted([mine[0], "p1-001"])
    assert all(r.reporter == me and r.round == view.round for r in directory.stored)
