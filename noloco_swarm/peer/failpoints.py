"""Failpoints: faults a test asks a real peer process to inject, named in an environment variable.

Loss that the network causes only now and then (p2pd closing a stream between two live peers,
seen under load) must be recovered from exactly, so tests make it happen on purpose, in real peer
processes over real daemons. `NOLOCO_FAILPOINTS="point=count,..."` makes each named point fire
the first `count` times it is reached in this process, or `point@skip=count` the `count` times
after the first `skip` (unset: no point ever fires). Points:

  lose_reply:VERB       the caller reads the whole reply to VERB, then discards it as if the
                        stream had closed before it (the callee did its work and thinks it done)
  close_unanswered:VERB the callee serves VERB to the end, then closes the stream without
                        sending its reply
  close_unconfirmed:VERB  the callee of an exchange (VERB: rpc_exchange) has read all of the
                        caller's frame and sent its reply, then closes the stream without the
                        confirmation that ends the caller's call (it counts itself done)

Records that reach one peer late:

  miss_joiners:rpc_records  a joiner's announcement handed to this peer (peer/passing.py) is
                        dropped, as if lost on the way: only the members can pass it on
  miss_joiners:rpc_fetch_state  at the boundary before a joiner's round this peer keeps no
                        state for it (reached only where it would), as if it read the
                        announcement late: it keeps its state at the joiner's own boundary
  keep_round:rpc_fetch_state  a joiner whose download would outlast its round keeps that round
                        anyway (peer/postpone.py), as every joiner did before 2026-12-07: the
                        swarm waits for its download there
  outpaced:rpc_status   a joiner asks where the swarm is after its announcement only once the
                        swarm has passed the boundary before its round, and so chooses a later
                        one, as when the swarm outpaces its announcement (peer/joining.py)

A hostile member, for the tests that prove a partner rejects what it sends (VERB: rpc_exchange;
each point is reached once per exchange, at its start, whether this peer calls, is called or is
avoided; a call made again sends the same):

  poison_scale:VERB     the outer weights this peer sends are multiplied by 1000 (finite)
  poison_nan:VERB       ... hold a few NaNs
  poison_shape:VERB     ... lack their last element (a tensor of the wrong shape)

The peer still averages its own, true weights: only what it sends lies. And a member that lies
in the records it passes (VERB: rpc_records):

  false_report:rpc_records  at a boundary (once per boundary) this peer reports a live member
                        gone in the current round, through the records it passes: the last
                        member (by id) of the next stage, or of the previous one on the last
                        stage. It goes on sending to that member: only its word lies.

Stragglers, for benchmarks of the outer step (bench/outer_sync.py): `NOLOCO_STRAGGLE="MU,SIGMA"`
(or `"MU,SIGMA,SCALE"`) makes every inner phase of this peer (the H inner steps of one round)
last at least SCALE x LogNormal(MU, SIGMA) seconds: the peer waits at the boundary for the rest.
The draw depends only on the run's seed, the stage, the replica's rank and the round, so two runs
of a swarm of the same shape (NoLoCo's and DiLoCo's) straggle exactly alike.

A malformed value is refused when the peer starts, so a typo cannot silently test nothing.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import re
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

ENV = "NOLOCO_FAILPOINTS"
STRAGGLE_ENV = "NOLOCO_STRAGGLE"
POISONS = ("poison_scale", "poison_nan", "poison_shape")
KINDS = (
    "lose_reply",
    "close_unanswered",
    "close_unconfirmed",
    "miss_joiners",
    "keep_round",
    "outpaced",
    "false_report",
    *POISONS,
)
_ENTRY = re.compile(r"^(?P<kind>[a-z_]+):(?P<verb>rpc_[a-z_]+)(@(?P<skip>\d+))?=(?P<count>\d+)$")


def parse(text: str) -> dict[str, list[int]]:
    """{"kind:verb": [skip, count]} from the variable's text; ValueError naming a malformed entry."""
    points: dict[str, list[int]] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        match = _ENTRY.match(entry)
        if match is None or match["kind"] not in KINDS:
            raise ValueError(
                f"{ENV}: {entry!r} is not KIND:VERB=COUNT or KIND:VERB@SKIP=COUNT with KIND one of {', '.join(KINDS)}"
            )
        points[f"{match['kind']}:{match['verb']}"] = [int(match["skip"] or 0), int(match["count"])]
    return points


