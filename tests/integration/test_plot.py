"""A short `noloco local --keep --plot` run to its summary, and `noloco plot` on the folder it
wrote: valid PNGs of every chart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from noloco_swarm.cli.plot import CHARTS, load
from noloco_swarm.peer.events import Final, of_kind, read
from tests.small import SMALL_RUN

pytestmark = pytest.mark.integration
STEPS = 6  # H = 3: two outer steps


def noloco(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "noloco_swarm.cli.main", *args]
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout)


def test_plot_a_local_runs_folder(cache: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = noloco(
        "local", "--plain", "--plot", "--replicas", "2", "--keep", str(run_dir), "--steps", str(STEPS), "--set", "outer.inner_steps=3",
        *SMALL_RUN, timeout=600,
    )  # fmt: skip
    assert local.returncode == 0, local.stdout + local.stderr
    for expected in (  # the run's summary
        "validation perplexity",
        "tokens/s",
        "bytes per outer step per peer",
        "stage 1 replica 1 state",
    ):
        assert expected in local.stdout, expected
    check_charts(run_dir / "plots", local.stdout)  # noloco local --plot drew them at the end
    files = sorted(run_dir.glob("*.jsonl"))
    assert [f.name for f in files] == ["peer-0-0.jsonl", "peer-0-1.jsonl", "peer-1-0.jsonl", "peer-1-1.jsonl"]
    # The kept metrics are typed events: each peer's file reads back with its one final summary.
    assert [[f.steps for f in of_kind(read(f), Final)] for f in files] == [[STEPS]] * 4
    peers = load(run_dir)
    assert sorted(p.name for p in peers) == [f"stage {s} replica {r}" for s in (0, 1) for r in (0, 1)]
    assert all(len(p.steps) == STEPS and len(p.outers) == 2 for p in peers)

    result = noloco("plot", str(run_dir), "--out", str(tmp_path / "again"), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 peers" in result.stdout
    check_charts(tmp_path / "again", result.stdout)


def check_charts(folder: Path, output: str) -> None:
    """Every chart is a whole PNG of the figure's size, with more than a few colours."""
    for chart in CHARTS:
        path = folder / f"{chart}.png"
        assert path.exists(), output
        with Image.open(path) as image:
            image.verify()  # a whole, uncorrupted PNG
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size == (1100, 400)
            colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
            assert colours is None or len(colours) > 20, f"{chart}.png looks blank"


def test_plot_says_what_is_missing(tmp_path: Path) -> None:
    result = noloco("plot", str(tmp_path), timeout=120)
    assert result.returncode == 2
    assert "no peer events" in result.stdout
