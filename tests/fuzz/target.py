"""What a fuzz target is, and the strategies that mutate bytes and msgpack values."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st


@dataclass(frozen=True)
class Target:
    """One decoder or handler under fuzzing."""

    name: str
    """`module.function[variant]`: what is fed, as docs/security.md lists it."""
    strategy: st.SearchStrategy[Any]
    check: Callable[[Any], None]
    """Feeds one input; returns if the contract held, raises (anything) if it did not."""
    contract: str
    """The documented outcome, for docs/security.md: what it may return and raise."""
    ci_examples: int = 100
    """Inputs per CI run (tests/unit/test_fuzz.py); the long run multiplies this."""


# Values msgpack can carry, with the edges a decoder must survive: 64-bit extremes, non-finite
# floats, long strings, bytes where text belongs, nesting.
INTS = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, -1, 1, 2**31, 2**32, 2**34, 2**63 - 1, 2**64 - 1, -(2**63)]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.sampled_from(["", "x" * 4097, "rpc_forward", "reply", "float32", "int8", "theta", "a" * 64]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated_bytes(draw: st.DrawFn, base: bytes) -> bytes:
    """`base` with a few byte-level edits: flips, inserts, deletions, truncation, duplication."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "duplicate"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[at:]
        elif op == "duplicate":
            data[at:at] = data[at : at + draw(st.integers(1, 16))]
    return bytes(data)
