#!/bin/bash
# usage: bench/device/gpu_tests.sh [pytest args] -- the CUDA-only tests (skipped in CI, which has no GPU)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu "$@" 2>&1 | tail -30
