"""What fuzzing found (docs/security.md, "Fuzzing"): each minimal input, now refused with the
documented error instead of escaping as another exception."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from noloco_swarm.peer import checkpoint
from noloco_swarm.train import layering

HASH = "ab" * 32


def checkpoint_dict() -> dict:
    parts = {p: torch.zeros(3) for p in checkpoint.PARTS}
    members = (("a",), ("b",))
    return checkpoint.Checkpoint("run-1", HASH, 1, "p", 20, 2, members, 0, 2, 640, 20, HASH, parts).to_dict()


def _save(path: Path, obj: object) -> Path:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    path.write_bytes(buffer.getvalue())
    return path


@pytest.mark.parametrize(
    "data",
    [b"\x80\x02.", b"\x80\x02c__builtin__\neval\n."],
    ids=["empty-stack (IndexError)", "refused-global (UnpicklingError)"],
)
def test_a_corrupt_checkpoint_is_a_value_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "step-000000020.pt"
    path.write_bytes(data)
    with pytest.raises(ValueError, match="cannot read"):
        checkpoint.read(path)


@pytest.mark.parametrize(
    "change",
    [{"parts": None}, {"parts": [1]}, {"members": 5}, {"step": "20"}, {"tokens": True}, {"extra": 1}],
    ids=str,
)
def test_acheckpoint_dict_of_wrong_types_is_a_value_error(tmp_path: Path, change: dict) -> None:
    path = _save(tmp_path / "step-000000020.pt", {**checkpoint_dict(), **change})
    with pytest.raises(ValueError, match="checkpoint"):
        checkpoint.read(path)


def test_a_valid_checkpoint_still_reads(tmp_path: Path) -> None:
    ckpt = checkpoint.read(_save(tmp_path / "step-000000020.pt", checkpoint_dict()))
    assert ckpt.step == 20 and ckpt.members == (("a",), ("b",))


def test_a_corrupt_checkpoint_falls_back_to_an_older_one(tmp_path: Path) -> None:
    _save(checkpoint.path_for(tmp_path, 20), checkpoint_dict())
    checkpoint.path_for(tmp_path, 40).write_bytes(b"\x80\x02.")
    found = checkpoint.load(tmp_path, "run-1", HASH, 1)
    assert found is not None and found.step == 20


@pytest.mark.parametrize(
    "text",
    [b"\x80", b"[network]\ninitial_peers = 1", b"[network]\ninitial_peers = { a = 1 }"],
    ids=["not-utf8", "number-for-a-list", "table-for-a-list"],
)
def test_a_bad_config_file_is_a_config_error(tmp_path: Path, text: bytes) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(text)
    with pytest.raises(layering.ConfigError):
        layering.resolve([layering.Layer("file", layering.load_file(path))])


def test_a_run_config_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(layering.ConfigError, match="cannot read run config"):
        layering.load_run_config(path)
