"""Fault schedules for a testbed run: `HOST=RATE` shapes and `HOST@T+DURATION` cuts, parsed and timed.

Pure: parsing and "what is due by now" take the elapsed time as a parameter, so the caller's loop
(e.g. the poll loop of `noloco testbed`) owns the clock and applies the actions to its `Testbed`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

_RATE = re.compile(r"^(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>kbit|mbit|gbit)?$", re.IGNORECASE)
_CUT = re.compile(r"^(?P<host>[\w.-]+)@(?P<at>\d+(?:\.\d+)?)s?\+(?P<duration>\d+(?:\.\d+)?)s?$")
_MBIT = {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}


@dataclass(frozen=True)
class Shape:
    """Limit `host`'s link to `rate_mbit` each way for the whole run (a token bucket of
    `burst_kbit`; None: Testbed.shape's default, 10 ms of the rate), queueing at most `queue_ms`
    of data (tbf's latency) before it drops."""

    host: str
    rate_mbit: float
    burst_kbit: float | None = None
    queue_ms: float = 100.0


@dataclass(frozen=True)
class Action:
    """One timed change to a link: cut it or restore it, `at` seconds after the run started."""

    at: float
    kind: Literal["cut", "restore"]
    host: str


def parse_rate(text: str) -> float:
    """ "10", "10mbit", "500kbit", "1gbit" -> Mbit/s."""
    match = _RATE.match(text.strip())
    if match is None or float(match["value"]) <= 0:
        raise ValueError(f"bad rate {text!r}: give a positive number of Mbit/s, e.g. 10 or 500kbit")
    return float(match["value"]) * _MBIT[(match["unit"] or "mbit").lower()]


def parse_shape(text: str) -> Shape:
    """ "s1r0=10mbit" -> Shape("s1r0", 10.0)."""
    host, sep, rate = text.partition("=")
    if not sep or not host:
        raise ValueError(f"bad --shape {text!r}: give HOST=RATE, e.g. s1r0=10mbit")
    return Shape(host.strip(), parse_rate(rate))


def parse_delay(text: str) -> tuple[str, float]:
    """ "s1r1=40" -> ("s1r1", 40.0): a host's one-way delay in milliseconds."""
    host, sep, ms = text.partition("=")
    try:
        value = float(ms.strip().removesuffix("ms")) if sep and host.strip() else -1.0
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"bad --delay {text!r}: give HOST=MS (one-way, milliseconds), e.g. s1r1=40")
    return host.strip(), value


def check_delays(transport: str, delay_ms: float, delays: Mapping[str, float] | None = None) -> None:
    """Refuse a delay on a QUIC testbed: the delay relay carries TCP only, so it would run undelayed."""
    if transport == "quic" and (delay_ms or any((delays or {}).values())):
        raise ValueError("--transport quic takes no --delay: the delay relay carries TCP only")


def parse_cut(text: str) -> tuple[Action, Action]:
    """ "s1r0@30+20" -> cut s1r0 at 30 s, restore it at 50 s."""
    match = _CUT.match(text.strip())
    if match is None:
        raise ValueError(f"bad --cut {text!r}: give HOST@T+DURATION in seconds, e.g. s1r0@30+20")
    at, duration = float(match["at"]), float(match["duration"])
    if duration <= 0:
        raise ValueError(f"bad --cut {text!r}: the duration must be positive")
    return Action(at, "cut", match["host"]), Action(at + duration, "restore", match["host"])


@dataclass
class Timeline:
    """The actions of a run in time order; `due(elapsed)` hands out each one once."""

    actions: list[Action] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.actions = sorted(self.actions, key=lambda a: (a.at, a.kind == "cut"))

    @classmethod
    def of_cuts(cls, cuts: Iterable[str]) -> Timeline:
        return cls([a for text in cuts for a in parse_cut(text)])

    def hosts(self) -> set[str]:
        return {a.host for a in self.actions}

    def due(self, elapsed: float) -> list[Action]:
        """The actions at or before `elapsed` seconds not handed out yet."""
        n = next((i for i, a in enumerate(self.actions) if a.at > elapsed), len(self.actions))
        out, self.actions = self.actions[:n], self.actions[n:]
        return out

    def pending(self) -> Sequence[Action]:
        return tuple(self.actions)
