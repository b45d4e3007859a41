"""Failpoints are parsed strictly, so that a typo in a test's fault cannot silently inject nothing."""

from __future__ import annotations

import asyncio
import math
import statistics
import time

import pytest

from noloco_swarm.peer import failpoints


def test_points_parse_into_counts() -> None:
    text = "lose_reply:rpc_forward=2, close_unanswered:rpc_exchange=1,"
    assert failpoints.parse(text) == {
        "lose_reply:rpc_forward": [0, 2],
        "close_unanswered:rpc_exchange": [0, 1],
    }
    assert failpoints.parse("lose_reply:rpc_exchange@3=1") == {"lose_reply:rpc_exchange": [3, 1]}
    assert failpoints.parse("miss_joiners:rpc_records=1") == {"miss_joiners:rpc_records": [0, 1]}
    assert failpoints.parse("") == {}


@pytest.mark.parametrize(
    "text",
    [
        "lose_reply:rpc_forward",
        "drop_all:rpc_forward=1",
        "lose_reply=1",
        "lose_reply:forward=1",
        "lose_reply:rpc_x@=1",
        "miss_joiners:dht_write=1",
    ],
)
def test_a_malformed_point_is_refused_with_its_text(text: str) -> None:
    with pytest.raises(ValueError, match="KIND:VERB=COUNT"):
        failpoints.parse(text)


def test_a_point_fires_its_count_then_never_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failpoints, "_left", failpoints.parse("lose_reply:rpc_forward=2"))
    fired = [failpoints.fire("lose_reply", "rpc_forward") for _ in range(4)]
    assert fired == [True, True, False, False]
    assert not failpoints.fire("close_unanswered", "rpc_forward")


def test_a_point_can_let_its_first_passes_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failpoints, "_left", failpoints.parse("lose_reply:rpc_exchange@2=1"))
    fired = [failpoints.fire("lose_reply", "rpc_exchange") for _ in range(5)]
    assert fired == [False, False, True, False, False]


def test_stragglers_draw_the_papers_lognormal_the_same_way_in_every_process() -> None:
    straggle = failpoints.Straggle.parse("1,0.5")
    assert straggle == failpoints.Straggle(1.0, 0.5, 1.0)
    draws = [straggle.seconds(0, 0, rank, round_) for rank in range(8) for round_ in range(250)]
    # Stable across processes (str seeds hash with sha512, not Python's salted hash) ...
    assert straggle.seconds(0, 0, 3, 7) == pytest.approx(draws[3 * 250 + 7], rel=0, abs=0)
    assert len(set(draws)) == len(draws)  # ... and different for every replica and round.
    # LogNormal(1, 0.5): median e, mean e^1.125 (2,000 draws: within a few percent).
    assert statistics.median(draws) == pytest.approx(math.e, rel=0.06)
    assert statistics.fmean(draws) == pytest.approx(math.exp(1.125), rel=0.06)
    assert failpoints.Straggle.parse("1,0.5,0.1").seconds(0, 0, 3, 7) == pytest.approx(
        0.1 * draws[3 * 250 + 7]
    )
    assert failpoints.Straggle.parse("") is None


@pytest.mark.parametrize("text", ["1", "1,x", "1,0.5,1,2", "1,-0.5", "1,0.5,-1", "nan,0.5"])
def test_a_malformed_straggle_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="NOLOCO_STRAGGLE"):
        failpoints.Straggle.parse(text)


def test_a_straggler_waits_out_the_rest_of_its_inner_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failpoints, "_straggle", failpoints.Straggle(0.0, 0.0, 3.0))  # always 3 s
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(failpoints.asyncio, "sleep", sleep)
    failpoints.phase_begins()
    assert failpoints._phase_began[0] >= time.monotonic() - 1.0
    now = time.monotonic()
    monkeypatch.setattr(failpoints, "_phase_began", [now - 1.0])
    asyncio.run(failpoints.straggle(0, 0, 0, 0))  # began 1 s ago: about 2 s are left
    monkeypatch.setattr(failpoints, "_phase_began", [now - 5.0])
    asyncio.run(failpoints.straggle(0, 0, 0, 0))  # already longer than 3 s: no wait
    assert 1.0 < slept[0] <= 2.0
    assert slept[1] == 0.0
    monkeypatch.setattr(failpoints, "_straggle", None)  # unset: never waits
    asyncio.run(failpoints.straggle(0, 0, 0, 0))
    assert len(slept) == 2
