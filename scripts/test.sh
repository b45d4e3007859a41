#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite. The README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
