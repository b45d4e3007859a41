"""Rows fed again one step later (peer/carry.py): where they ride, and when they are fed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from noloco_swarm.peer.carry import Carry, along


def test_carried_rows_ride_first_and_cyclically_with_the_receivers_of_this_steps_rows() -> None:
    # 3 carried rows; this step's rows 0, 2 go to receiver 1 and row 1 to receiver 0
    assert along({1: [0, 2], 0: [1]}, 3) == {0: [0, 2, 4], 1: [1, 3, 5]}
    assert along({1: [0, 1]}, 0) == {1: [0, 1]}  # healthy: the plan's routes, untouched
    with pytest.raises(ValueError, match="need a receiver"):
        along({}, 1)


@given(
    st.dictionaries(st.integers(0, 5), st.integers(1, 4), min_size=1, max_size=4),
    st.integers(0, 9),
)
def test_every_row_goes_to_exactly_one_receiver(counts: dict[int, int], carried: int) -> None:
    planned, j = {}, 0
    for receiver, n in sorted(counts.items()):
        planned[receiver] = list(range(j, j + n))
        j += n
    routes = along(planned, carried)
    sent = sorted(i for rows in routes.values() for i in rows)
    assert sent == list(range(carried + j))
    assert set(routes) == set(planned)
    for receiver, rows in routes.items():
        assert rows == sorted(rows)  # carried rows (the lowest indices) first
        assert [i - carried for i in rows if i >= carried] == planned[receiver]


def test_rows_kept_at_one_step_are_fed_at_the_next_only_and_once() -> None:
    carry = Carry()
    w = [torch.full((5,), float(k)) for k in range(3)]
    carry.keep(4, [41, 40, 43], w)
    samples, windows = carry.take(5)
    assert samples == [40, 41, 43] and windows is not None
    assert windows[:, 0].tolist() == [1.0, 0.0, 2.0]  # in ascending sample order
    assert carry.take(5) == ([], None)  # taken once
    carry.keep(6, [60], w[:1])
    assert carry.take(8) == ([], None)  # a gap (a rejoin): nothing is fed
    assert carry.take(7) == ([], None)
