"""Inner-step bookkeeping of a stage replica: who sends us which samples, and collecting them.

Replica q of stage s > 0 receives, for inner step t, the samples whose route sends them to q: for
batch position i (sample k = t*B + i) the senders are `routing.senders_uneven(k, s-1, ...)` (one
sender per position when the stages have equal replica counts, as in the official code). The
collector gathers those rows as forward requests arrive, in any order, and the batch is run in
(position, sender) order, so arrival order never changes the result.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from noloco_swarm.protocol import routing
from noloco_swarm.protocol.messages import MessageError


def expected_rows(step: int, batch: int, hop: int, counts: list[int], rank: int) -> list[tuple[int, int]]:
    """(position, sender rank) of every sample replica `rank` of stage hop+1 receives at `step`."""
    rows = []
    for i in range(batch):
        k = routing.sample_index(step, i, batch)
        for sender in routing.senders_uneven(k, hop, len(counts), counts[hop], counts[hop + 1], rank):
            rows.append((i, sender))
    return rows


def outgoing(step: int, batch: int, hop: int, counts: list[int], rank: int) -> dict[int, list[int]]:
    """receiver rank -> positions (ascending) that replica `rank` of stage `hop` sends at `step`."""
    out: dict[int, list[int]] = {}
    for i in range(batch):
        k = routing.sample_index(step, i, batch)
        receiver = routing.route_uneven(k, hop, len(counts), counts[hop], counts[hop + 1])[rank]
        out.setdefault(receiver, []).append(i)
    return out


@dataclass
class Arrival:
    """One forward request's rows, waiting for the batch to run and its gradients to return."""

    sender: int
    positions: list[int]
    activations: torch.Tensor
    tokens: torch.Tensor
    result: asyncio.Future[tuple[torch.Tensor, list[float]]] = field(default_factory=asyncio.Future)


class StepCollector:
    """Rows for one inner step of one receiving replica; complete when every expected row is in."""

    def __init__(self, step: int, expected: list[tuple[int, int]]) -> None:
        self.step = step
        self.expected = set(expected)
        self.arrivals: dict[int, Arrival] = {}
        self.complete = asyncio.Event()
        if not self.expected:
            self.complete.set()

    def add(self, arrival: Arrival) -> None:
        """Accept one sender's rows; a sender that sends twice, or rows we do not expect, is refused."""
        if arrival.sender in self.arrivals:
            raise MessageError(f"sender {arrival.sender} already sent step {self.step}")
        rows = {(i, arrival.sender) for i in arrival.positions}
        if not rows <= self.expected or len(rows) != len(arrival.positions):
            raise MessageError(f"sender {arrival.sender} sent positions {arrival.positions} we do not expect")
        mine = {(i, s) for i, s in self.expected if s == arrival.sender}
        if rows != mine:
            raise MessageError(f"sender {arrival.sender} sent {sorted(rows)}, the route gives {sorted(mine)}")
        self.arrivals[arrival.sender] = arrival
        if {(i, a.sender) for a in self.arrivals.values() for i in a.positions} == self.expected:
            self.complete.set()

    def drop_sender(self, sender: int) -> None:
        """Stop expecting rows from a sender that is gone; the step runs with the rest."""
        if sender in self.arrivals:
            return
        self.expected = {(i, s) for i, s in self.expected if s != sender}
        if {(i, a.sender) for a in self.arrivals.values() for i in a.positions} == self.expected:
            self.complete.set()

    def missing_senders(self) -> list[int]:
        """Senders we expect rows from and have not heard from."""
        return sorted({s for _, s in self.expected} - set(self.arrivals))

    def batch(self) -> tuple[torch.Tensor, torch.Tensor, list[tuple[Arrival, list[int]]]]:
        """Inputs and targets in (position, sender) order, and where each arrival's rows landed."""
        order = sorted((i, a.sender, j) for a in self.arrivals.values() for j, i in enumerate(a.positions))
        acts = torch.stack([self.arrivals[s].activations[j] for _, s, j in order])
        toks = torch.stack([self.arrivals[s].tokens[j] for _, s, j in order])
        rows: dict[int, list[int]] = {}
        for row, (_, s, _) in enumerate(order):
            rows.setdefault(s, []).append(row)
        return acts, toks, [(self.arrivals[s], r) for s, r in sorted(rows.items())]

    def fail(self, error: BaseException) -> None:
        for arrival in self.arrivals.values():
            if not arrival.result.done():
                arrival.result.set_exception(error)
                arrival.result.exception()  # retrieved: the caller may have given up already
