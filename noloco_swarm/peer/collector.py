"""Collecting one inner step's rows on a receiving replica: each sender's arrival, matched to
the rows the step plan routes to us, and the batch they make (any arrival order, one batch order).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from noloco_swarm.peer.net.streams import Refused
from noloco_swarm.protocol.codec import MessageError
from noloco_swarm.protocol.plan import Incoming, Row


@dataclass
class Arrival:
    """One forward request's rows, waiting for the batch to run and its gradients to return."""

    sender: int
    positions: list[int]
    activations: torch.Tensor
    tokens: torch.Tensor
    # its rows' input gradients and losses, and which of its rows were lost further on
    result: asyncio.Future[tuple[torch.Tensor, list[float], tuple[int, ...]]] = field(
        default_factory=asyncio.Future
    )
    rows: list[Row] = field(default_factory=list)  # which rows of the plan these are (set by add)
    # sample indices of the rows of the step before that come first (peer/carry.py)
    carried: list[int] = field(default_factory=list)


Placement = list[tuple[Arrival, list[int]]]  # each arrival, and the rows of the batch its rows took


class StepCollector:
    """Rows for one inner step of one receiving replica; complete when every expected sender's
    rows are in.

    Each sender sends its rows for the step in one request: the ones the plan routes to us, and
    those of the replicas it routes around that we stand in for (its header says which). The
    batch runs every row that came in (position, origin) order, so arrival order never changes
    the result; on a healthy swarm these are exactly the plan's rows."""

    def __init__(
        self, step: int, expected: tuple[Incoming, ...], microbatch: int = 0, gone: Iterable[int] = ()
    ) -> None:
        self.step, self.microbatch = step, microbatch
        self.arrivals: dict[int, Arrival] = {}
        self.complete = asyncio.Event()
        self.closed = False  # collected: only resends of rows already in are accepted
        self.gone = set(gone)  # senders we stopped expecting
        self._gone_before = frozenset(gone)  # those gone before the step began
        self.given_up: dict[int, list[Row]] = {}  # senders we stopped waiting for: the rows we expected
        self.expect(expected)

    def rows_from(self, sender: int) -> list[Row]:
        return [x.row for x in self.expected if x.sender == sender]

    def expect(self, expected: tuple[Incoming, ...]) -> None:
        """Expect these rows (in the order the batch runs them) from every sender not gone; called
        again when we learn that a replica is routed around: what came stays."""
        self.expected = [x for x in expected if x.sender not in self.gone]
        # rows from senders gone before the step began, that no stand-in of theirs brings: lost
        self.unsent = [x for x in expected if x.sender in self._gone_before]
        self._check_complete()

    def add(self, arrival: Arrival, allowed: list[Row]) -> Arrival:
        """Accept one sender's rows and return the arrival whose result answers them. `allowed`:
        the rows the plan, as the sender's header describes it, routes from it to us.

        A sender whose stream broke before our answer sends the same rows again, before or after
        the step was collected: it then waits for the first arrival's result. Rows the plan does
        not route to us from this sender, different rows for the same step, or new rows once
        collected are refused, and so are rows another sender brought already. (A sender may
        send fewer rows than `allowed`: rows lost on an earlier hop.)"""
        rows = _matched(arrival.positions, allowed)
        if rows is None:
            raise MessageError(
                f"sender {arrival.sender} sent positions {arrival.positions}, the plan gives "
                f"{[row.position for row in allowed]}"
            )
        first = self.arrivals.get(arrival.sender)
        if first is not None:
            if not (
                first.positions == arrival.positions
                and first.carried == arrival.carried
                and torch.equal(first.activations, arrival.activations)
                and torch.equal(first.tokens, arrival.tokens)
            ):
                raise MessageError(f"sender {arrival.sender} sent other rows for step {self.step}")
            return first
        if self.closed:  # without this sender: gave up on it, thought it gone, or had a stand-in
            how = (
                "having marked their sender gone"
                if arrival.sender in self._gone_before
                else "without them"
                if arrival.sender in self.gone
                else "from a stand-in of their sender"
            )
            raise MessageError(
                f"rows for step {self.step} (microbatch {self.microbatch}) came after this replica "
                f"had collected them ({how})"
            )
        # Two senders with one row: a stage-0 replica believed gone (and stood in for) that runs.
        taken = {row for other in self.arrivals.values() for row in other.rows} & set(rows)
        if taken:
            raise MessageError(
                f"rows {sorted((r.position, r.origin) for r in taken)} of step {self.step} already "
                "came from another sender"
            )
        arrival.rows = rows
        self.arrivals[arrival.sender] = arrival
        self._check_complete()
        return arrival

    def drop_sender(self, sender: int) -> None:
        """Stop expecting rows from a sender that is gone; the step runs with the rest."""
        if sender not in self.arrivals:
            self.given_up.setdefault(sender, self.rows_from(sender))
            self.gone.add(sender)
            self.expected = [x for x in self.expected if x.sender != sender]
            self._check_complete()

    def routed_away(self, sender: int) -> None:
        """Stop expecting rows from a sender that routes them around us (it believes us gone: our
        stand-in takes them), without counting them as lost; the step runs with the rest."""
        if sender not in self.arrivals:
            self.gone.add(sender)
            self.expected = [x for x in self.expected if x.sender != sender]
            self._check_complete()

    def never_came(self) -> dict[int, int]:
        """Of the senders given up on, each one's count of expected rows that no arrival brought.
        A stand-in of a sender given up on may still bring its rows (it learned of the death
        first), so this is known only once the step is collected."""
        came = {row for arrival in self.arrivals.values() for row in arrival.rows}
        counts = {sender: sum(row not in came for row in rows) for sender, rows in self.given_up.items()}
        return {sender: n for sender, n in counts.items() if n}

    def missing_senders(self) -> list[int]:
        """Senders we expect rows from and have not heard from."""
        return sorted({x.sender for x in self.expected} - set(self.arrivals))

    def batch(self) -> tuple[torch.Tensor, torch.Tensor, Placement, list[Row], list[int]]:
        """Inputs and targets of every row that came: the carried rows in (sample, sender) order,
        then this step's in (position, origin) order; where each arrival's rows landed; this
        step's rows and the carried rows' sample indices, in that order."""
        carried = sorted(
            (k, arrival.sender, j)
            for arrival in self.arrivals.values()
            for j, k in enumerate(arrival.carried)
        )
        order = sorted(
            (row, arrival.sender, len(arrival.carried) + j)
            for arrival in self.arrivals.values()
            for j, row in enumerate(arrival.rows)
        )
        acts, toks, rows = [], [], {}
        for k, (_, sender, j) in enumerate([*carried, *order]):
            arrival = self.arrivals[sender]
            rows.setdefault(sender, []).append(k)  # an arrival's carried rows land before its others
            acts.append(arrival.activations[j])
            toks.append(arrival.tokens[j])
        placement = [(self.arrivals[s], r) for s, r in sorted(rows.items())]
        return (
            torch.stack(acts),
            torch.stack(toks),
            placement,
            [row for row, _, _ in order],
            [k for k, _, _ in carried],
        )

    def abandon(self, reason: str) -> None:
        """This step will not run here: refuse every sender still waiting for its gradients, now
        (they get an answer that says why, not a stream closed in their face)."""
        for arrival in self.arrivals.values():
            if not arrival.result.done():
                arrival.result.set_exception(Refused("abandoned", reason))
                arrival.result.exception()  # retrieved: the caller may have given up already

    def _check_complete(self) -> None:
        if {x.sender for x in self.expected} <= set(self.arrivals):
            self.complete.set()


def _matched(positions: list[int], allowed: list[Row]) -> list[Row] | None:
    """The rows of `allowed` (in order) whose positions are `positions`, taken in order; None if
    `positions` is not such a subsequence (or is empty)."""
    rows, k = [], 0
    for position in positions:
        while k < len(allowed) and allowed[k].position != position:
            k += 1
        if k == len(allowed):
            return None
        rows.append(allowed[k])
        k += 1
    return rows or None


def answer(x: torch.Tensor, placement: Placement, losses: list[float], lost: frozenset[int]) -> None:
    """Answer every arrival of a batch that ran with its rows' input gradients and losses (one per
    row of the batch), naming its rows that were lost further on (`lost`: rows of the batch)."""
    assert x.grad is not None
    x_grad = x.grad.cpu()  # replies leave from the CPU
    for arrival, rows in placement:
        if not arrival.result.done():  # the sender may have given up on us meanwhile
            gone = tuple(i for i, r in enumerate(rows) if r in lost)
            arrival.result.set_result((x_grad[rows].contiguous(), [losses[r] for r in rows], gone))
