"""Llama-style decoder split into pipeline stages; presets; deterministic init.

`stage` (and with it transformers, about 3 s of CPU to import here) loads on first use of one of its
names, so the processes that only read configs (the DHT bootstrap, `noloco status`, the launcher)
start without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from noloco_swarm.model.presets import (
    PRESETS,
    ModelConfig,
    count_parameters,
    count_stage_parameters,
    get_preset,
)
from noloco_swarm.model.split import split_layers, stage_layers
from noloco_swarm.model.state import flat_params, load_flat_params_, num_flat, state_hash

if TYPE_CHECKING:
    from noloco_swarm.model.stage import IGNORE_INDEX, Stage, build_model, build_stage, build_stages

_FROM_STAGE = frozenset({"IGNORE_INDEX", "Stage", "build_model", "build_stage", "build_stages"})


def __getattr__(name: str) -> Any:
    if name in _FROM_STAGE:
        return getattr(importlib.import_module("noloco_swarm.model.stage"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "IGNORE_INDEX",
    "PRESETS",
    "ModelConfig",
    "Stage",
    "build_model",
    "build_stage",
    "build_stages",
    "count_parameters",
    "count_stage_parameters",
    "flat_params",
    "get_preset",
    "load_flat_params_",
    "num_flat",
    "split_layers",
    "stage_layers",
    "state_hash",
]