_left = parse(os.environ.get(ENV, ""))


def fire(kind: str, verb: str) -> bool:
    """Whether the point fires now (and counts it); always False when none was asked for."""
    if not _left:
        return False
    left = _left.get(f"{kind}:{verb}")
    if left is None or left[1] <= 0:
        return False
    if left[0] > 0:  # still skipping
        left[0] -= 1
        return False
    left[1] -= 1
    return True


_poisoned: dict[Hashable, str | None] = {}  # exchange key -> the poison its sends carry
_KEYS_KEPT = 8


def arm(verb: str, key: Hashable) -> None:
    """Reach the poison points once for exchange `key` (its start, whatever this peer's role in
    it and whether it sends at all), deciding what its sends carry."""
    if _left and key not in _poisoned:
        fired = [kind for kind in POISONS if fire(kind, verb)]
        _poisoned[key] = fired[0] if fired else None
        for old in list(_poisoned)[:-_KEYS_KEPT]:
            del _poisoned[old]


def poison(verb: str, key: Hashable, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """What this peer sends for exchange `key`: `tensors`, or copies corrupted by the poison
    point that fired for this key (decided once per key, so a call made again sends the same)."""
    if not _left:
        return tuple(tensors)
    arm(verb, key)
    kind = _poisoned[key]
    return tuple(tensors) if kind is None else tuple(_corrupt(t, kind) for t in tensors)


def _corrupt(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "poison_scale":
        return tensor * 1000.0
    if kind == "poison_nan":
        bad = tensor.clone()
        flat = bad.view(-1)
        flat[:: max(1, flat.numel() // 3)] = float("nan")  # a few NaNs, spread out
        return bad
    return tensor.reshape(-1)[:-1].clone()  # poison_shape


@dataclass(frozen=True)
class Straggle:
    """Inner phases of random length: SCALE x LogNormal(MU, SIGMA) seconds (see the module doc)."""

    mu: float
    sigma: float
    scale: float = 1.0

    @classmethod
    def parse(cls, text: str) -> Straggle | None:
        """From the variable's text (empty: no stragglers); ValueError if malformed."""
        if not text.strip():
            return None
        try:
            values = [float(v) for v in text.split(",")]
            straggle = cls(*values)
        except (TypeError, ValueError):
            raise ValueError(
                f"{STRAGGLE_ENV}: {text!r} is not MU,SIGMA or MU,SIGMA,SCALE (numbers)"
            ) from None
        if not all(map(math.isfinite, values)) or straggle.sigma < 0 or straggle.scale < 0:
            raise ValueError(f"{STRAGGLE_ENV}: {text!r} needs finite values, SIGMA >= 0 and SCALE >= 0")
        return straggle

    def seconds(self, seed: int, stage: int, rank: int, round_: int) -> float:
        """The inner phase's length for this replica and round (the same in every process)."""
        draw = random.Random(f"straggle/{seed}/{stage}/{rank}/{round_}")  # str seeds: sha512, stable
        return self.scale * draw.lognormvariate(self.mu, self.sigma)


_straggle = Straggle.parse(os.environ.get(STRAGGLE_ENV, ""))
_phase_began = [time.monotonic()]  # when this process's current inner phase began


def phase_begins() -> None:
    """The run loop's hook where an inner phase (a round's inner steps, or the rest of one after
    a start or a join) begins; does nothing unless NOLOCO_STRAGGLE is set."""
    if _straggle is not None:
        _phase_began[0] = time.monotonic()


async def straggle(seed: int, stage: int, rank: int, round_: int) -> None:
    """The run loop's hook at a boundary: wait until the inner phase that began at the last
    `phase_begins` has lasted its drawn length; returns at once unless NOLOCO_STRAGGLE is set."""
    if _straggle is not None:
        due = _phase_began[0] + _straggle.seconds(seed, stage, rank, round_)
        await asyncio.sleep(max(0.0, due - time.monotonic()))
