#!/bin/bash
# usage: bench/device/kernels.sh TAG -- the attention kernel's GPU tests, then bench.attention over
# the serving shapes (batch 1 and 8, prefixes 8192 and 4096, full and cached) with every variant
# it times: the tile configurations of SWEEP, the old program order, two-pass split sums, and
# forced split counts in both sum modes. Results land in $OUT (attention[-variants]-<device>-TAG).
# About 500 s on an H200; each part has its own time limit so that the other still runs.
set -u
tag=${1:?usage: bench/device/kernels.sh TAG}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout -s INT -k 20 "${TESTS_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider --durations=5 \
  tests/gpu/test_attention_splits.py tests/gpu/test_triton_attention.py 2>&1 | tail -15
mkdir -p "$OUT"
timeout -k 20 "${BENCH_LIMIT:-240}" python3 -m bench.attention --prefix 8192 4096 --batch 1 8 --sweep \
  --splits 2 4 7 11 --out-dir "$OUT" --tag "$tag" 2>&1 | grep -v '^{' | grep -v '^wrote' | tail -120
ls "$OUT"
