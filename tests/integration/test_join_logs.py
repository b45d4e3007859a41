"""`noloco join --log-format json`: every line on stderr is one JSON object, a crash's traceback too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.helpers import p2pd_descendants
from tests.small import SMALL_RUN

pytestmark = pytest.mark.integration
NOBODY = (
    "/ip4/127.0.0.1/tcp/9/p2p/QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"  # nothing listens on port 9
)


def join_json(*flags: str) -> tuple[int, list[dict], str]:
    argv = [sys.executable, "-m", "noloco_swarm.cli.main", "join", "--log-format", "json", *flags]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=300)
    records = []
    for line in proc.stderr.splitlines():
        record = json.loads(line)  # fails the test on any line that is not one JSON object
        assert isinstance(record, dict) and {"time", "level", "logger", "message"} <= record.keys(), line
        records.append(record)
    return proc.returncode, records, proc.stdout


def test_a_whole_run_logs_json_lines(cache: Path) -> None:
    """A one-peer run (its own DHT, one stage): start, reachability and end are all records."""
    before = p2pd_descendants()
    rc, records, stdout = join_json(
        "--run-id", "json-logs", "--new-run", "--stages", "1", "--replicas", "1", "--steps", "2",
        "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *SMALL_RUN,
    )  # fmt: skip
    assert rc == 0, records
    messages = [r["message"] for r in records]
    assert messages[0] == "noloco join: run json-logs, stage auto, 2 steps"
    assert any(m.startswith("reachable as /ip4/127.0.0.1/") for m in messages), messages
    assert messages[-1].startswith("done: stage 0 replica 0, 2 steps")
    assert {r["level"] for r in records} <= {"debug", "info", "warning", "error", "critical"}
    summary = json.loads(stdout)  # the summary, on stdout, is one object too
    assert summary["event"] == "final" and summary["time"] >= records[-1]["time"] > 0
    assert p2pd_descendants() <= before


def test_a_crash_is_one_json_line_with_its_traceback() -> None:
    rc, records, _ = join_json("--run-id", "json-logs", "--initial-peers", NOBODY, "--threads", "1")
    assert rc == 1
    crash = records[-1]
    assert crash["level"] == "critical" and "bootstrap" in crash["message"]
    assert crash["exception"].startswith("Traceback (most recent call last):")
