"""`relaygr demo` (the README's main job): the relay against the baseline, on the CPU.

1. The core on its own: full inference vs pre-infer + cached ranking, same scores (a few seconds).
2. The whole stack, twice (baseline: no pre-inference, no host tier; relay: everything on), each
   brought up with `relaygr up`'s launcher and driven by the same open-loop workload (retrieval
   events to Kafka, ranking calls to the router after a gap, returning users) under the same SLO,
   then torn down.
3. The SLO is calibrated on this machine unless given: before its replay, each stack ranks a few
   of the workload's requests in full through the router (the same calls on both stacks: their
   warm-up), and on the baseline stack the SLO becomes the measured latency of the request at the
   `slo_percentile` of the workload's prefix lengths. Longer requests cannot meet it when ranked
   in full, which is what relay is for; the trigger pre-infers requests it predicts above
   risk_fraction x SLO. A constant SLO fits one machine's speed only: on a faster one nothing is
   at risk and the relay has nothing to show. The calibration states how many of the workload's
   requests it puts at risk, by the ranker's own measurements fitted as the trigger fits them.
Prints SLO attainment and the latency percentiles that the number of calls supports (a minute at
1.5 req/s gives ~90 calls: P50 and P90, not P99, which would be the slowest call or next to it),
where calls were served and what the trigger decided, and writes the report to
runs/demo-<time>.json and .md. If the relay pre-inferred nothing or
served no call from HBM, the demo showed nothing: it says so loudly, with the trigger's decision
counts, and exits with status 3. CPU numbers show the mechanism, not GPU performance.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from relaygr.core_demo import print_core_demo, run_core_demo
from relaygr.harness import machine, markdown_table, ranker_stats, run_point, stack_overrides
from relaygr.launcher import Stack, StackConfig
from relaygr.preflight import check_stack
from relaygr.workload import Materializer, PlannedRequest, Workload, WorkloadConfig, generate
from services.trigger.latency_model import LatencyModel, Sample
from shared.config import ConfigError
from shared.modelspec import preset
from shared.protos import ranker_pb2_grpc as pb_grpc
from shared.stats import percentile

RUNS_DIR = Path(__file__).resolve().parents[1] / "runs"
PRESET = "tiny"
# Percentiles of the workload's prefix lengths ranked for the calibration (the SLO's is added).
CALIBRATION_PERCENTILES = (10.0, 50.0, 75.0, 100.0)
# Probe calls use the workload's tokens under versions it never uses: no psi exists for them.
PROBE_VERSION_OFFSET = 500_000_000
EXIT_NOTHING_SHOWN = 3  # 2 is a bad command line (relaygr/cli.py)
# A latency percentile is reported only when at least this many calls are expected beyond it.
# With fewer, the nearest-rank estimate is the sample's slowest call or next to it, and one
# slow call sets it (P99 of 73 calls is their maximum): P90 needs 20 calls, P99 200, P99.9 2000.
MIN_CALLS_BEYOND = 2
# The percentiles reported, and their keys in relaygr.replay's summary.
REPORTED_PERCENTILES = {50.0: "p50_ms", 90.0: "p90_ms", 99.0: "p99_ms", 99.9: "p999_ms"}


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    duration_s: float = 60.0
    rate_rps: float = 1.5
    length_scale: float = 3.0  # ML-100K history lengths x3 (500 users, a minute: p50 ~100, max ~950 tokens)
    slo_ms: float | None = None  # None: calibrated on this machine (see the module docstring)
    slo_percentile: float = 90.0  # the SLO is the measured full ranking of this percentile's request
    risk_fraction: float = 0.5  # the trigger's: at risk when predicted full ranking > this x SLO
    users: int = 500
    rankers: int = 1
    seed: int = 0
    recent_tokens: int = 16
    candidates: int = 32
    probe_rounds: int = 7

    def workload(self) -> WorkloadConfig:
        return WorkloadConfig(
            seed=self.seed,
            duration_s=self.duration_s,
            rate_rps=self.rate_rps,
            users=self.users,
            length_scale=self.length_scale,
            recent_tokens=self.recent_tokens,
            candidates=self.candidates,
            version_base=1_000_000,
        )


def stack_config(config: DemoConfig, name: str, slo_ms: float | None) -> StackConfig:
    """The stack of configuration `name` (relaygr.harness.CONFIGS) under `slo_ms` (None: the
    launcher's default, what the baseline runs with before calibration)."""
    overrides, trigger_extra = stack_overrides(name)
    return StackConfig(
        rankers=config.rankers,
        slo_ms=StackConfig.slo_ms if slo_ms is None else slo_ms,
        preset=PRESET,
        trigger_args=(
            "--suffix-tokens-estimate",
            str(config.recent_tokens + config.candidates),
            "--risk-fraction",
            str(config.risk_fraction),
            *trigger_extra,
        ),
        **overrides,
    )


def check(config: DemoConfig, names: Sequence[str] = ("baseline", "relay")) -> None:
    """Everything the demo would reject after it started, checked before it starts anything:
    the workload and each stack's settings (flags and RELAYGR_* environment), as the services
    will read them. Raises ConfigError."""
    try:
        config.workload()  # WorkloadConfig checks itself
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for name in names:
        check_stack(stack_config(config, name, config.slo_ms))


def min_calls(q: float) -> int:
    """Calls a sample needs before its q-th percentile is reported (see MIN_CALLS_BEYOND)."""
    return math.ceil(MIN_CALLS_BEYOND * 100 / (100 - q) - 1e-9)


def percentile_supported(q: float, calls: int) -> bool:
    return calls >= min_calls(q)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The SLO both configurations run under, and what it puts at risk by this machine's timings."""

    slo_ms: float
    slo_source: str  # how slo_ms was chosen, in words
    measured_ms: dict[int, float]  # prefix length -> median full ranking through the stack (ms)
    at_risk_requests: int  # of the workload's, predicted (as the trigger would) above risk x SLO
    requests: int
    at_risk_from_prefix: int | None  # shortest at-risk prefix length in the workload (None: none)

    def describe(self, risk_fraction: float) -> str:
        timed = ", ".join(f"{n}: {ms:.1f}" for n, ms in sorted(self.measured_ms.items()))
        at_risk = (
            f"{self.at_risk_requests} of {self.requests} requests (prefix >= {self.at_risk_from_prefix} tokens)"
            if self.at_risk_from_prefix is not None
            else f"none of the {self.requests} requests"
        )
        return (
            f"SLO {self.slo_ms:.1f} ms ({self.slo_source})\n"
            f"full ranking through the stack, ms by prefix tokens: {timed}\n"
            f"the trigger pre-infers requests whose full ranking it predicts above {risk_fraction:g} x SLO = "
            f"{risk_fraction * self.slo_ms:.1f} ms: by the ranker's measurements, {at_risk}"
        )


def probe_requests(workload: Workload, slo_percentile: float) -> tuple[list[PlannedRequest], int]:
    """A few of the workload's requests spanning its prefix lengths (one per distinct length), and
    the prefix length at `slo_percentile` (one of theirs)."""
    if not workload.requests:
        raise ValueError("the workload has no requests")
    by_length = {r.prefix_len: r for r in workload.requests}
    lengths = [float(r.prefix_len) for r in workload.requests]
    tail_len = int(percentile(lengths, slo_percentile))
    probes = {int(percentile(lengths, q)) for q in CALIBRATION_PERCENTILES} | {tail_len}
    return [by_length[n] for n in sorted(probes)], tail_len


def calibrate(
    workload: Workload,
    measured_ms: dict[int, float],
    samples: list[Sample],
    slo_percentile: float,
    risk_fraction: float,
    slo_ms: float | None = None,
) -> Calibration:
    """The SLO: the measured ranking latency (`measured_ms`, by prefix length) of the workload's
    request at `slo_percentile` of its prefix lengths, unless `slo_ms` is given. `samples` (the
    ranker's full-ranking measurements) are fitted with the trigger's own latency model to count
    the workload's requests that the SLO puts at risk on an idle instance."""
    _, tail_len = probe_requests(workload, slo_percentile)
    model = LatencyModel(preset(PRESET), assumed_tflops=1.0)
    model.observe(samples)
    if not model.calibrated:
        raise ValueError("the ranker's measurements span fewer than 3 lengths: nothing to fit")
    if slo_ms is None:
        slo_ms = measured_ms[tail_len]
        source = (
            f"measured full ranking of the workload's p{slo_percentile:g}-length request, {tail_len} "
            "prefix tokens: longer ones miss it when ranked in full"
        )
    else:
        source = "given"
    suffix = workload.config.recent_tokens + workload.config.candidates
    threshold = risk_fraction * slo_ms
    at_risk = [r.prefix_len for r in workload.requests if model.full_ms(r.prefix_len + suffix) > threshold]
    return Calibration(
        slo_ms, source, measured_ms, len(at_risk), len(workload.requests), min(at_risk, default=None)
    )


async def probe_stack(
    stack: Stack, workload: Workload, requests: list[PlannedRequest], rounds: int
) -> tuple[dict[int, float], list[Sample]]:
    """Ranks each request in full through the router, `rounds` times in turn (a burst of contention
    from elsewhere on the machine then slows every length alike), after one untimed round (the
    first calls of a fresh stack pay one-off costs: this is also the stack's warm-up). Returns the
    median client latency by prefix length, and the ranker's full-ranking measurements as the
    trigger reads them from Stats."""
    materializer = Materializer.for_workload(workload)
    latencies: dict[int, list[float]] = {r.prefix_len: [] for r in requests}
    options = [("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.router_port}", options=options) as channel:
        router = pb_grpc.RankerStub(channel)
        for round_ in range(rounds + 1):
            for r in requests:
                probe = dataclasses.replace(r, prefix_version=r.prefix_version + PROBE_VERSION_OFFSET,
                                            request_id=f"probe{round_}-{r.request_id}")  # fmt: skip
                request = materializer.rank_request(probe)
                started = time.perf_counter()
                await router.Rank(request, timeout=60)
                if round_:
                    latencies[r.prefix_len].append((time.perf_counter() - started) * 1e3)
    samples = []
    for stats in await ranker_stats(stack.ranker_targets):
        samples += [Sample(max(1, b.tokens // b.batch), b.compute_ms) for b in stats.recent_batches
                    if b.full and b.batch > 0]  # fmt: skip
    return {n: statistics.median(ms) for n, ms in latencies.items()}, samples


def trigger_decisions(rankers: dict[str, Any]) -> dict[str, int]:
    """The trigger's decisions over a point by reason, from run_point's counters."""
    return {key.removeprefix("trigger_"): int(value) for key, value in rankers.items()
            if key.startswith("trigger_") and not key.startswith("trigger_admitted_")}  # fmt: skip


def run_stack_demo(
    config: DemoConfig, names: Sequence[str] = ("baseline", "relay")
) -> tuple[Calibration, list[dict[str, Any]]]:
    """Brings up each configuration in turn, probes it and replays the workload through it. The
    SLO is calibrated on the first stack, which must be the baseline: its trigger never
    pre-infers, so the SLO it was started with (before calibration) plays no part."""
    if not names or names[0] != "baseline":
        raise ValueError("the first configuration must be the baseline (the SLO is calibrated on it)")
    workload = generate(config.workload())
    probes, _ = probe_requests(workload, config.slo_percentile)
    calibration: Calibration | None = None
    rows = []
    for name in names:
        print(
            f"\n[{name}] bringing the stack up ({config.rankers} ranker(s), CPU, tiny model) ...", flush=True
        )
        slo_ms = calibration.slo_ms if calibration is not None else config.slo_ms
        with Stack(stack_config(config, name, slo_ms)) as stack:
            print(f"[{name}] ranking {len(probes)} of the workload's requests in full, {config.probe_rounds} "
                  "times each (warm-up and calibration) ...", flush=True)  # fmt: skip
            measured, samples = asyncio.run(probe_stack(stack, workload, probes, config.probe_rounds))
            if calibration is None:
                calibration = calibrate(workload, measured, samples, config.slo_percentile, config.risk_fraction,
                                        config.slo_ms)  # fmt: skip
                print(calibration.describe(config.risk_fraction), flush=True)
                if calibration.at_risk_requests == 0:
                    warn([f"no request of this workload is at risk under an SLO of {calibration.slo_ms:.1f} ms:",
                          "the relay run will have nothing to pre-infer"])  # fmt: skip
            print(
                f"[{name}] replaying {config.duration_s:.0f} s at {config.rate_rps} requests/s ...",
                flush=True,
            )
            point = asyncio.run(
                run_point(stack, config.workload(), calibration.slo_ms, "rate", config.rate_rps, eps_sample=1)
            )
            decisions = trigger_decisions(point.rankers)
        s = point.summary
        # Latencies are of the answered calls; a percentile they cannot support is left out (None).
        latency = {key: s[key] if percentile_supported(q, s["ok"]) else None
                   for q, key in REPORTED_PERCENTILES.items()}  # fmt: skip
        rows.append(
            {
                "config": name,
                "requests": s["sent"],
                "answered": s["ok"],
                "failed": s["failed"],
                **latency,
                "slo_attainment": s["slo_attainment"],
                "preinfer_admitted": decisions.get("admitted", 0),
                "psi_produced": int(point.rankers["psi_produced"]),
                # Served from psi in HBM: resident, joined, or built in part and completed by the call.
                "hbm_hit": s.get("hbm_hit", 0.0) + s.get("inflight_join", 0.0) + s.get("partial_prefix", 0.0),
                "dram_reload": s.get("dram_reload", 0.0),
                "full_recompute": s.get("full_recompute", 0.0),
                "wasted_preinfer_rate": point.rankers["wasted_preinfer_rate"],
                "eps_max": point.eps_max,
                "trigger_decisions": decisions,
            }
        )
    assert calibration is not None
    return calibration, rows


def relay_problems(relay: dict[str, Any]) -> list[str]:
    """Why a relay run demonstrated nothing (empty when it pre-inferred and hit HBM)."""
    problems = []
    if relay["preinfer_admitted"] == 0:
        problems.append(
            f"the trigger admitted no pre-inference (its decisions: {relay.get('trigger_decisions')})"
        )
    if relay["psi_produced"] == 0:
        problems.append("the rankers produced no psi")
    if relay["hbm_hit"] == 0:
        problems.append("no ranking call was served from HBM")
    return problems


def headline(slo_ms: float, config: DemoConfig, base: dict[str, Any], relay: dict[str, Any]) -> str:
    """The comparison in a few lines, claiming only what the samples support: SLO attainment with
    the number of answered calls, then each percentile of REPORTED_PERCENTILES if both runs have
    enough calls for it (`min_calls`), else "n too small" with the number needed."""
    n_base, n_relay = base["answered"], relay["answered"]
    lines = [
        f"relay vs baseline on the CPU (SLO {slo_ms:.1f} ms, {config.rate_rps:g} req/s, "
        f"{config.duration_s:g} s each):",
        f"  SLO attainment {base['slo_attainment']:.1%} -> {relay['slo_attainment']:.1%} "
        f"(n = {n_base} -> {n_relay} answered calls)",
    ]
    for q, key in REPORTED_PERCENTILES.items():
        label = f"P{q:g}"
        if percentile_supported(q, min(n_base, n_relay)):
            lines.append(f"  {label} {base[key]:.1f} -> {relay[key]:.1f} ms")
        else:
            lines.append(f"  {label}: n too small (needs >= {min_calls(q)} calls per run for {MIN_CALLS_BEYOND} "
                         "beyond it; a longer --duration-s or a higher --rate gives more)")  # fmt: skip
    return "\n".join(lines)


def _shown(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for the printed table: a percentile left out says why."""
    return [{k: "n too small" if v is None else v for k, v in row.items()} for row in rows]


def warn(lines: Sequence[str]) -> None:
    bar = "!" * 100
    print("\n".join([bar, *(f"!! {line}" for line in lines), bar]), flush=True)


def main(config: DemoConfig) -> int:
    """Runs the demo (see the module docstring); 0, or 1 if calls failed, or EXIT_NOTHING_SHOWN.
    Raises ConfigError for a bad config before it starts anything (see check)."""
    check(config)
    print_core_demo(run_core_demo(users=4, seed=config.seed, prefix_len=2000))
    started = time.time()
    shape = generate(config.workload()).describe()
    print(f"\nworkload: {shape['requests']} requests over {config.duration_s:.0f} s, prefix tokens p50 "
          f"{shape['prefix_len_p50']:.0f} / p90 {shape['prefix_len_p90']:.0f} / max {shape['prefix_len_max']:.0f}, "
          f"{shape['returning_fraction']:.0%} returning")  # fmt: skip
    calibration, rows = run_stack_demo(config)
    base, relay = rows
    print("\n" + headline(calibration.slo_ms, config, base, relay))
    columns = [c for c in rows[0] if c != "trigger_decisions"]
    print(markdown_table(_shown(rows), columns))
    print(f"trigger decisions (relay): {relay['trigger_decisions']}")
    problems = relay_problems(relay)
    if problems:
        warn(["the relay run demonstrated nothing:", *problems,
              "the trigger's trigger_decisions log lines (relaygr up streams them) show its latency model"])  # fmt: skip
    RUNS_DIR.mkdir(exist_ok=True)
    stem = RUNS_DIR / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    report = {"machine": machine(), "config": dataclasses.asdict(config) | {"wall_s": time.time() - started},
              "workload": shape, "calibration": dataclasses.asdict(calibration), "results": rows,
              "problems": problems}  # fmt: skip
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(
        f"# relaygr demo (CPU)\n\n{calibration.describe(config.risk_fraction)}\n\n"
        f"{headline(calibration.slo_ms, config, base, relay)}\n\n{markdown_table(_shown(rows), columns)}"
    )
    print(f"wrote {stem}.json and .md")
    if base["failed"] or relay["failed"]:
        return 1
    return EXIT_NOTHING_SHOWN if problems else 0
