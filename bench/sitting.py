"""One sitting of the goodput protocol on a multi-GPU host: one search per GPU, at once, merged.

    python -m bench.sitting --plan L4096,L4096,mix,mix --time-limit-s 540 --tag s3 -- \\
        --device cuda --preset bench --slo-ms 50 --hbm-budget-mb 40000 --arena-gb 96 --grid 25 50 100

Each entry of `--plan` is one (workload, repeat) search, baseline then every other configuration,
run by `bench.goodput` on its own GPU (`CUDA_VISIBLE_DEVICES` = its index in the plan), all at
once: the protocol's repeats fit one sitting where a single GPU would need several calls. After
`--time-limit-s` every search still running is interrupted (SIGINT: bench.goodput keeps what it
measured, the search under way marked incomplete). The result files are then combined with
`bench.goodput --merge` (same host, commit and protocol) into goodput-<device>-<tag>.json / .md.

Several stacks share one host's CPUs: the report's machine says which GPUs; compare
configurations within one GPU's search. Arguments after `--` go to every bench.goodput run
(`--workloads`, `--repeats`, `--tag` and `--out-dir` are set here).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import goodput
from bench.report import RESULTS_DIR

_OWN = ("--workloads", "--repeats", "--tag", "--out-dir", "--merge")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    passed: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passed = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--plan", required=True, help="comma-separated workloads, one search per GPU (e.g. L4096,mix)"
    )
    p.add_argument(
        "--time-limit-s", type=float, default=540.0, help="searches still running then are interrupted"
    )
    p.add_argument("--tag", required=True, help="names the merged result (letters, digits, '.', '_', '-')")
    p.add_argument("--out-dir", default=None, help="where every file goes (default bench/results)")
    p.add_argument("--logs-dir", default=None, help="each search's output: <dir>/<tag>-gpu<i>.log")
    args = p.parse_args(argv)
    args.plan = [w.strip() for w in args.plan.split(",") if w.strip()]
    if not args.plan:
        p.error("--plan: at least one workload")
    if args.time_limit_s <= 0:
        p.error("--time-limit-s must be > 0")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.tag):
        p.error("--tag: letters, digits, '.', '_' and '-' only")
    clash = [a for a in passed if a.split("=")[0] in _OWN]
    if clash:
        p.error(f"{', '.join(clash)}: set by bench.sitting, not passed through")
    for workload in args.plan:  # the same check bench.goodput makes, before anything starts
        try:
            goodput.workload_config(workload, goodput.WorkloadConfig())
        except ValueError as exc:
            p.error(f"--plan: {exc}")
    return args, passed


def main(argv: list[str] | None = None) -> list[Path]:
    """Runs the sitting; returns the merged report's paths ([] when fewer than two searches left
    a result file: then there is nothing to merge, and each file stands as written)."""
    args, passed = parse_args(argv)
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    logs_dir = Path(args.logs_dir) if args.logs_dir else out_dir
    logs_dir.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    for gpu, workload in enumerate(args.plan):
        tag = f"{args.tag}-{workload}-gpu{gpu}"
        cmd = [sys.executable, "-m", "bench.goodput", *passed, "--workloads", workload, "--repeats", "1",
               "--tag", tag, "--out-dir", str(out_dir)]  # fmt: skip
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
        with open(logs_dir / f"{tag}.log", "wb") as log:  # the child keeps its own copy of the fd
            procs.append((tag, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)))
        print(f"[sitting] gpu {gpu}: {workload} -> {tag}", flush=True)
    deadline = time.monotonic() + args.time_limit_s
    for tag, proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"[sitting] {tag}: time limit, interrupting", flush=True)
            proc.send_signal(signal.SIGINT)
    for tag, proc in procs:
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        print(f"[sitting] {tag}: exit {rc}", flush=True)
    files = [f for tag, _ in procs for f in sorted(out_dir.glob(f"goodput-*-{tag}.json"))]
    if len(files) < 2:
        print(f"[sitting] {len(files)} result file(s): nothing to merge", flush=True)
        return []
    return goodput.main(["--merge", *map(str, files), "--tag", args.tag, "--out-dir", str(out_dir)])


if __name__ == "__main__":
    main()
