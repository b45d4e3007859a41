#!/usr/bin/env bash
# The README's test command: set up, lint, and run the whole test suite.
#
#   bash scripts/test.sh           everything, in two lanes side by side (as root: see below)
#   bash scripts/test.sh ARGS...   one pytest run of exactly ARGS (after the same set-up and lint)
#
# Set-up: scripts/setup_tools.sh installs the system tools the suite needs (nftables, iproute2,
# the Docker engine and Compose, debootstrap, tmux, stress-ng) when we are root with apt-get, and
# otherwise fails at once with the command to run; scripts/setup.sh makes .venv beside it. No test
# skips for a missing tool: it fails and names the install command. The whole suite runs as root
# (the namespace testbed makes network namespaces); without root it stops at once and says so.
# Lanes: most of the integration tests (real peer processes and daemons) in the first; the compose
# testbed's test and the rest of the integration tests (SECOND_LANE; the namespace testbed's after
# the compose test, never beside it) in the second; the in-process tests (unit, simulator, fuzz)
# beside the chaos test at the end. Both are CPU-bound on 2 cores: the lanes are balanced by the 30 slowest tests
# each pytest run prints. (Each pytest run's swarms fork their peers from one preloader that has
# imported torch, transformers and hivemind once: harness/preload.py.) The compose images are built on the
# second lane's path: built in the background they competed for the same cores and disk and were
# no faster. The second lane's report is printed after the first's.
# Last, once both lanes have ended: the chaos test (ALONE), beside the in-process tests only. It
# compares the swarm's pace after each fault with its pace before the first, which holds on a
# steady background (an idle machine, or stress-ng's constant load) but not beside the other lane,
# whose load comes and goes: on 2026-12-06 a window after a fault ran at 0.49 of the healthy pace
# in CI beside it. The in-process tests are one pytest process that computes from its start to its
# end, shorter than the chaos test: the load beside it only falls, which can only raise the later
# windows' pace against the first (and run alone, the suite took 1245 s on 2026-12-06, past CI's
# 20 minutes).
# The integration tests also pass on a loaded machine: scripts/stress_tests.sh runs them so.
set -euo pipefail
cd "$(dirname "$0")/.."
# The whole suite needs root: the namespace testbed makes network namespaces. Say so at once.
if [ "$#" -eq 0 ] && [ "$(id -u)" != 0 ]; then
    echo "test.sh: the whole suite needs root (the namespace testbed makes network namespaces): sudo bash scripts/test.sh" >&2
    exit 1
fi
# The system tools first: where they are missing and cannot be installed, fail at once saying how
# (with ARGS, only the tests that need a missing tool fail, each naming it). Then apt's downloads
# and the virtual environment's (scripts/setup.sh) side by side.
[ "$#" -gt 0 ] || bash scripts/setup_tools.sh --check
bash scripts/setup_tools.sh &
tools=$!
bash scripts/setup.sh
wait "$tools" || [ "$#" -gt 0 ]
# The compose testbed's images survive between runs when the home folder does (docker save/load).
export NOLOCO_COMPOSE_CACHE="${NOLOCO_COMPOSE_CACHE:-$HOME/.cache/noloco-swarm/compose}"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest "$@"
fi
report=$(mktemp)
compose=tests/integration/test_compose.py
ALONE=tests/integration/test_chaos.py
SECOND_LANE=(
    tests/integration/test_testbed.py
    tests/integration/test_faults.py
    tests/integration/test_trust.py
    tests/integration/test_runs.py
    tests/integration/test_local_cli.py
    tests/integration/test_doctor.py
)
# Not in this suite: CI allows it 20 minutes, and with these the suite took 1245 s on this 2-core
# machine (2026-12-06). scripts/stress_tests.sh runs them with every other integration test.
NOT_HERE=(
    tests/integration/test_outage.py
)
# The same for one case of a test: a peer frozen with its daemon past the step deadline is also
# the chaos test's third fault, which runs here every time (the peer-only case stays). With it the
# suite took 1233 s here and 1282 s on CI (2026-12-07), the second lane 965 s against 787: the
# compose images are built on a fresh machine (the test took 315 s, 81 s with them cached), so the
# terminal test went to the first lane too. And a peer SIGKILLed mid-round, whose replacement
# takes its stage, is also the chaos test's first fault (the kill at an outer step stays): the
# first lane took 886 s with the join-postponement test (2026-12-07), as long as the second lane
# takes on a fresh machine.
NOT_HERE_CASES=(
    "tests/integration/test_faults.py::test_a_peer_frozen_past_the_deadline_is_dropped_and_rejoins_by_itself[0-peer-and-daemon]"
    "tests/integration/test_swarm.py::test_a_killed_peer_takes_its_processes_and_a_replacement_takes_its_stage[mid-round-3-2]"
)
second_lane() {
    local status=0
    .venv/bin/python -m pytest -p no:cacheprovider "$compose" || status=$?
    .venv/bin/python -m pytest -m integration -p no:cacheprovider "${SECOND_LANE[@]}" "${deselected[@]}" || status=$?
    echo "test.sh: the second lane took $((SECONDS - started)) s"
    return "$status"
}
deselected=()
for case in "${NOT_HERE_CASES[@]}"; do deselected+=(--deselect "$case"); done
started=$SECONDS  # each lane's time, to balance them by
second_lane >"$report" 2>&1 &
lane=$!
# Under set -e a failing command in the trap (pkill finds nothing once the lane has ended) would
# make the script's exit status 1 after both lanes passed: every command here must succeed.
unit=""
trap 'pkill -P "$lane" 2>/dev/null || true; kill "$lane" $unit 2>/dev/null || true; rm -f "$report"' EXIT
integration=0
ignored=()
for file in "$compose" "$ALONE" "${SECOND_LANE[@]}" "${NOT_HERE[@]}"; do ignored+=(--ignore "$file"); done
.venv/bin/python -m pytest -m integration "${ignored[@]}" "${deselected[@]}" || integration=$?
first=$((SECONDS - started))
second=0
wait "$lane" || second=$?
echo
echo "==== the second lane ($compose, then ${SECOND_LANE[*]}) ===="
cat "$report"
lanes=$((SECONDS - started))
echo "test.sh: first lane exit $integration ($first s), second lane exit $second; $lanes s"
echo
unit_report=$(mktemp)
.venv/bin/python -m pytest -m "not integration" -p no:cacheprovider >"$unit_report" 2>&1 &
unit=$!
echo "==== $ALONE, beside the in-process tests only ===="
alone=0
.venv/bin/python -m pytest -m integration -p no:cacheprovider "$ALONE" || alone=$?
in_process=0
wait "$unit" || in_process=$?
echo
echo "==== the in-process tests (pytest -m 'not integration') ===="
cat "$unit_report"
rm -f "$unit_report"
echo "test.sh: $ALONE exit $alone, in-process tests exit $in_process ($((SECONDS - started - lanes)) s); $((SECONDS - started)) s in all"
[ "$integration" = 0 ] && [ "$second" = 0 ] && [ "$alone" = 0 ] && [ "$in_process" = 0 ]
