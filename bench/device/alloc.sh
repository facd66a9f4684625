#!/bin/bash
# usage: bench/device/alloc.sh TAG -- bench.psi_alloc on this GPU: the relay's psi churn (the
# mix, then L4096) against the caching allocator as it is, with expandable segments, with its
# garbage collection, with large blocks never split, and (the mix) each with psi blocks in size
# classes; each variant a process of its own. First the GPU tests of the ranker's size classes.
# Figures: allocator retries, cudaMalloc/cudaFree calls, peak reserved vs allocated, the slowest
# allocation. Results in $OUT (psi-alloc-<device>-TAG-*.json/.md). ~1-2 minutes.
set -u
tag=${1:?usage: bench/device/alloc.sh TAG}; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p "$OUT"
# The ranker's psi size classes on CUDA first (graphs over class blocks, a freed block reused).
timeout -s INT -k 10 "${TESTS_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_psi_classes.py 2>&1 | tail -6
timeout -k 10 "${MIX_LIMIT:-240}" python3 -m bench.psi_alloc --device cuda --out-dir "$OUT" --tag "$tag-mix" "$@"
echo "mix rc=$?"
# One psi size: size classes change nothing there.
timeout -k 10 "${L_LIMIT:-120}" python3 -m bench.psi_alloc --device cuda --prefix-len 4096 \
  --variants default expandable gc nosplit --out-dir "$OUT" --tag "$tag-L4096" "$@"
echo "L4096 rc=$?"
cat "$OUT"/*.md
