"""The pipeline split: a pure function from (layers, stages) to each stage's layer range."""

from __future__ import annotations


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous, balanced layer ranges, one per stage, covering `range(num_layers)` in order.

    Sizes differ by at most one; when the layers do not divide evenly the earlier stages
    take one extra layer each (10 layers over 4 stages: 3, 3, 2, 2). The balance is by
    layer count only: stage 0 also holds the embedding and the last stage the LM head, which
    for a 128k vocabulary outweigh several layers; moving layers to compensate is a known,
    deliberate omission so that every peer derives the same split from two integers.
    """
    for label, value in (("num_layers", num_layers), ("num_stages", num_stages)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{label} must be an int, got {type(value).__name__}.")
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}.")
    if num_stages > num_layers:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} stages: every stage needs a layer; "
            "use fewer stages or a deeper model."
        )
    base, extra = divmod(num_layers, num_stages)
    ranges: list[range] = []
    start = 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """The layer range of one stage, with a clear error for a stage index out of range."""
    ranges = split_layers(num_layers, num_stages)
    if not 0 <= stage < num_stages:
        raise ValueError(
            f"stage {stage} is out of range for {num_stages} stages (valid: 0..{num_stages - 1})."
        )
    return ranges[stage]
