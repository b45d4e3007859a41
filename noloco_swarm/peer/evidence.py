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
from noloco_swarm.protocol.membership import Judgement, MembershipView, Report

logger = logging.getLogger(__name__)


class Evidence:
    """One peer's judgement of the gone reports it reads (protocol.membership.Judgement, kept
    across boundaries), with the probes it asks for."""

    def __init__(self, me: str, sink: events.Events) -> None:
        self.me, self.events = me, sink
        self.judgement = Judgement()
        self.live: set[str] = set()  # the accused that answered at the last boundary

    @property
    def unheard(self) -> dict[str, int]:
        """reporter -> the round until which its reports are ignored."""
        return self.judgement.unheard

    async def weigh(
        self,
        current: MembershipView,
        joined: dict[str, int],
        reports: list[Report],
        alive: Callable[[str], Awaitable[bool]],
    ) -> list[Report]:
        """The reports that this boundary's view may act on, of those members filed (and ours):
        Judgement's rule, probing the doubtful accused with `alive`. `live` is left holding the
        accused that answered."""
        doubtful = self.judgement.doubtful(current, joined, reports)
        async with asyncio.TaskGroup() as group:
            probes = {peer: group.create_task(alive(peer)) for peer in sorted(doubtful - {self.me})}
        answered = {peer for peer, probe in probes.items() if probe.result()} | ({self.me} & doubtful)
        kept, voided = self.judgement.settle(current, joined, reports, answered, self.me)
        for peer, reporter, round_ in voided:
            logger.warning(
                "%s reported %s gone in round %d, but it answers: report ignored", reporter, peer, round_
            )
            self.events.emit(
                events.FalseReport(
                    reporter=reporter, peer=peer, round=round_, ignored_until=self.unheard.get(reporter, 0)
                )
            )
        self.live = answered - {self.me}
        return kept
