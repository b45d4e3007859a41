"""Llama-style decoder split into pipeline stages; presets; deterministic init."""

from noloco_swarm.model.presets import (
    PRESETS,
    ModelConfig,
    count_parameters,
    count_stage_parameters,
    get_preset,
)
from noloco_swarm.model.split import split_layers, stage_layers
from noloco_swarm.model.stage import IGNORE_INDEX, Stage, build_model, build_stage, build_stages
from noloco_swarm.model.state import flat_params, load_flat_params_, num_flat, state_hash

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
