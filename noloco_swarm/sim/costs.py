"""What a stage costs on a GPU: the presets' FLOPs per token and a table of GPUs.

The wall-clock model (sim/wallclock.py) takes a stage's cost as seconds per sample; this turns a
preset and a GPU's sustained rate (peak dense bf16 x MFU) into those seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from noloco_swarm.model.presets import ModelConfig, count_stage_parameters, layer_parameters
from noloco_swarm.model.split import split_layers
from noloco_swarm.sim.wallclock import StageCost


def stage_flops_per_token(cfg: ModelConfig, num_stages: int) -> list[float]:
    """Forward FLOPs per token of each stage: 2 per matmul weight, plus causal-free attention.

    2 x (layer weights) per token for each layer, plus 4 x seq x hidden for its scores and
    weighted sum (counted without the causal mask's saving, as the usual 6N + 12 L s h
    convention does); the last stage adds its LM head (2 x hidden x vocab). The embedding is a
    lookup: no FLOPs. Backward is twice the forward.
    """
    out = []
    for s, layers in enumerate(split_layers(cfg.num_layers, num_stages)):
        per_layer = 2 * layer_parameters(cfg) + 4 * cfg.seq_len * cfg.hidden_size
        flops = len(layers) * per_layer
        if s == num_stages - 1:
            flops += 2 * cfg.hidden_size * cfg.vocab_size
        out.append(float(flops))
    return out


def preset_stages(cfg: ModelConfig, num_stages: int, flops_per_s: float) -> tuple[StageCost, ...]:
    """Stage costs of a preset on a GPU that sustains `flops_per_s` (peak x MFU)."""
    costs = []
    ranges = split_layers(cfg.num_layers, num_stages)
    for s, flops in enumerate(stage_flops_per_token(cfg, num_stages)):
        forward = flops * cfg.seq_len / flops_per_s
        params = count_stage_parameters(cfg, ranges[s], first=s == 0, last=s == num_stages - 1)
        costs.append(StageCost(forward_s=forward, backward_s=2 * forward, params=params))
    return tuple(costs)


@dataclass(frozen=True)
class Gpu:
    """A GPU as the planner sees it: peak dense bf16 rate and memory."""

    name: str
    peak_tflops: float
    """Peak dense bf16 TFLOP/s (without sparsity), from the vendor's data sheet."""
    memory_gb: float | None
    """Memory in GB (1e9 bytes); None: unknown, no batch is refused for memory."""


# Peak dense bf16 TFLOP/s from the data sheets (H100 SXM, A100 SXM 80 GB, L4, GeForce RTX 4090
# and 3090 with fp32 accumulation as training uses).
GPUS: dict[str, Gpu] = {
    gpu.name: gpu
    for gpu in (
        Gpu("h100", 989.0, 80.0),
        Gpu("a100", 312.0, 80.0),
        Gpu("l4", 121.0, 24.0),
        Gpu("rtx4090", 165.0, 24.0),
        Gpu("rtx3090", 71.0, 24.0),
    )
}


def gpu_named(text: str, memory_gb: float | None = None) -> Gpu:
    """A GPU of the table by name, or any GPU by its peak TFLOP/s; `memory_gb` overrides memory."""
    key = text.strip().lower()
    if key in GPUS:
        gpu = GPUS[key]
    else:
        try:
            peak = float(key)
        except ValueError:
            raise ValueError(
                f"unknown GPU {text!r}: name one of {', '.join(GPUS)} or give its peak dense bf16 TFLOP/s"
            ) from None
        if not peak > 0:
            raise ValueError(f"a GPU's peak TFLOP/s must be > 0, got {text!r}")
        gpu = Gpu(f"{peak:g} TFLOP/s", peak, None)
    if memory_gb is not None:
        if not memory_gb > 0:
            raise ValueError(f"GPU memory must be > 0 GB, got {memory_gb}")
        gpu = Gpu(gpu.name, gpu.peak_tflops, memory_gb)
    return gpu
