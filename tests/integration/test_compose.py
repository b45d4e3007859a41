"""The docker-compose testbed end to end, as a user runs it: `scripts/compose_testbed.sh`.

It needs a Docker engine and Compose (scripts/setup_tools.sh installs them as root, before
scripts/test.sh runs the suite); where there are none the test fails and says what to install.
The script starts dockerd itself when it is installed, stopped, and we are root, and stops it
again afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from noloco_swarm.harness.compose import PEERS

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 40
SMALL = "outer.inner_steps=10;model.seq_len=32;inner.batch_size=2;eval_windows=4"


def _works(*argv: str) -> bool:
    return subprocess.run(argv, capture_output=True, check=False, timeout=60).returncode == 0


def why_not() -> str | None:
    """Why the testbed cannot run here, or None."""
    if shutil.which("docker") is None:
        return "no Docker engine: sudo apt-get install -y docker.io docker-compose debootstrap"
    if not _works("docker", "info") and not (shutil.which("dockerd") and os.geteuid() == 0):
        return "the Docker engine is not running: sudo systemctl start docker, or run the suite as root"
    if not _works("docker", "compose", "version") and shutil.which("docker-compose") is None:
        return "no Docker Compose: sudo apt-get install -y docker-compose"
    return None


def project_leftovers() -> list[str]:
    """Containers, networks and volumes of the testbed's project (none if no engine is up)."""
    if not _works("docker", "info"):
        return []
    label = "label=com.docker.compose.project=noloco-testbed"
    out = []
    for kind in (["ps", "-a"], ["network", "ls"], ["volume", "ls"]):
        done = subprocess.run(
            ["docker", *kind, "-q", "--filter", label], capture_output=True, text=True, check=False
        )
        out += done.stdout.split()
    return out


def test_compose_testbed_runs_to_the_end(tmp_path: Path) -> None:
    reason = why_not()
    if reason:
        pytest.fail(f"{reason} (scripts/setup_tools.sh installs the tools as root)", pytrace=False)
    argv = [
        "bash",
        "scripts/compose_testbed.sh",
        "--steps",
        str(STEPS),
        "--set",
        SMALL,
        "--out",
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500, check=False)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["passed"], result["problems"]
    hashes = result["state_hashes"]
    assert hashes["stage0-a"] == hashes["stage0-b"] and hashes["stage1-a"] == hashes["stage1-b"]
    assert hashes["stage0-a"] != hashes["stage1-a"]
    assert result["figures"]["train_loss_last"] < result["figures"]["train_loss_first"]
    for peer in PEERS:  # over container addresses: every peer had a connection to every other
        assert sorted(result["talked_to"][peer]) == sorted(p for p in PEERS if p != peer)
    assert result["status_shown_every_peer"], (tmp_path / "status.txt").read_text()
    # The view's peers answered its status calls, not only announced themselves (issue 37).
    assert "4 announced (stage 0: 2, stage 1: 2), 4 answering" in (tmp_path / "status.txt").read_text()
    assert project_leftovers() == [], "the testbed left containers, networks or volumes behind"
