#!/bin/bash
# usage: LIMIT=545 bench/device/goodput.sh COMMIT TAG CONFIGS WORKLOADS [bench.goodput args...]
set -u
commit=$1; tag=$2; configs=$3; workloads=$4; shift 4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RELAYGR_COMMIT=$commit
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader; nproc; free -g | head -2
mkdir -p /tmp/r
timeout -s INT -k 30 "${LIMIT:-540}" python3 -m bench.goodput --configs "$configs" --workloads "$workloads" --repeats 1 \
  --device cuda --preset bench --slo-ms 50 --tag "$tag" --out-dir /tmp/r --logs-dir /tmp/r/svc \
  --calls-dir /tmp/r/calls "$@" 2>&1 | grep -vE '^\{' | tail -60
tar czf "$OUT/r.tgz" -C /tmp r
ls -la /tmp/r
