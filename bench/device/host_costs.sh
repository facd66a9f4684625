#!/bin/bash
# usage: bench/device/host_costs.sh COMMIT -- bench.host_costs contended at switch intervals 0.5 and 0.1 ms,
# and at the ranker's settings (0.05 ms, timer slack 1 us)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RELAYGR_COMMIT=$1
mkdir -p /tmp/r
timeout 150 python3 -m bench.host_costs --device cuda --out-dir /tmp/r --reps 60 2>&1 | grep -v rank_graph
timeout 120 python3 -m bench.host_costs --device cuda --out-dir /tmp/r --reps 60 --gil-switch-ms 0.1 --tag s01 2>&1 | grep gil_cont
timeout 120 python3 -m bench.host_costs --device cuda --out-dir /tmp/r --reps 60 --gil-switch-ms 0.05 --timer-slack-us 1 --tag s005 2>&1 | grep gil_cont
tar czf "$OUT/r.tgz" -C /tmp r
