#!/bin/bash
# usage: bench/device/layer.sh TAG -- the fused norms' GPU tests (kernels/fused_norms.py), then
# bench.core with each layer's norms as torch's kernels and as the fused ones, one after the
# other on this GPU (prefixes 4096 and 8192, batches 1 and 8), each with --profile at 8192 x 8:
# the cached call's device timeline (span, busy, idle inside, idle between calls) beside its wall,
# for issue 15's cached/floor. Results in $OUT/torch and $OUT/fused (core-<device>.json/.md) and
# the profiles' printout in $OUT/*.txt. Each part has its own time limit so that the rest still runs.
set -u
tag=${1:?usage: bench/device/layer.sh TAG}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
mkdir -p "$OUT"
timeout -s INT -k 20 "${TESTS_LIMIT:-180}" python3 -m pytest -q -p no:cacheprovider --durations=5 \
  tests/gpu/test_fused_norms.py 2>&1 | tail -15
for kernels in torch fused; do
  timeout -k 20 "${BENCH_LIMIT:-180}" python3 -m bench.core --device cuda --prefix-lens 4096 8192 \
    --batches 1 8 --layer-kernels "$kernels" --profile --profile-full --profile-prefix 8192 --profile-batch 8 \
    --out-dir "$OUT/$kernels" > "$OUT/core-$kernels-$tag.txt" 2>&1
  echo "bench.core --layer-kernels $kernels rc=$?"
  grep -E '^(profile|P=)' "$OUT/core-$kernels-$tag.txt"
done
ls -R "$OUT"
