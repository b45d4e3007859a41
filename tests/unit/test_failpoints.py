"""Failpoints are parsed strictly, so that a typo in a test's fault cannot silently inject nothing."""

from __future__ import annotations

import pytest

from noloco_swarm.peer import failpoints


def test_points_parse_into_counts() -> None:
    text = "lose_reply:rpc_forward=2, close_unanswered:rpc_exchange=1,"
    assert failpoints.parse(text) == {
        "lose_reply:rpc_forward": [0, 2],
        "close_unanswered:rpc_exchange": [0, 1],
    }
    assert failpoints.parse("lose_reply:rpc_exchange@3=1") == {"lose_reply:rpc_exchange": [3, 1]}
    assert failpoints.parse("") == {}


@pytest.mark.parametrize(
    "text",
    [
        "lose_reply:rpc_forward",
        "drop_all:rpc_forward=1",
        "lose_reply=1",
        "lose_reply:forward=1",
        "lose_reply:rpc_x@=1",
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
