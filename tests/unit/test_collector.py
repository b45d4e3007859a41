"""A receiving replica's collector of one step's rows: arrival order, resent rows, abandonment."""

from __future__ import annotations

import asyncio

import pytest
import torch

from noloco_swarm.peer.collector import Arrival, StepCollector
from noloco_swarm.peer.net.streams import Refused
from noloco_swarm.protocol.codec import MessageError
from noloco_swarm.protocol.plan import Incoming, Row


def expected() -> tuple[Incoming, ...]:
    """Step 0's plan for one receiver, in (position, origin) order: sender 0's rows 0 and 1, then
    sender 1's row 2."""
    return (
        Incoming(sender=0, row=Row(position=0, origin=0)),
        Incoming(sender=0, row=Row(position=1, origin=0)),
        Incoming(sender=1, row=Row(position=2, origin=1)),
    )


def allowed(sender: int) -> list[Row]:
    return [x.row for x in expected() if x.sender == sender]


def arrival(sender: int, positions: list[int], seed: int = 0) -> Arrival:
    gen = torch.Generator().manual_seed(seed)
    n = len(positions)
    return Arrival(
        sender, positions, torch.randn(n, 4, generator=gen), torch.randint(0, 9, (n, 4), generator=gen)
    )


def test_rows_run_in_the_plans_order_whatever_order_they_arrive_in() -> None:
    async def main() -> None:
        collector = StepCollector(0, expected())
        first, second = arrival(1, [2], seed=2), arrival(0, [0, 1], seed=1)
        assert collector.add(first, allowed(first.sender)) is first and not collector.complete.is_set()
        assert collector.add(second, allowed(second.sender)) is second and collector.complete.is_set()
        acts, toks, placement, rows, _ = collector.batch()
        assert torch.equal(acts, torch.cat([second.activations, first.activations]))
        assert torch.equal(toks, torch.cat([second.tokens, first.tokens]))
        assert placement == [(second, [0, 1]), (first, [2])]
        assert rows == [x.row for x in expected()]

    asyncio.run(main())


def test_the_same_rows_sent_again_wait_for_the_first_arrivals_answer() -> None:
    """A sender whose stream broke before our answer sends its rows once more: it must get the
    answer of the rows already held, not a refusal (which would drop them)."""

    async def main() -> None:
        collector = StepCollector(0, expected())
        first = arrival(0, [0, 1], seed=1)
        collector.add(first, allowed(first.sender))
        again = arrival(0, [0, 1], seed=1)
        assert collector.add(again, allowed(again.sender)) is first
        assert collector.missing_senders() == [1]

    asyncio.run(main())


def test_other_rows_for_a_step_already_sent_or_positions_off_the_plan_are_refused() -> None:
    async def main() -> None:
        collector = StepCollector(0, expected())
        collector.add(arrival(0, [0, 1], seed=1), allowed(0))
        with pytest.raises(MessageError, match="other rows"):
            collector.add(arrival(0, [0, 1], seed=3), allowed(0))
        with pytest.raises(MessageError, match="the plan gives"):
            collector.add(arrival(1, [0]), allowed(1))
        with pytest.raises(MessageError, match="the plan gives"):
            collector.add(arrival(2, [2]), allowed(2))

    asyncio.run(main())


def test_an_abandoned_step_refuses_its_waiting_senders_with_the_reason() -> None:
    async def main() -> None:
        collector = StepCollector(0, expected())
        waiting = arrival(0, [0, 1])
        collector.add(waiting, allowed(waiting.sender))
        collector.abandon("this peer left the swarm's view and joins again")
        with pytest.raises(Refused) as refused:
            await waiting.result
        assert refused.value.code == "abandoned" and "joins again" in refused.value.reason

    asyncio.run(main())


def test_a_sender_that_is_gone_is_no_longer_waited_for() -> None:
    async def main() -> None:
        collector = StepCollector(0, expected())
        collector.add(arrival(1, [2]), allowed(1))
        collector.drop_sender(0)
        assert collector.complete.is_set() and [x.sender for x in collector.expected] == [1]

    asyncio.run(main())


