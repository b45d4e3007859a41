"""peer/net/streams.py's finiteness check, which every received float tensor passes as it lands."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from noloco_swarm.peer.net.streams import check_finite
from noloco_swarm.protocol.plausible import Implausible

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    size=st.integers(1, 5000),
    bad=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.sampled_from(["nan", "inf", "-inf"])), max_size=3
    ),
    extreme=st.booleans(),
)
def test_a_tensor_is_refused_exactly_when_it_holds_nan_or_inf(dtype, size, bad, extreme) -> None:
    tensor = torch.randn(size, dtype=torch.float64).to(dtype)
    if extreme:  # the largest finite values pass: nothing is summed that could overflow
        tensor[0], tensor[-1] = torch.finfo(dtype).max, torch.finfo(dtype).min
    for where, value in bad:
        tensor[int(where * size)] = float(value)
    if bad:
        with pytest.raises(Implausible) as e:
            check_finite(tensor)
        assert e.value.reason == "nonfinite"
    else:
        check_finite(tensor)


def test_empty_and_integer_tensors_pass() -> None:
    check_finite(torch.empty(0))
    check_finite(torch.empty(0, 3, dtype=torch.bfloat16))
    check_finite(torch.tensor([-128, 127], dtype=torch.int8))  # int8 rows: no NaN to hold
