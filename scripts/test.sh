#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite. The README's test command.
#
# With no arguments the suite runs in two lanes side by side: the integration tests (real peer
# processes and daemons, which spend most of their time waiting on each other) and the in-process
# tests (unit, simulator, fuzz: CPU-bound). The integration tests must pass on a loaded machine
# anyway (stress-ng); the lanes save the in-process tests' two minutes. The in-process lane's report
# is printed after the integration lane's. With arguments: one pytest run of exactly those.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest "$@"
fi
report=$(mktemp)
.venv/bin/python -m pytest -m "not integration" -p no:cacheprovider >"$report" 2>&1 &
lane=$!
trap 'kill "$lane" 2>/dev/null || true; rm -f "$report"' EXIT
integration=0
.venv/bin/python -m pytest -m integration || integration=$?
in_process=0
wait "$lane" || in_process=$?
echo
echo "==== the in-process lane (pytest -m 'not integration') ===="
cat "$report"
echo "test.sh: integration lane exit $integration, in-process lane exit $in_process"
[ "$integration" = 0 ] && [ "$in_process" = 0 ]
