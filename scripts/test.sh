#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite. The README's test command.
#
# With no arguments the suite runs in two lanes side by side, each about half of it: most of the
# integration tests (real peer processes and daemons, which spend most of their time waiting on
# each other), and the in-process tests (unit, simulator, fuzz: CPU-bound), the compose testbed's
# test (mostly building images) and the rest of the integration tests (SECOND_LANE: the namespace
# testbed's stay in one lane with the compose test, one after the other). The integration tests
# must pass on a loaded machine anyway (stress-ng). One lane took 31-35 minutes of CI; two lanes
# 30 here with the compose images cached, and 34 on CI, which builds them (3 minutes more on the
# second lane's path). Building them in the background instead was no faster (36 minutes, on a
# day when the tree before took 32 with its images cached): the build competes for the same cores
# and disk.
# The second lane's report is printed after the first's. With arguments: one pytest run of exactly
# those.
set -euo pipefail
cd "$(dirname "$0")/.."
# The system tools first: where they are missing and cannot be installed, fail at once saying how.
# Then apt's downloads and the virtual environment's (scripts/setup.sh) side by side.
bash scripts/setup_tools.sh --check
bash scripts/setup_tools.sh &
tools=$!
bash scripts/setup.sh
wait "$tools"
# The compose testbed's images survive between runs when the home folder does (docker save/load).
export NOLOCO_COMPOSE_CACHE="${NOLOCO_COMPOSE_CACHE:-$HOME/.cache/noloco-swarm/compose}"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest "$@"
fi
report=$(mktemp)
compose=tests/integration/test_compose.py
SECOND_LANE=(
    tests/integration/test_testbed.py
    tests/integration/test_faults.py
    tests/integration/test_terminal.py
    tests/integration/test_trust.py
    tests/integration/test_plot.py
    tests/integration/test_metrics.py
    tests/integration/test_join_logs.py
)
second_lane() {
    local status=0
    .venv/bin/python -m pytest -m "not integration" -p no:cacheprovider || status=$?
    .venv/bin/python -m pytest -p no:cacheprovider "$compose" || status=$?
    .venv/bin/python -m pytest -m integration -p no:cacheprovider "${SECOND_LANE[@]}" || status=$?
    return "$status"
}
second_lane >"$report" 2>&1 &
lane=$!
# Under set -e a failing command in the trap (pkill finds nothing once the lane has ended) would
# make the script's exit status 1 after both lanes passed: every command here must succeed.
trap 'pkill -P "$lane" 2>/dev/null || true; kill "$lane" 2>/dev/null || true; rm -f "$report"' EXIT
integration=0
ignored=()
for file in "$compose" "${SECOND_LANE[@]}"; do ignored+=(--ignore "$file"); done
.venv/bin/python -m pytest -m integration "${ignored[@]}" || integration=$?
second=0
wait "$lane" || second=$?
echo
echo "==== the second lane (pytest -m 'not integration', then $compose, then ${SECOND_LANE[*]}) ===="
cat "$report"
echo "test.sh: first lane exit $integration, second lane exit $second"
[ "$integration" = 0 ] && [ "$second" = 0 ]