def test_once_collected_only_rows_already_in_are_taken_again() -> None:
    """After the step was collected (its batch may be running), a sender whose stream broke
    still gets the answer of the rows it sent; rows that never came in are refused as late."""

    async def main() -> None:
        collector = StepCollector(0, expected())
        first = arrival(0, [0, 1], seed=1)
        collector.add(first, allowed(first.sender))
        collector.closed = True
        assert collector.add(arrival(0, [0, 1], seed=1), allowed(0)) is first
        with pytest.raises(MessageError, match="after this replica had collected"):
            collector.add(arrival(1, [2]), allowed(1))

    asyncio.run(main())


def test_a_stand_ins_rows_join_the_batch_in_row_order_and_fewer_rows_are_taken() -> None:
    """A sender standing in for a gone replica sends its own rows and the gone one's (the plan
    of its header allows them): they run with the rest in (position, origin) order. A sender that
    lost rows on an earlier hop sends a subsequence of what the plan allows; rows the plan does not
    allow, or out of order, are refused."""

    async def main() -> None:
        stand_in = [Row(0, 0), Row(1, 0), Row(1, 1), Row(3, 1)]  # its own rows and the gone one's
        collector = StepCollector(0, expected()[2:])  # we expected sender 1 only, then heard more
        collector.expect((*expected()[2:], *(Incoming(row, 0) for row in stand_in)))
        assert collector.missing_senders() == [0, 1]
        with pytest.raises(MessageError, match="the plan gives"):
            collector.add(arrival(0, [1, 0]), stand_in)  # out of order
        with pytest.raises(MessageError, match="the plan gives"):
            collector.add(arrival(0, [2]), stand_in)
        mine = arrival(0, [0, 1, 3], seed=4)  # row (1, 0) or (1, 1)? the first that fits: (1, 0)
        collector.add(mine, stand_in)
        assert mine.rows == [Row(0, 0), Row(1, 0), Row(3, 1)]
        other = arrival(1, [2], seed=5)
        collector.add(other, allowed(1))
        assert collector.complete.is_set()
        acts, _, placement, rows, _ = collector.batch()
        assert rows == [Row(0, 0), Row(1, 0), Row(2, 1), Row(3, 1)]
        assert torch.equal(acts, torch.cat([mine.activations[:2], other.activations, mine.activations[2:]]))
        assert placement == [(mine, [0, 1, 3]), (other, [2])]

    asyncio.run(main())


def test_learning_of_a_stand_in_keeps_what_came_and_senders_given_up_on() -> None:
    async def main() -> None:
        collector = StepCollector(0, expected())
        collector.add(arrival(1, [2]), allowed(1))
        collector.drop_sender(0)
        collector.expect((*expected(), Incoming(Row(4, 0), 0)))  # sender 0 is still gone
        assert collector.complete.is_set() and collector.missing_senders() == []

    asyncio.run(main())


def test_rows_of_a_sender_given_up_on_count_as_dropped_only_if_no_stand_in_brings_them() -> None:
    """A receiver that gives up on a dead sender may hear from its stand-in a moment later, with
    the dead one's rows beside its own (the stand-in learned of the death first): those rows ran,
    so they are not dropped. Only rows that never came count, known once the step is collected."""

    async def main() -> None:
        brought = StepCollector(0, expected())
        brought.drop_sender(1)  # silent, probed, dead: sender 0 is still awaited
        assert brought.never_came() == {1: 1} and not brought.complete.is_set()
        stand_in = [*allowed(0), Row(2, 1)]  # sender 0's plan, routing around sender 1
        brought.add(arrival(0, [0, 1, 2]), stand_in)
        assert brought.complete.is_set() and brought.never_came() == {}

        lost = StepCollector(0, expected())
        lost.add(arrival(0, [0, 1]), allowed(0))
        lost.drop_sender(1)
        lost.drop_sender(0)  # it came already: nothing to give up on
        assert lost.complete.is_set() and lost.never_came() == {1: 1}

    asyncio.run(main())
