#!/usr/bin/env bash
# run.sh: planted bugs. Each tests/planted/*.patch is a one-to-three-line bug
# in the code under test, headed by the ctest name of the test that must catch
# it ("Test: <name>") and a line saying what it breaks ("Planted: ...").
# For each patch: apply it, build, run that test, check that the test FAILS
# (a pass, or a skip with exit 77, is reported as NOT CAUGHT), print the first
# failing check's line, take the patch out again. At the end the tree is as it
# was and the build is rebuilt from it. Not part of the ctest suite (it edits
# the sources); docs/testing.md says when to run it.
#
# Usage: bash tests/planted/run.sh [PATTERN]   (from anywhere; PATTERN picks
#   patches by file name, e.g. 05 or proto). Environment: TW_BUILD_DIR (default
#   <repo>/build, configured already), TW_PLANTED_TIMEOUT (s per test, 300).
# Exit status: 0 when every planted bug was caught, 1 otherwise, 2 on a usage
# or tree problem (a patch that does not apply: the tree is left untouched).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${TW_BUILD_DIR:-$root/build}
timeout_s=${TW_PLANTED_TIMEOUT:-300}
pattern=${1:-}
cd "$root" || exit 2
[ -f "$build/CMakeCache.txt" ] || { echo "run.sh: no configured build in $build" >&2; exit 2; }

patches=()
for p in tests/planted/*.patch; do
  [ -z "$pattern" ] || [[ "$(basename "$p")" == *"$pattern"* ]] && patches+=("$p")
done
[ ${#patches[@]} -gt 0 ] || { echo "run.sh: no patch matches '$pattern'" >&2; exit 2; }
for p in "${patches[@]}"; do # all of them must apply to the tree as it is
  git apply --check "$p" || { echo "run.sh: $p does not apply" >&2; exit 2; }
done

applied=""
restore() {
  if [ -n "$applied" ]; then git apply -R "$applied" && applied=""; fi
}
trap 'restore; exit 130' INT TERM
trap restore EXIT

log=$(mktemp -d)
caught=0 missed=0
printf '%-38s %-24s %s\n' "patch" "test" "result"
for p in "${patches[@]}"; do
  name=$(basename "$p" .patch)
  test=$(sed -n 's/^Test: //p' "$p" | head -n 1)
  git apply "$p" || { echo "run.sh: cannot apply $p" >&2; exit 2; }
  applied=$p
  if ! nice cmake --build "$build" -j2 >"$log/$name.build" 2>&1; then
    result="NOT CAUGHT: the build failed (see $log/$name.build)"
    missed=$((missed + 1))
  else
    (cd "$build" && ctest -R "^${test//./\\.}\$" --output-on-failure --timeout "$timeout_s") \
      >"$log/$name.out" 2>&1
    rc=$?
    if ! grep -q "tests passed\|tests failed" "$log/$name.out" ||
        grep -q "No tests were found" "$log/$name.out"; then
      result="NOT CAUGHT: ctest found no test $test"
      missed=$((missed + 1))
    elif [ $rc -eq 0 ]; then # passed, or skipped (77)
      result="NOT CAUGHT: $(grep -m 1 -o 'Passed\|Skipped' "$log/$name.out" || echo passed)"
      missed=$((missed + 1))
    else
      # the first failed check (C: "FAIL file:line: ...", Python: "FAIL: ...")
      # and the exception that ended the test, else ctest's line
      line=$(grep -m 1 -E '^FAIL[ :]' "$log/$name.out")
      exc=$(grep -m 1 -E '^[A-Za-z.]*(Error|Exception)\b' "$log/$name.out")
      [ -n "$exc" ] && line=${line:+$line / }$exc
      [ -n "$line" ] || line=$(grep -m 1 -E 'Failed|Timeout' "$log/$name.out")
      result="caught: ${line:-failed}"
      caught=$((caught + 1))
    fi
  fi
  git apply -R "$p" || { echo "run.sh: cannot take $p out again" >&2; exit 2; }
  applied=""
  printf '%-38s %-24s %s\n' "$name" "$test" "$result"
done
echo "rebuilding the tree as it was"
nice cmake --build "$build" -j2 >"$log/restore.build" 2>&1 || echo "run.sh: rebuild failed ($log/restore.build)"
echo "planted bugs caught: $caught of $((caught + missed)) (outputs in $log)"
[ $missed -eq 0 ]
