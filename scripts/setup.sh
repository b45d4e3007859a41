#!/usr/bin/env bash
# Set up .venv with noloco-swarm and its test tools. Idempotent; safe to run again.
#
# torch is installed first and on purpose: a plain `torch` requirement on a machine without one
# pulls a multi-GB CUDA build. Without a GPU we take the CPU build: a CPU wheel already on this
# machine if pip can find one offline, else PyTorch's CPU index. With a GPU, PyPI's default build.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${NOLOCO_TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: GPU found, installing torch $TORCH_VERSION (CUDA build)"
        "${PIP[@]}" install -q "torch==$TORCH_VERSION"
    elif "${PIP[@]}" install -q --no-index --no-deps "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
        echo "setup: no GPU, installed torch $TORCH_VERSION CPU build from a local wheel"
    else
        echo "setup: no GPU, installing torch $TORCH_VERSION CPU build from the PyTorch CPU index"
        "${PIP[@]}" install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
    fi
fi

# Exact versions this project is tested with (torch excluded: its build is chosen above).
echo "setup: installing noloco-swarm and its dependencies"
"${PIP[@]}" install -q -c constraints.txt -e ".[dev,hub]"
.venv/bin/python -c "import torch, hivemind, noloco_swarm; print(f'setup: ok (torch {torch.__version__}, hivemind {hivemind.__version__}, cuda={torch.cuda.is_available()})')"
