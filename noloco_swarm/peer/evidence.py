"""Which gone reports a peer believes: a member's word alone evicts nobody.

A gone report (peer/directory.py) is signed by its reporter, so nobody can file one in another's
name; but a member can still lie, or be wrong (its own link was down). So before a report of a
member takes effect at a boundary, every peer probes the accused itself (`Evidence.weigh`) unless
CORROBORATION members reported it: a peer that answers stays, the report is void for good, and its
reporter is struck; a member that keeps reporting live peers goes unheard for a while. Peers probe
the same accused at the same boundary, so their views agree unless the network lets some of them
reach it and not others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from noloco_swarm.peer import events
from noloco_swarm.protocol.membership import MembershipView

logger = logging.getLogger(__name__)
Report = tuple[str, str, int]  # (peer, reporter, round)
# Reports of one peer by this many distinct members stand without our probe: a peer cut off from
# the swarm (or frozen) answers again by the boundary, but everyone it failed has reported it, and
# it must leave (and rejoin) with all of them; two members would have to collude to evict one.
CORROBORATION = 2
# A member whose reports named this many live peers goes unheard for LIAR_ROUNDS rounds.
LIAR_STRIKES = 2
LIAR_ROUNDS = 20


class Evidence:
    """One peer's judgement of the gone reports it reads, kept across boundaries."""

    def __init__(self, me: str, sink: events.Events) -> None:
        self.me, self.events = me, sink
        self.voided: set[Report] = set()  # reports of peers that answered our probe
        self.strikes: dict[str, int] = {}  # reporter -> live peers it reported since its last sentence
        self.unheard: dict[str, int] = {}  # reporter -> the round until which its reports are ignored
        self.live: set[str] = set()  # the accused that answered at the last boundary

    async def weigh(
        self,
        current: MembershipView,
        joined: dict[str, int],
        reports: list[Report],
        alive: Callable[[str], Awaitable[bool]],
    ) -> list[Report]:
        """The reports that this boundary's view may act on, of those members filed (and ours).

        A report falls due once its round is over, if it is of a member and of a round at or
        after its membership began (`joined`: peer -> joined round, as listed): those are what
        `next_view` acts on. Reports of an accused whom CORROBORATION distinct members reported
        stand (of us too: the swarm has dropped us, we rejoin). Otherwise we probe the accused
        with `alive`: if it answers, its reports are void for good and their reporters struck;
        reports of us are void (we run). A peer reporting itself (it leaves) always stands. A
        reporter with LIAR_STRIKES
        strikes goes unheard (its reports dropped unprobed) for LIAR_ROUNDS rounds. `live` is
        left holding the accused that answered."""
        members, now = current.members(), current.round
        due = [
            r
            for r in reports
            if r[0] != r[1] and r[0] in members and joined.get(r[0], 0) <= r[2] < now and r not in self.voided
        ]
        unheard = {r for r in due if self.unheard.get(r[1], -1) >= now}
        reporters: dict[str, set[str]] = {}
        for peer, reporter, _ in set(due) - unheard:
            reporters.setdefault(peer, set()).add(reporter)
        doubtful = {peer for peer, who in reporters.items() if len(who) < CORROBORATION}
        async with asyncio.TaskGroup() as group:
            probes = {peer: group.create_task(alive(peer)) for peer in sorted(doubtful - {self.me})}
        answered = {peer for peer, probe in probes.items() if probe.result()} | ({self.me} & doubtful)
        for report in sorted(r for r in due if r[0] in answered):
            self._void(report, now)
        self.live = answered - {self.me}
        return [r for r in reports if r not in self.voided and r not in unheard]

    def _void(self, report: Report, now: int) -> None:
        peer, reporter, round_ = report
        self.voided.add(report)
        self.strikes[reporter] = self.strikes.get(reporter, 0) + (reporter != self.me)
        if self.strikes[reporter] >= LIAR_STRIKES:
            self.unheard[reporter] = now + LIAR_ROUNDS
            self.strikes[reporter] = 0
        logger.warning(
            "%s reported %s gone in round %d, but it answers: report ignored", reporter, peer, round_
        )
        self.events.emit(
            events.FalseReport(
                reporter=reporter, peer=peer, round=round_, ignored_until=self.unheard.get(reporter, 0)
            )
        )
