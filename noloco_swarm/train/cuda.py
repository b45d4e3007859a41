"""Deterministic CUDA kernels, for comparing a GPU swarm with the simulator bit for bit.

On the CPU the project's kernels are deterministic already (with one torch thread, see
tests/conftest.py). On a GPU some are not by default: kernels that accumulate with atomics (some
attention backwards, index/scatter adds) sum in a different order on every run, and cuBLAS needs
a fixed workspace to pick the same reduction order each time (PyTorch's reproducibility notes,
https://pytorch.org/docs/stable/notes/randomness.html). A peer with `peer.deterministic` and the
simulator in `bench/gpu_check.py` both call `deterministic_cuda` before their first CUDA work.
"""

from __future__ import annotations

import os

CUBLAS_WORKSPACE = ":4096:8"
"""The cuBLAS workspace setting PyTorch's notes give for deterministic cuBLAS (CUDA >= 10.2)."""


def deterministic_cuda() -> None:
    """Ask torch for deterministic kernels from here on (warn-only: an op with no deterministic
    version warns instead of failing, so a comparison of hashes says whether it mattered).

    Must run before this process first uses cuBLAS: the workspace variable is read then."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
