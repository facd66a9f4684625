#!/bin/bash
# usage: LIMIT=540 bench/device/goodput_pair.sh COMMIT TAG CONFIGS_GPU0 CONFIGS_GPU1 WORKLOADS [bench.goodput args...]
# Two goodput runs side by side on a machine of two GPUs (kind nvidia-h200-x2), one stack per
# GPU, started together with the same arguments (seed included), then merged into one report
# (`bench.goodput --merge`: refused unless both ran on one host, one boot, one commit and one
# protocol). Twice the searches per second of lease of goodput.sh's one GPU, and the two
# configurations meet the same host conditions at the same time instead of one after the other.
# Swap the sides in a repeat (baseline on GPU 1, relay on GPU 0) so that no ratio rests on one
# GPU's luck. Each side: /tmp/r/g0, /tmp/r/g1 (result, calls, service logs); the merged report
# in /tmp/r; all tarred to $OUT/r.tgz. Each side's run is limited to LIMIT seconds.
set -u
commit=$1; tag=$2; side0=$3; side1=$4; workloads=$5; shift 5
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RELAYGR_COMMIT=$commit
nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv,noheader; nproc; free -g | head -2
if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
  echo "goodput_pair.sh needs two GPUs (kind nvidia-h200-x2)"; exit 1
fi
rm -rf /tmp/r && mkdir -p /tmp/r/g0 /tmp/r/g1 && touch -d '1 minute ago' /tmp/r.started
# The host's layout (cores, hyperthreads, NUMA nodes, each GPU's CPU affinity): the two sides'
# processes share it, and the mix's limits moved 499-734 req/s between calls (k16-k18).
{ lscpu; echo; nvidia-smi topo -m; } > /tmp/r/host.txt 2>&1

side() {  # GPU index, its configurations
  local gpu=$1 configs=$2
  shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout -s INT -k 30 "${LIMIT:-540}" python3 -m bench.goodput \
    --configs "$configs" --workloads "$workloads" --repeats 1 --device cuda --preset bench --slo-ms 50 \
    --tag "$tag-g$gpu" --out-dir "/tmp/r/g$gpu" --logs-dir "/tmp/r/g$gpu/svc" --calls-dir "/tmp/r/g$gpu/calls" \
    "$@" > "/tmp/r/g$gpu/goodput.log" 2>&1
}
side 0 "$side0" "$@" &
first=$!
side 1 "$side1" "$@" &
second=$!
wait "$first" "$second"
for gpu in 0 1; do
  echo "== GPU $gpu: $([ "$gpu" = 0 ] && echo "$side0" || echo "$side1")"
  grep -E "grid|rate|goodput" "/tmp/r/g$gpu/goodput.log" | grep -vE '^\{' | cut -c1-260 | tail -25
done
results=$(ls /tmp/r/g0/goodput-*.json /tmp/r/g1/goodput-*.json 2>/dev/null)
if [ "$(echo "$results" | grep -c json)" -eq 2 ]; then
  # shellcheck disable=SC2086  # two paths
  python3 -m bench.goodput --merge $results --tag "$tag" --out-dir /tmp/r 2>&1 | tail -30
else
  echo "not merged: a side wrote no result file ($results)"
fi
find /tmp/r -type f ! -newer /tmp/r.started -print -delete | sed 's/^/stale, left out: /'
tar czf "$OUT/r.tgz" -C /tmp r
ls -la /tmp/r
