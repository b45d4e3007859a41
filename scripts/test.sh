#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite. The README's test command.
#
# With no arguments the suite runs in two lanes side by side, each about half of it: most of the
# integration tests (real peer processes and daemons, which spend most of their time waiting on
# each other), and the in-process tests (unit, simulator, fuzz: CPU-bound), the rest of the
# integration tests (SECOND_LANE), the compose testbed's test and the namespace testbed's
# (AFTER_COMPOSE: dockerd's forwarding rules and namespace bridges, one after the other). The
# compose images are built in the background from the lane's start: on a fresh machine that takes
# 4-5 minutes, which CI paid on the lane's path before (34 minutes; 30 with the images cached).
# The integration tests must pass on a loaded machine anyway (stress-ng).
# The second lane's report is printed after the first's. With arguments: one pytest run of exactly
# those.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest "$@"
fi
report=$(mktemp)
compose=tests/integration/test_compose.py
SECOND_LANE=(
    tests/integration/test_faults.py
    tests/integration/test_terminal.py
    tests/integration/test_trust.py
    tests/integration/test_plot.py
    tests/integration/test_metrics.py
    tests/integration/test_join_logs.py
)
AFTER_COMPOSE=(tests/integration/test_testbed.py)  # namespaces: not while the compose test's dockerd runs
second_lane() {
    local status=0 prepare
    # The compose testbed's images (on a fresh machine: debootstrap, then a pip install in a
    # docker build and a docker save, 4-5 minutes of mostly downloads and disk) are made ready
    # while the tests before the compose test run. What fails here, the compose test meets again
    # and reports.
    (bash scripts/compose_testbed.sh --prepare && echo "test.sh: compose images ready $SECONDS s into the run") >"$report.prepare" 2>&1 &
    prepare=$!
    .venv/bin/python -m pytest -m "not integration" -p no:cacheprovider || status=$?
    .venv/bin/python -m pytest -m integration -p no:cacheprovider "${SECOND_LANE[@]}" || status=$?
    wait "$prepare" || echo "test.sh: preparing the compose images failed (the compose test reports why):"
    cat "$report.prepare"
    .venv/bin/python -m pytest -p no:cacheprovider "$compose" || status=$?
    .venv/bin/python -m pytest -m integration -p no:cacheprovider "${AFTER_COMPOSE[@]}" || status=$?
    return "$status"
}
second_lane >"$report" 2>&1 &
lane=$!
# Under set -e a failing command in the trap (pkill finds nothing once the lane has ended) would
# make the script's exit status 1 after both lanes passed: every command here must succeed.
trap 'pkill -P "$lane" 2>/dev/null || true; kill "$lane" 2>/dev/null || true; rm -f "$report" "$report.prepare"' EXIT
integration=0
ignored=()
for file in "$compose" "${SECOND_LANE[@]}" "${AFTER_COMPOSE[@]}"; do ignored+=(--ignore "$file"); done
.venv/bin/python -m pytest -m integration "${ignored[@]}" || integration=$?
second=0
wait "$lane" || second=$?
echo
echo "==== the second lane (pytest -m 'not integration', then ${SECOND_LANE[*]}, then $compose, then ${AFTER_COMPOSE[*]}) ===="
cat "$report"
echo "test.sh: first lane exit $integration, second lane exit $second"
[ "$integration" = 0 ] && [ "$second" = 0 ]
