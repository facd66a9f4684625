#!/bin/bash
# usage: bench/device/gpu_tests.sh [test paths] [pytest args] -- the CUDA-only tests (skipped in CI,
# which has no GPU): all of tests/gpu, or only the paths given (tests/gpu/test_x.py[::name]).
# On an H200 (2026-11-29) the whole suite does not finish in one call (most of its time is Triton
# compiles): the limit is 540 s, a time limit interrupts pytest (SIGINT) so that it still reports
# what passed, and the slowest tests are listed. Split it by file across calls.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
targets=tests/gpu
for arg in "$@"; do
  case "$arg" in tests/*) targets= ;; esac
done
timeout -s INT -k 30 "${LIMIT:-540}" python3 -m pytest -v -p no:cacheprovider --durations=15 $targets "$@" \
  > /tmp/gpu_tests.log 2>&1
echo "pytest rc=$?"
grep -E 'PASSED|FAILED|ERROR|SKIPPED' /tmp/gpu_tests.log | sed -E 's/ +\[ *[0-9]+%\]//' | tail -80
sed -n '/slowest/,$p' /tmp/gpu_tests.log | tail -30
mkdir -p "$OUT" && cp /tmp/gpu_tests.log "$OUT/" 2>/dev/null || true
