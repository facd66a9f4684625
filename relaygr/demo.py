"""`relaygr demo` (the README's main job): the relay against the baseline, on the CPU.

1. The core on its own: full inference vs pre-infer + cached ranking, same scores (a few seconds).
2. The whole stack, twice (baseline: no pre-inference, no host tier; relay: everything on), each
   brought up with `relaygr up`'s launcher and driven by the same open-loop workload (retrieval
   events to Kafka, ranking calls to the router after a gap, returning users), then torn down.
Prints P50 / P99 / P99.9, SLO attainment and where calls were served, and writes the report to
runs/demo-<time>.json and .md. CPU numbers show the mechanism, not GPU performance.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from bench.relay import CONFIGS, run_point
from bench.report import machine, markdown_table
from bench.workload import WorkloadConfig
from relaygr.core_demo import print_core_demo, run_core_demo
from relaygr.launcher import Stack, StackConfig

RUNS_DIR = Path(__file__).resolve().parents[1] / "runs"


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    duration_s: float = 60.0
    rate_rps: float = 1.5
    length_scale: float = 3.0  # ML-100K history lengths x3: p50 ~200, max ~2.2k tokens
    slo_ms: float = 150.0
    users: int = 500
    rankers: int = 1
    seed: int = 0


def run_stack_demo(config: DemoConfig) -> list[dict[str, Any]]:
    workload = WorkloadConfig(
        seed=config.seed,
        duration_s=config.duration_s,
        rate_rps=config.rate_rps,
        users=config.users,
        length_scale=config.length_scale,
        recent_tokens=16,
        candidates=32,
        version_base=1_000_000,
    )
    rows = []
    for name in ("baseline", "relay"):
        print(
            f"\n[{name}] bringing the stack up ({config.rankers} ranker(s), CPU, tiny model) ...", flush=True
        )
        stack_config = StackConfig(
            rankers=config.rankers,
            slo_ms=config.slo_ms,
            trigger_args=("--suffix-tokens", "48"),
            **CONFIGS[name],
        )
        with Stack(stack_config) as stack:
            print(
                f"[{name}] replaying {config.duration_s:.0f} s at {config.rate_rps} requests/s ...",
                flush=True,
            )
            point = asyncio.run(
                run_point(stack, workload, config.slo_ms, "rate", config.rate_rps, eps_sample=1)
            )
        s = point.summary
        rows.append(
            {
                "config": name,
                "requests": s["sent"],
                "failed": s["failed"],
                "p50_ms": s["p50_ms"],
                "p99_ms": s["p99_ms"],
                "p999_ms": s["p999_ms"],
                "slo_attainment": s["slo_attainment"],
                "hbm_hit": s.get("hbm_hit", 0.0) + s.get("inflight_join", 0.0),
                "dram_reload": s.get("dram_reload", 0.0),
                "full_recompute": s.get("full_recompute", 0.0),
                "wasted_preinfer_rate": point.rankers["wasted_preinfer_rate"],
                "eps_max": point.eps_max,
            }
        )
    return rows


def main(config: DemoConfig) -> int:
    print_core_demo(run_core_demo(users=4, seed=config.seed, prefix_len=2000))
    started = time.time()
    rows = run_stack_demo(config)
    columns = list(rows[0])
    base, relay = rows
    ratio = base["p99_ms"] / relay["p99_ms"] if relay["p99_ms"] else float("nan")
    print(f"\nrelay vs baseline on the CPU (SLO {config.slo_ms:g} ms, {config.rate_rps} req/s, "
          f"{config.duration_s:.0f} s each): P99 {base['p99_ms']:.1f} -> {relay['p99_ms']:.1f} ms ({ratio:.2f}x)")  # fmt: skip
    print(markdown_table(rows, columns))
    RUNS_DIR.mkdir(exist_ok=True)
    stem = RUNS_DIR / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    report = {"machine": machine(), "config": dataclasses.asdict(config) | {"wall_s": time.time() - started},
              "results": rows}  # fmt: skip
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(f"# relaygr demo (CPU)\n\n{markdown_table(rows, columns)}")
    print(f"wrote {stem}.json and .md")
    return 0 if base["failed"] == 0 and relay["failed"] == 0 else 1
