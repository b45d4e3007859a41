"""A replica's checkpoints: its full state at a round boundary, written so that no crash tears one.

A checkpoint holds what a replica needs to go on as if it had never stopped: the state parts a
joiner downloads (phi, the outer momentum, AdamW's moments and step count; the fast weights
equal phi at a boundary, or are kept as "theta" where an overlapped outer step is still to come), the counters (inner steps, outer steps, tokens), the round that starts
there, the members of the round that just ended, and the run it belongs to. Data positions need
nothing more: stage 0's shard and window are functions of the step and the view.

Files are `step-<step>.pt` in the peer's checkpoint directory, written to a temporary name,
flushed to disk, renamed over, and the directory flushed: a reader sees the old file or the new
one, never half of one. The newest few are kept. Loading checks the run, the stage and the
weights' hash, and skips (with the reason) any file that fails, falling back to an older one.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

PREFIX, SUFFIX = "step-", ".pt"
PARTS = ("phi", "delta", "exp_avg", "exp_avg_sq")
# With `outer.overlap_steps` > 0 a checkpoint is written at the boundary before the overlapped
# exchange starts, where the fast weights differ from phi: it holds them too, and a swarm resumed
# from it runs that boundary's exchange again (every member goes back to the same step).
OPTIONAL_PARTS = ("theta",)


@dataclass(frozen=True)
class Checkpoint:
    run_id: str
    config_hash: str  # the run manifest's: a checkpoint of another config is never loaded
    stage: int
    peer_id: str
    step: int  # inner steps done; a round boundary
    round: int  # the round that starts at `step`
    members: tuple[tuple[str, ...], ...]  # per stage: who trained the round that just ended
    joined_round: int
    outer_steps: int
    tokens: int
    adam_step: int
    state_hash: str  # of the weights in `parts` (theta if it holds one, else phi)
    parts: dict[str, torch.Tensor] = field(repr=False)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["members"] = [list(s) for s in self.members]
        return out

    @classmethod
    def from_dict(cls, raw: object) -> Checkpoint:
        """The checkpoint a loaded dict holds; ValueError for anything `to_dict` could not have
        written (a field missing, extra or of the wrong type), so a bad file is skipped, not a crash."""
        if not isinstance(raw, dict):
            raise ValueError(f"a checkpoint is a dict, not {type(raw).__name__}")
        names = {f.name: f.type for f in fields(cls)}
        if set(raw) != set(names):
            missing, extra = set(names) - set(raw), set(raw) - set(names)
            raise ValueError(
                f"malformed checkpoint: missing {sorted(missing)}, unknown {sorted(map(str, extra))}"
            )
        for name, kind in names.items():
            scalar = {"int": int, "str": str}.get(str(kind))
            if scalar is not None and (not isinstance(raw[name], scalar) or isinstance(raw[name], bool)):
                raise ValueError(f"malformed checkpoint: {name} is not a {kind}")
        members, parts = raw["members"], raw["parts"]
        if not isinstance(members, list | tuple) or not all(isinstance(s, list | tuple) for s in members):
            raise ValueError("malformed checkpoint: members must be one list of peer ids per stage")
        named = isinstance(parts, dict) and set(parts) - set(OPTIONAL_PARTS) == set(PARTS)
        if not named or not all(isinstance(t, torch.Tensor) for t in parts.values()):
            raise ValueError(
                f"a checkpoint's parts must be tensors named {', '.join(PARTS)} (and maybe theta)"
            )
        return cls(**{**raw, "members": tuple(tuple(str(p) for p in s) for s in members)})


def path_for(directory: Path, step: int) -> Path:
    return directory / f"{PREFIX}{step:09d}{SUFFIX}"


def listed(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in `directory`, newest first."""
    out = []
    for path in directory.glob(f"{PREFIX}*{SUFFIX}"):
        digits = path.name[len(PREFIX) : -len(SUFFIX)]
        if digits.isdigit():
            out.append((int(digits), path))
    return sorted(out, reverse=True)


def save(directory: Path, ckpt: Checkpoint, keep: int) -> Path:
    """Write `ckpt` atomically (temporary file, fsync, rename, fsync of the directory) and delete
    all but the newest `keep` checkpoints."""
    directory.mkdir(parents=True, exist_ok=True)
    final = path_for(directory, ckpt.step)
    tmp = final.with_name(final.name + ".tmp")
    with tmp.open("wb") as f:
        torch.save(ckpt.to_dict(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for _, old in listed(directory)[keep:]:
        old.unlink(missing_ok=True)
    return final


# What torch.load raises on a torn or corrupt file: its zip reader's RuntimeError, and whatever the
# weights-only unpickler's stack machine hits on garbage (an empty stack, a bad opcode argument, a
# global it refuses). Found by fuzzing (tests/fuzz/decoders.py, docs/security.md); all of them
# mean "not a checkpoint we can read", and `load` falls back to an older file.
_UNREADABLE = (
    OSError, RuntimeError, EOFError, ValueError, AttributeError, TypeError, IndexError, KeyError,
    OverflowError, struct.error, pickle.UnpicklingError,
)  # fmt: skip


def read(path: Path) -> Checkpoint:
    """One checkpoint file; ValueError if it is unreadable or malformed."""
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except _UNREADABLE as e:
        raise ValueError(f"cannot read {path.name}: {e}") from e
    return Checkpoint.from_dict(raw)


def load(
    directory: Path, run_id: str, config_hash: str, stage: int, *, at_most: int | None = None
) -> Checkpoint | None:
    """The newest usable checkpoint of this run and stage in `directory` (at or before step
    `at_most` if given), or None. Files that fail are skipped with a warning that says why."""
    for step, path in listed(directory):
        if at_most is not None and step > at_most:
            continue
        try:
            ckpt = read(path)
        except ValueError as e:
            logger.warning("skipping checkpoint %s: %s", path, e)
            continue
        why = (
            f"it is of run {ckpt.run_id!r}" if ckpt.run_id != run_id
            else "it was written with another config" if ckpt.config_hash != config_hash
            else f"it is of stage {ckpt.stage}" if stage is not None and ckpt.stage != stage
            else f"it names step {ckpt.step}" if ckpt.step != step
            else ""
        )  # fmt: skip
        if why:
            logger.warning("skipping checkpoint %s: %s", path, why)
            continue
        return ckpt
    return None
