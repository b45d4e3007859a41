"""Stage state as data: one flat fp32 vector of parameters, and a hash of the exact weights."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import nn


def _named_tensors(source: nn.Module | Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    if isinstance(source, nn.Module):
        return [(name, p.detach()) for name, p in source.named_parameters()]
    return [(name, t.detach()) for name, t in source.items()]


def num_flat(module: nn.Module) -> int:
    """Length of `flat_params(module)`: the total number of parameter elements."""
    return sum(p.numel() for p in module.parameters())


@torch.no_grad()
def flat_params(module: nn.Module) -> torch.Tensor:
    """A new contiguous 1-D fp32 copy of every parameter, in `module.named_parameters()` order.

    The order is registration order, which for a `Stage` is embedding, layers by global index,
    norm, head; two stages built for the same (stage, num_stages) always agree on it. The
    vector lives on the parameters' device.
    """
    params = [p.detach().reshape(-1).to(torch.float32) for p in module.parameters()]
    if not params:
        return torch.empty(0, dtype=torch.float32)
    return torch.cat(params)


@torch.no_grad()
def load_flat_params_(module: nn.Module, vec: torch.Tensor) -> None:
    """Copy a vector laid out as by `flat_params` back into the module's parameters, in place.

    Raises ValueError if `vec` is not a 1-D floating tensor of exactly `num_flat(module)`
    elements; nothing is written in that case. Finiteness is the caller's check (a received
    vector is validated where it is decoded).
    """
    if not isinstance(vec, torch.Tensor) or vec.dim() != 1 or not vec.is_floating_point():
        got = f"{vec.dtype} {tuple(vec.shape)}" if isinstance(vec, torch.Tensor) else type(vec).__name__
        raise ValueError(f"expected a 1-D floating tensor of parameters, got {got}")
    expected = num_flat(module)
    if vec.numel() != expected:
        raise ValueError(f"flat parameter vector has {vec.numel()} elements, the module needs {expected}")
    offset = 0
    for p in module.parameters():
        n = p.numel()
        p.copy_(vec[offset : offset + n].view(p.shape))
        offset += n


def state_hash(source: nn.Module | Mapping[str, torch.Tensor]) -> str:
    """sha256 hex digest over (name, dtype, shape, raw bytes) of every tensor, in name order.

    Takes a module (its parameters) or a name -> tensor mapping (e.g. slow weights). Sorting by
    name makes the hash independent of registration order; including names, dtypes and shapes
    means a renamed, recast or reshaped tensor with the same bytes still changes the hash. Equal
    hashes mean bit-identical weights, which is what the swarm-vs-simulator golden tests compare.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(_named_tensors(source), key=lambda item: item[0]):
        flat = tensor.cpu().contiguous().reshape(-1)
        header = f"{name}|{str(flat.dtype).removeprefix('torch.')}|{tuple(tensor.shape)}|"
        digest.update(header.encode())
        # View as bytes rather than going through numpy, which has no bfloat16.
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
