#!/usr/bin/env bash
# Set up (if needed) and run the main job: `noloco local` on the embedded corpus. Extra flags pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/noloco local "$@"
