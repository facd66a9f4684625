#!/bin/bash
# usage: LIMIT=545 [PYSPY_S=20] [GPU_TESTS="tests/gpu/x.py ..."] bench/device/goodput.sh COMMIT TAG CONFIGS WORKLOADS [bench.goodput args...]
# GPU_TESTS: pytest files run first (their tail printed and kept in /tmp/r/gpu-tests.log); if
# they fail, no search runs (the lease's time is not spent measuring broken code). Their time
# comes out of LIMIT: LIMIT bounds tests and search together (k14a: tests that took 220 s
# instead of ~70 pushed a search given its own LIMIT past the call's limit, and the call was
# killed before it wrote the search's file).
# PYSPY_S: a py-spy profile (non-blocking, every thread, idle frames included, raw collapsed
# stacks) of the first ranker for that many seconds from each search's first point, one file a
# search under /tmp/r/pyspy-<n>.txt (py-spy's wheel in .whl/).
set -u
commit=$1; tag=$2; configs=$3; workloads=$4; shift 4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RELAYGR_COMMIT=$commit
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader; nproc; free -g | head -2
# The mark is set back a minute: file times are coarse (a jiffy), and a file this call makes
# at once must not look as old as the mark.
rm -rf /tmp/r && mkdir -p /tmp/r && touch -d '1 minute ago' /tmp/r.started

ranker_pid() {
  # The ranker's own process: argv names the module (matching /proc/*/cmdline with grep would
  # match the grep too).
  python3 - <<'EOF'
import os
for pid in os.listdir("/proc"):
    if not pid.isdigit():
        continue
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        continue
    if b"services.ranker" in argv[1:4]:
        print(pid)
        break
EOF
}

profile_searches() {
  # Each "grid from" line starts a search: once its lead-in is over, profile the ranker.
  local n=0 seen=0
  while sleep 1; do
    local now
    now=$(grep -c "grid from" /tmp/r/goodput.log 2>/dev/null || true)
    if [ "${now:-0}" -gt "$seen" ]; then
      seen=$now; n=$((n + 1))
      sleep 12  # the warm-up replay and the point's lead-in
      local pid
      pid=$(ranker_pid)
      local spy=/tmp/site/bin/py-spy
      [ -x "$spy" ] || spy=py-spy
      [ -n "$pid" ] && "$spy" record --nonblocking --threads --idle --format raw \
        -d "$PYSPY_S" -r 200 -p "$pid" -o "/tmp/r/pyspy-$n.txt" > "/tmp/r/pyspy-$n.log" 2>&1 &
    fi
  done
}

began=$SECONDS
if [ -n "${GPU_TESTS:-}" ]; then
  # shellcheck disable=SC2086  # a list of files
  timeout 300 python3 -m pytest -q -p no:cacheprovider $GPU_TESTS > /tmp/r/gpu-tests.log 2>&1
  status=$?
  echo "gpu tests: exit $status"; tail -15 /tmp/r/gpu-tests.log
  if [ "$status" -ne 0 ]; then
    tar czf "$OUT/r.tgz" -C /tmp r
    exit 1
  fi
fi

watcher=""
if [ -n "${PYSPY_S:-}" ]; then
  profile_searches &
  watcher=$!
fi
limit=$(( ${LIMIT:-540} - (SECONDS - began) ))
if [ "$limit" -lt 60 ]; then
  echo "only ${limit} s of LIMIT left after the GPU tests: no search"
  tar czf "$OUT/r.tgz" -C /tmp r
  exit 1
fi
timeout -s INT -k 30 "$limit" python3 -m bench.goodput --configs "$configs" --workloads "$workloads" --repeats 1 \
  --device cuda --preset bench --slo-ms 50 --tag "$tag" --out-dir /tmp/r --logs-dir /tmp/r/svc \
  --calls-dir /tmp/r/calls "$@" 2>&1 | tee /tmp/r/goodput.log | grep -vE '^\{' | tail -60
[ -n "$watcher" ] && kill "$watcher" 2>/dev/null
sleep 1
# Only this call's files: on k14's lease (2026-11-30) /tmp/r also held calls and results of runs
# from a day before (another lease's /tmp on the same host), which looked like this run's.
find /tmp/r -type f ! -newer /tmp/r.started -print -delete | sed 's/^/stale, left out: /'
tar czf "$OUT/r.tgz" -C /tmp r
ls -la /tmp/r
