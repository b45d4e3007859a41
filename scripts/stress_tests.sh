#!/usr/bin/env bash
# Run the integration tests on a loaded machine: `stress-ng --cpu 2` busies two cores beside them.
# Every integration test must pass so (a volunteer's machine is rarely idle), not only when quiet.
#
#   scripts/stress_tests.sh [--repeat N] [FILE_OR_TEST ...]
#
# With no FILE the whole integration suite (`pytest -m integration tests/integration`, the compose
# test included); otherwise exactly those files or test ids. It runs them N times (--repeat, else
# NOLOCO_STRESS_REPEAT, else 1), each a fresh pytest run under one stress-ng that lives for all N,
# and ends stress-ng on any exit (Ctrl-C included). Each repetition's whole output goes to
# runs/stress/<date>/rep-K.log; at the end one line per repetition says its exit status, its
# pytest summary (passed, failed, errors) and its seconds. It exits 0 only when every repetition
# passed. NOLOCO_STRESS_CPU sets the stress-ng workers (default 2: this project's 2-core machine).
# It sets up first, as scripts/test.sh does (scripts/setup_tools.sh installs stress-ng as root).
set -euo pipefail
cd "$(dirname "$0")/.."

repeat="${NOLOCO_STRESS_REPEAT:-1}"
workers="${NOLOCO_STRESS_CPU:-2}"
targets=()
while [ "$#" -gt 0 ]; do
    case "$1" in
        --repeat | -n) repeat="$2"; shift 2 ;;
        --repeat=*) repeat="${1#*=}"; shift ;;
        -h | --help) sed -n '2,14p' "$0"; exit 0 ;;
        *) targets+=("$1"); shift ;;
    esac
done
[[ "$repeat" =~ ^[1-9][0-9]*$ ]] || { echo "stress_tests: --repeat takes a positive whole number, not '$repeat'" >&2; exit 2; }
[ ${#targets[@]} -gt 0 ] || targets=(tests/integration)

bash scripts/setup_tools.sh
bash scripts/setup.sh >/dev/null
out="runs/stress/$(date -u +%Y-%m-%dT%H%M%SZ)"
mkdir -p "$out"

stress=""
stop_stress() {
    if [ -n "$stress" ]; then
        kill "$stress" 2>/dev/null || true  # stress-ng ends its workers when it is told to end
        wait "$stress" 2>/dev/null || true
        stress=""
    fi
}
trap stop_stress EXIT
trap 'exit 130' INT TERM
stress-ng --cpu "$workers" --quiet &
stress=$!
echo "stress_tests: stress-ng --cpu $workers (pid $stress); $repeat repetition(s) of ${targets[*]}; logs in $out"

summaries=()
failed=0
for k in $(seq "$repeat"); do
    log="$out/rep-$k.log"
    start=$(date +%s)
    status=0
    .venv/bin/python -m pytest -m integration -p no:cacheprovider "${targets[@]}" >"$log" 2>&1 || status=$?
    seconds=$(($(date +%s) - start))
    # pytest's last line: "===== 3 passed, 1 failed in 52.10s (0:00:52) ====="
    result=$(grep -E '^=+ .*(passed|failed|error|skipped|deselected|no tests ran).* in [0-9.]+s' "$log" | tail -1 | sed -E 's/^=+ //; s/ in [0-9.]+s.*//' || true)
    summaries+=("repetition $k: exit $status, ${result:-no pytest summary (see $log)}, ${seconds} s")
    echo "stress_tests: ${summaries[-1]}"
    [ "$status" = 0 ] || failed=$((failed + 1))
done
stop_stress

echo
echo "stress_tests: under stress-ng --cpu $workers, ${targets[*]}:"
printf '  %s\n' "${summaries[@]}"
echo "stress_tests: $((repeat - failed)) of $repeat repetition(s) passed; logs in $out"
[ "$failed" = 0 ]
