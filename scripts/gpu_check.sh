#!/usr/bin/env bash
# The GPU checks (issue 14, bench/gpu_check.py): a stage trains on cuda under bf16 autocast; a 2x2
# swarm of GPU peers ends with the simulator's weights on the same GPU; one stage's tokens/s
# against a plain training loop (goal >= 0.8x). Without a CUDA device it prints "skipped: ..." and
# exits 0. Results as JSON in $OUT/gpu_check.json or --out FILE; extra flags pass through
# (--device cpu runs the same code on the CPU). NOLOCO_PYTHON: an interpreter with the project's
# dependencies to use instead of setting up .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${NOLOCO_PYTHON:-}" ]; then
    bash scripts/setup.sh
    NOLOCO_PYTHON=.venv/bin/python
fi
# This checkout's code, whatever the interpreter has installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$NOLOCO_PYTHON" bench/gpu_check.py "$@"
