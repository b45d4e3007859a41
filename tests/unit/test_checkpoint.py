"""Checkpoint files: atomic, pruned, checked on load, and a replica restored from one is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from noloco_swarm.peer import checkpoint
from noloco_swarm.peer.checkpoint import Checkpoint
from noloco_swarm.protocol.outer import OuterResult
from noloco_swarm.train.config import RunConfig
from noloco_swarm.train.replica import StageReplica


def make(step: int, *, run_id: str = "run", stage: int = 0, config_hash: str = "c" * 8) -> Checkpoint:
    parts = {name: torch.full((4,), float(step)) for name in checkpoint.PARTS}
    return Checkpoint(
        run_id=run_id,
        config_hash=config_hash,
        stage=stage,
        peer_id="12D3KooWpeer",
        step=step,
        round=step // 3,
        members=(("a", "b"), ("c",)),
        joined_round=0,
        outer_steps=step // 3,
        tokens=100 * step,
        adam_step=step,
        state_hash="h" * 64,
        parts=parts,
    )


def test_round_trip_keeps_every_field_and_only_the_newest_files(tmp_path: Path) -> None:
    for step in (3, 6, 9, 12):
        checkpoint.save(tmp_path, make(step), keep=2)
    assert [s for s, _ in checkpoint.listed(tmp_path)] == [12, 9]
    assert not list(tmp_path.glob("*.tmp"))
    got = checkpoint.load(tmp_path, "run", "c" * 8, 0)
    assert got is not None and got.step == 12 and got.members == (("a", "b"), ("c",))
    assert got.to_dict().keys() == make(12).to_dict().keys()
    assert all(torch.equal(got.parts[k], make(12).parts[k]) for k in checkpoint.PARTS)
    older = checkpoint.load(tmp_path, "run", "c" * 8, 0, at_most=11)
    assert older is not None and older.step == 9


def test_a_torn_or_foreign_file_is_skipped_for_an_older_good_one(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, make(3), keep=5)
    checkpoint.save(tmp_path, make(6, run_id="other"), keep=5)
    checkpoint.save(tmp_path, make(9, stage=1), keep=5)
    checkpoint.save(tmp_path, make(12, config_hash="d" * 8), keep=5)
    checkpoint.path_for(tmp_path, 15).write_bytes(b"PK\x03\x04 torn mid-write")
    checkpoint.path_for(tmp_path, 18).write_bytes(b"")
    got = checkpoint.load(tmp_path, "run", "c" * 8, 0)
    assert got is not None and got.step == 3
    any_stage = checkpoint.load(tmp_path, "run", "c" * 8, None)
    assert any_stage is not None and any_stage.step == 9
    assert checkpoint.load(tmp_path / "missing", "run", "c" * 8, 0) is None


def test_a_file_that_is_not_a_checkpoint_is_refused_with_a_reason(tmp_path: Path) -> None:
    path = checkpoint.path_for(tmp_path, 3)
    tmp_path.mkdir(exist_ok=True)
    torch.save({"run_id": "run"}, path)
    with pytest.raises(ValueError, match="malformed checkpoint"):
        checkpoint.read(path)
    torch.save({**make(3).to_dict(), "parts": {"phi": torch.zeros(2)}}, path)
    with pytest.raises(ValueError, match="parts"):
        checkpoint.read(path)


def test_a_replica_restored_from_a_checkpoint_continues_exactly(tmp_path: Path) -> None:
    cfg = RunConfig.create("tiny", "noloco", model={"seq_len": 16}, inner={"batch_size": 2})
    x = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def train_step(r: StageReplica) -> None:
        r.module(x).float().pow(2).mean().backward()
        r.optimizer_step(1e-3)

    a = StageReplica(cfg, 0)
    for _ in range(2):
        train_step(a)
    a._set(OuterResult(a.theta(), a.theta() - a.phi))  # an outer step: a boundary, theta == phi
    parts, adam_step = a.state_parts()
    fields = make(6).to_dict() | {"parts": parts, "adam_step": adam_step, "state_hash": a.state_hash()}
    checkpoint.save(tmp_path, Checkpoint.from_dict(fields), keep=1)
    loaded = checkpoint.load(tmp_path, "run", "c" * 8, 0)
    assert loaded is not None
    b = StageReplica(cfg, 0)
    b.load_state_parts(loaded.parts, loaded.adam_step)
    assert b.state_hash() == loaded.state_hash == a.state_hash()
    for r in (a, b):
        train_step(r)
    assert a.state_hash() == b.state_hash()
    assert torch.equal(a.delta, b.delta)
