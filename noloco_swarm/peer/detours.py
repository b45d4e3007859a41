"""Whom a peer routes rows around: next-stage replicas that failed it, and what it heard.

A replica after stage 0 that is gone but still in the round's view (the swarm drops it from the
view only two boundaries after its death is reported) gets no rows: the step plan gives them to
its stand-in (protocol.plan, `StepPlan.around`). A sender routes around the replicas that failed
it itself (`Rounds.dead`) and says so in its forward headers. A receiver believes what headers
say for the round they were said in and the next, to know whose rows to wait for; it never routes
around a replica only because it heard so, so that a wrong belief cannot spread from peer to peer.
"""

from __future__ import annotations

from collections.abc import Iterable

from noloco_swarm.protocol.membership import MembershipView

Place = tuple[int, int]  # (stage, rank) in one round's view


class Detours:
    """One peer's record of whom rows are routed around."""

    def __init__(self, me: str, dead: dict[str, int]) -> None:
        self.me = me
        self.dead = dead  # the peers that failed us (Rounds.dead, shared)
        self.heard: dict[str, int] = {}  # peer id -> the last round a header said it is routed around

    def around(self, view: MembershipView) -> frozenset[Place]:
        """The places in `view`, after stage 0, of the replicas we route rows around: those that
        failed us."""
        return frozenset(place for peer in self.dead if (place := _place(view, peer)) is not None)

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
        news = False
        for stage, rank in places:
            peer = view.peer_at(stage, rank)
            if peer == self.me:
                continue  # someone believes us gone: the views settle that, we train on
            news |= self.heard.get(peer, -1) < view.round and peer not in self.dead
            self.heard[peer] = max(self.heard.get(peer, view.round), view.round)
        return news

    def forget(self, peer: str) -> None:
        """`peer` answers again (the swarm keeps it): nobody routes around it any more."""
        self.heard.pop(peer, None)

    def forget_all(self) -> None:
        """We rejoined with a donor's view: what we heard before is of no round we will run."""
        self.heard.clear()


def _place(view: MembershipView, peer: str) -> Place | None:
    """Where `peer` is in `view`, if it is there after stage 0."""
    if peer not in view.members():
        return None
    place = view.rank_of(peer)
    return place if place[0] > 0 else None
