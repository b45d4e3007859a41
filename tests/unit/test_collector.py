"""A receiving replica's collector of one step's rows: arrival order, resent rows, abandonment."""

from __future__ import annotations

import asyncio

import pytest
import torch

from noloco_swarm.peer.inner import Arrival, StepCollector
from noloco_swarm.peer.streams import Refused
from noloco_swarm.protocol.messages import MessageError
from noloco_swarm.protocol.plan import Incoming, Row


def expected() -> tuple[Incoming, ...]:
    """Step 0's plan for one receiver: sender 1's row 2, then sender 0's rows 0 and 1."""
    return (
        Incoming(sender=1, row=Row(position=2, origin=1)),
        Incoming(sender=0, row=Row(position=0, origin=0)),
        Incoming(sender=0, row=Row(position=1, origin=0)),
    )


def arrival(sender: int, positions: list[int], seed: int = 0) -> Arrival:
    gen = torch.Generator().manual_seed(seed)
    n = len(positions)
    return Arrival(
        sender, positions, torch.randn(n, 4, generator=gen), torch.randint(0, 9, (n, 4), generator=gen)
    )


def test_rows_run_in_the_plans_order_whatever_order_they_arrive_in() -> None:
    async def main() -> None:
        collector = StepCollector(0, expected())
        first, second = arrival(0, [0, 1], seed=1), arrival(1, [2], seed=2)
        assert collector.add(first) is first and not collector.complete.is_set()
        assert collector.add(second) is second and collector.complete.is_set()
        acts, toks, placement = collector.batch()
        assert torch.equal(acts, torch.cat([second.activations, first.activations]))
        assert torch.equal(toks, torch.cat([second.tokens, first.tokens]))
        assert placement == [(first, [1, 2]), (second, [0])]

    asyncio.run(main())


def test_the_same_rows_sent_again_wait_for_the_first_arrivals_answer() -> None:
    """A sender whose stream broke before our answer sends its rows once more: it must get the
    answer of the rows already held, not a refusal (which would drop them)."""

    async def main() -> None:
        collector = StepCollector(0, expected())
        first = arrival(0, [0, 1], seed=1)
        collector.add(first)
        again = arrival(0, [0, 1], seed=1)
        assert collector.add(again) is first
        assert collector.missing_senders() == [1]

    asyncio.run(main())


def test_other_rows_for_a_step_already_sent_or_positions_off_the_plan_are_refused() -> None:
    async def main() -> None:
        collector = StepCollector(0, expected())
        collector.add(arrival(0, [0, 1], seed=1))
        with pytest.raises(MessageError, match="other rows"):
            collector.add(arrival(0, [0, 1], seed=3))
        with pytest.raises(MessageError, match="the plan gives"):
            collector.add(arrival(1, [0]))
        with pytest.raises(MessageError, match="the plan gives"):
            collector.add(arrival(2, [2]))

    asyncio.run(main())


def test_an_abandoned_step_refuses_its_waiting_senders_with_the_reason() -> None:
    async def main() -> None:
        collector = StepCollector(0, expected())
        waiting = arrival(0, [0, 1])
        collector.add(waiting)
        collector.abandon("this peer left the swarm's view and joins again")
        with pytest.raises(Refused) as refused:
            await waiting.result
        assert refused.value.code == "abandoned" and "joins again" in refused.value.reason

    asyncio.run(main())


def test_a_sender_that_is_gone_is_no_longer_waited_for() -> None:
    async def main() -> None:
        collector = StepCollector(0, expected())
        collector.add(arrival(1, [2]))
        collector.drop_sender(0)
        assert collector.complete.is_set() and [x.sender for x in collector.expected] == [1]

    asyncio.run(main())


def test_once_collected_only_rows_already_in_are_taken_again() -> None:
    """After the step was collected (its batch may be running), a sender whose stream broke
    still gets the answer of the rows it sent; rows that never came in are refused as late."""

    async def main() -> None:
        collector = StepCollector(0, expected())
        first = arrival(0, [0, 1], seed=1)
        collector.add(first)
        collector.closed = True
        assert collector.add(arrival(0, [0, 1], seed=1)) is first
        with pytest.raises(MessageError, match="after this replica had collected"):
            collector.add(arrival(1, [2]))

    asyncio.run(main())
