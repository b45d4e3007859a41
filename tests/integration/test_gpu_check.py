"""`scripts/gpu_check.sh` on a machine without a CUDA device: a clear skip, exit 0, a JSON record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_skips_cleanly_without_cuda(tmp_path: Path) -> None:
    env = os.environ | {"NOLOCO_PYTHON": sys.executable, "OUT": str(tmp_path)}
    argv = ["bash", "scripts/gpu_check.sh"]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "skipped: no CUDA device (torch.cuda.is_available() is False)" in done.stdout
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["skipped"].startswith("skipped: no CUDA device")
