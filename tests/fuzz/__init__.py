"""Fuzz targets for every decoder and RPC handler: an input strategy and a check of the contract.

A target's `check` either returns (the input was decoded into a valid object, or refused with the
decoder's documented error class) or raises AssertionError, or lets any other exception escape:
both are failures. tests/unit/test_fuzz.py runs each with a fixed budget; bench/fuzz.py runs them
for longer and writes the counts to docs/results/fuzz.json (docs/security.md, "Fuzzing").
"""

from __future__ import annotations

from tests.fuzz.decoders import DECODER_TARGETS
from tests.fuzz.frames import FRAME_TARGETS
from tests.fuzz.target import Target

TARGETS: dict[str, Target] = {t.name: t for t in (*DECODER_TARGETS, *FRAME_TARGETS)}

__all__ = ["TARGETS", "Target"]
