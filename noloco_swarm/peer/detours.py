"""Whom a peer routes rows around: replicas that failed it, and what it heard.

A replica that is gone but still in the round's view (the swarm drops it from the view only two
boundaries after its death is reported) gets no rows: the step plan gives them to its stand-in
(protocol.plan, `StepPlan.around`). A gone stage-0 replica has no rows to get: the stage-0 replica
that stands in for it reads them from its shard. A sender routes around the replicas that failed
it itself (`Liveness.dead`: next-stage replicas, and on stage 0 replicas of its own stage) and says
so in its forward headers. A receiver believes what headers say for the round they were said in
and the next, to know whose rows to wait for; it never routes around a replica only because it
heard so, so that a wrong belief cannot spread from peer to peer. (A stage-1 receiver that saw a
stage-0 sender die does not wait for a stand-in that has not said so either: only that stage's
replicas decide to stand in.)
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from noloco_swarm.protocol.membership import MembershipView

Place = tuple[int, int]  # (stage, rank) in one round's view
# A peer reported gone that answered our probe is not probed again on another report this soon
# (a lying reporter cannot make us probe a live peer at every step).
CLEARED_FOR = 15.0


class Detours:
    """One peer's record of whom rows are routed around."""

    def __init__(self, me: str, stage: int, dead: dict[str, int]) -> None:
        self.me, self.stage = me, stage
        self.dead = dead  # the peers that failed us (Liveness.dead, shared)
        self.heard: dict[str, int] = {}  # peer id -> the last round a header said it is routed around
        self._checks: dict[str, asyncio.Task[None]] = {}  # reported peers being probed
        self._cleared: dict[str, float] = {}  # peer id -> when a probe found it alive (monotonic)

    def around(self, view: MembershipView) -> frozenset[Place]:
        """The places in `view` of the replicas we route rows around: those that failed us, of
        stage 0 only if we are on stage 0 (we stand in for them)."""
        return frozenset(
            place
            for peer in self.dead
            if (place := _place(view, peer)) is not None and (place[0] > 0 or self.stage == 0)
        )

    def expected(self, view: MembershipView) -> frozenset[Place]:
        """What we believe the swarm routes around in `view`: `around`, and what headers said in
        this round or the last (so that we wait for the rows their stand-ins bring us)."""
        heard = {
            place
            for peer, said in self.heard.items()
            if said <= view.round <= said + 1 and (place := _place(view, peer)) is not None
        }
        return self.around(view) | heard

    def hear(self, view: MembershipView, places: Iterable[Place]) -> bool:
        """A header of `view`'s round says the replicas at `places` are routed around; True if
        that is news for this round (steps still collecting must expect anew)."""
        before = self.expected(view)
        for stage, rank in places:
            peer = view.peer_at(stage, rank)
            if peer == self.me:
                continue  # someone believes us gone: the views settle that, we train on
            self.heard[peer] = max(self.heard.get(peer, view.round), view.round)
        return self.expected(view) != before

    def check_reported(
        self,
        view: MembershipView,
        reports: Iterable[tuple[str, str, int]],
        suspect: Callable[[str, str], Awaitable[bool]],
    ) -> None:
        """Probe in the background the members of `view` reported gone whom we would route
        around if we knew: replicas of the next stage (we send them rows) and, on stage 0, of
        ours (we stand in for them). A report decides views only a round after it was filed
        (evidence.py); a replica found dead now is routed around from our next step on, not once
        its rows are lost or the views drop it. (`suspect`: Liveness.hearsay, which probes twice
        and marks the dead gone: any member's word and one lost probe must not evict a peer.)"""
        ours = {self.stage + 1, *([0] if self.stage == 0 else [])}
        members = view.members()
        for peer, reporter in sorted({(r[0], r[1]) for r in reports}):
            # a peer reporting itself leaves at a boundary (report_leaving): nothing is lost
            if peer != reporter and {peer, reporter} <= members and view.rank_of(peer)[0] in ours:
                self._check(peer, f"{reporter} reported it gone", suspect)

    def told_gone(
        self,
        view: MembershipView,
        ranks: Iterable[int],
        by: str,
        suspect: Callable[[str, str], Awaitable[bool]],
    ) -> None:
        """A stage-1 replica (`by`) answered our rows saying that the stage-0 replicas at `ranks`
        failed it: on stage 0, probe them in the background (`suspect`: Liveness.suspect, one
        probe: `by` waited on them and probed them itself, and we trust its rows as much) and
        stand in for the dead ones from our next step on. (Elsewhere, or for ranks `view` does
        not have, nothing happens.)"""
        if self.stage == 0:
            for rank in ranks:
                if rank < len(view.stages[0]):
                    self._check(view.peer_at(0, rank), f"{by} says it failed it", suspect)

    def _check(self, peer: str, why: str, suspect: Callable[[str, str], Awaitable[bool]]) -> None:
        """Probe `peer` in the background (not twice at once, nor again within CLEARED_FOR
        seconds of a probe it answered)."""
        if peer in self.dead or peer in self._checks or peer == self.me:
            return
        if time.monotonic() - self._cleared.get(peer, -math.inf) < CLEARED_FOR:
            return

        async def check() -> None:
            if not await suspect(peer, why):
                self._cleared[peer] = time.monotonic()

        task = asyncio.get_running_loop().create_task(check())
        self._checks[peer] = task
        task.add_done_callback(lambda _: self._checks.pop(peer, None))

    async def close(self) -> None:
        """Stop the probes of reported peers."""
        checks = list(self._checks.values())
        for task in checks:
            task.cancel()
        await asyncio.gather(*checks, return_exceptions=True)

    def forget(self, peer: str) -> None:
        """`peer` answers again (the swarm keeps it): nobody routes around it any more."""
        self.heard.pop(peer, None)

    def forget_all(self) -> None:
        """We rejoined with a donor's view: what we heard before is of no round we will run."""
        self.heard.clear()


def said_routing(
    detours: Detours, stage: int, view: MembershipView | None, sent: tuple[tuple[int, int], tuple[int, ...]]
) -> dict[str, Any]:
    """What our status answer says of our routing (rpc.PeerStatus): the places of `view` we route
    around, as a forward header of ours would (around_round, routes_around, stands_in), and the
    (step, microbatch) whose rows we sent on last with the ranks we sent them to (sent, sent_to)."""
    said: dict[str, Any] = {}
    if view is not None:
        places = detours.around(view)
        said["around_round"] = view.round
        said["routes_around"] = next_stage_ranks(places, stage)
        said["stands_in"] = tuple(sorted(r for s, r in places if s == stage == 0))
    (step, microbatch), receivers = sent
    if step >= 0:
        said["sent"], said["sent_to"] = (step, microbatch), receivers
    return said


def next_stage_ranks(places: Iterable[Place], stage: int) -> tuple[int, ...]:
    """The ranks of the stage after `stage` among `places`, ascending: whom a replica of `stage`
    routes around, as its forward headers and its status answer both say."""
    return tuple(sorted(r for s, r in places if s == stage + 1))


def _place(view: MembershipView, peer: str) -> Place | None:
    """Where `peer` is in `view`, if it is there."""
    return view.rank_of(peer) if peer in view.members() else None
