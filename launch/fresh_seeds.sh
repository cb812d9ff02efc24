#!/usr/bin/env bash
# The tests on fresh random inputs: RUNS runs (default 3), each with a seed drawn from the OS, over
# the whole suite (every test's generators are seeded from the run seed: tests/conftest.py). CI runs
# one fixed seed (CI_SEED) so that it passes or fails by the code alone; this is where precision
# defects that only some inputs show are found, and tests whose own setup holds only for some draws
# (a store test once assumed two shards differ in size, which one array choice in two broke). Run it
# before merging; a failure prints the line that replays it, and is fixed at its cause.
#
#   bash launch/fresh_seeds.sh [RUNS] [pytest arguments, e.g. -n 2, -k bf16 or some paths]
#
# Logs: runs/fresh-seeds/<seed>.log. Exit status 1 when any run failed (the summary lists them).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup.sh >/dev/null || exit 2
runs=${1:-3}
shift $(( $# > 0 ? 1 : 0 ))
tests=(tests)
[ $# -gt 0 ] && [[ "$1" != -* ]] && tests=()  # paths given: those instead
logs=runs/fresh-seeds
mkdir -p "$logs"
failed=()
for i in $(seq 1 "$runs"); do
  seed=$(.venv/bin/python -c 'import random; print(random.SystemRandom().randrange(2**31))')
  echo "fresh seeds, run $i of $runs: MEGATRON_KD_TEST_SEED=$seed"
  start=$(date +%s)
  MEGATRON_KD_TEST_SEED=$seed .venv/bin/python -m pytest -q -p no:cacheprovider "${tests[@]}" "$@" \
    >"$logs/$seed.log" 2>&1
  status=$?
  # pytest's summary line (a subprocess may print after it)
  echo "  $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$logs/$seed.log" | tail -n 1) ($(( $(date +%s) - start )) s; log $logs/$seed.log)"
  if [ $status -ne 0 ]; then
    failed+=("$seed")
    grep -A1 -- '- replay -' "$logs/$seed.log" | grep MEGATRON_KD_TEST_SEED | sed 's/^/  replay: /'
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fresh seeds: ${#failed[@]} of $runs runs failed (seeds ${failed[*]})"
  exit 1
fi
echo "fresh seeds: $runs of $runs runs passed"
