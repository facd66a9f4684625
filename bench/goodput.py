"""Goodput: the highest offered rate each configuration serves within the SLO, found, never floored.

    python -m bench.goodput --device cuda --preset bench --slo-ms 50 --configs baseline,relay \\
        --workloads L2048,L4096,L8192,L12288,mix --repeats 2          # the GPU run (see README)
    python -m bench.goodput --configs baseline,relay --workloads L256 --grid 2 4 --slo-ms 1 \\
        --min-duration-s 1 --min-calls 4                               # a CPU smoke run (tiny model)

Protocol (../shared/EVALUATION.md). Per (configuration, workload, repeat), open-loop replays
(relaygr/workload.py, relaygr/harness.py's run_point) at rates chosen by `LimitSearch`:
  1. grid: the rates of `--grid` in ascending order, extended geometrically (x `--growth`) past
     its top while every point meets, up to `--cap-rps` (a result is censored only if the cap
     itself meets). Stepping stops at the first miss (P99 > SLO, or any call failed or unsent),
     but not before every grid rate at which an earlier configuration met on the same workload
     and repeat has been measured: P99s of all configurations compare at equal rates.
  2. down: if the first grid rate misses, rates grid[0] / growth^k until one meets or the next
     would fall under `--floor-rps`, which is then measured itself (missed too: goodput is 0).
  3. bisect between the highest rate that met below the first miss and the first miss, until
     they are within `--precision` (10%) of each other: goodput_rps is the former,
     first_miss_rps the latter.
  4. compare (the length mix only): every rate at which the baseline met that this
     configuration has not measured yet, for the never-worse table. These do not move the limit.
A point at which the load generator fell behind its schedule (send lag P99 over
`--client-lag-bound-ms`) measured the client, not the stack: it is `client_bound`, is no miss,
and ends the search censored at the highest rate met below it (`client_bound_rps`), unless a
real miss below it already bounds the limit. A point measured while the stack was broken (the
trigger or the router lost the broker renewed before it, and could not be restarted) is
`stack_broken` and ends the search the same way (`stack_broken_rps`). `--client-processes N` replays each point from N
processes (relaygr/load.py: users sharded across them) so that the client is not the limit.
Each point measures max(`--min-duration-s`, `--min-calls` / rate) seconds (10 s and 400 calls by
default) and records how many calls it sent, after `--lead-in-s` (10 s) of the same workload
replayed unmeasured: without it the window starts cold and, users coming back seconds to
minutes later, only ~1/3 of a 10 s point's calls return to a psi (`returning_share` per
point; the session model's steady state is ~2/3). `--repeats` N repeats the headline workloads (L4096
and the mix; `--repeat-workloads` names others) N times in the same run, repeat r with the workload
seed --seed + r (configurations compared at one repeat meet the same arrivals, repeats different
ones); the report gives the median and every value.

Why configuration by configuration (each stack up once, all its workloads, then the next) and not
rate by rate across configurations: two stacks on one accelerator would measure each other, and
restarting a stack per rate costs its warm-up (minutes on a GPU: kernel compiles, graph capture)
and discards warm state that belongs to it. The same grid is still stepped by every configuration
(rule 1), and the baseline runs first so that every later configuration knows the rates it must
reach for the comparisons.

Per point: P50 / P99 / P99.9, calls, served-by fractions (hbm_hit, inflight_join, partial_prefix,
dram_reload, full_recompute), the device's busy fraction and device seconds of ranking,
pre-inference and unused psi (the rankers' counters, services/ranker/device_time.py); the tiers:
`prefetch` (the share of served calls that read psi reloaded from DRAM ahead of them) with the
prefetches issued / used / wasted / failed, demotions and their lag (P99, the rankers' recent
window), HBM evictions, the DRAM tier's evictions and peak bytes; the trigger's decisions by
reason; the P99 of each server stage and the slowest calls whole (where the tail's time went).

A run cut short (a time limit, Ctrl-C) keeps every finished search and the points of the one
under way (marked incomplete, left out of the medians). To fit the repeats of one sitting into
a time limit, run one search per GPU of a host at once and combine the files with `--merge`.

Writes bench/results/goodput-<device>[-<tag>].json and .md (goodput per configuration and
workload, relay / baseline, the never-worse table) and one PNG per workload (P99 vs rate).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench import relay
from bench.report import RESULTS_DIR, write_result
from relaygr.harness import (
    CONFIGS,
    GATE_FIELDS,
    drain,
    machine,
    markdown_table,
    ranker_latency_target_ms,
    ranker_slo_ms,
    ranker_step_costs,
    run_point,
    trigger_settings,
)
from relaygr.launcher import Stack
from relaygr.load import LoadGenerator
from relaygr.search import (
    CLIENT_LAG_BOUND_MS,
    RATE_TOL,
    LimitSearch,
    Point,
    SearchConfig,
    SearchResult,
    recorded_beyond_reach,
)
from relaygr.workload import WorkloadConfig, generate

HEADLINE = ("L4096", "mix")  # the workloads --repeats repeats unless --repeat-workloads names others
NEVER_WORSE = "mix"  # the workload of the never-worse table
REFERENCE = "baseline"
NEVER_WORSE_TOLERANCE = 1.1  # relay P99 / baseline P99 allowed at a rate where the baseline meets
_SERVED = ("hbm_hit", "inflight_join", "partial_prefix", "dram_reload", "full_recompute")


# ---------------------------------------------------------------------- workloads


def workload_config(name: str, base: WorkloadConfig) -> WorkloadConfig:
    """`L<n>`: every prefix exactly n tokens; `mix`: the ML-100K length mix of `base`. A suffix
    `-s1` makes every session a single request (no reuse at all: EVALUATION's "where the gain
    comes from" run, e.g. `L4096-s1` beside `L4096`)."""
    match = re.fullmatch(r"(mix|L(\d+))(-s1)?", name)
    if match is None:
        raise ValueError(f"unknown workload {name!r}: L<prefix tokens> or mix, optionally with -s1")
    cfg = dataclasses.replace(base, fixed_prefix_len=int(match.group(2)) if match.group(2) else None)
    if match.group(3):
        cfg = dataclasses.replace(cfg, session_mean_requests=1.0)
    return cfg


def point_config(
    workload: WorkloadConfig, rate: float, min_duration_s: float, min_calls: int
) -> WorkloadConfig:
    """The workload at `rate`, its measured window long enough for max(min_duration_s, min_calls /
    rate) seconds and at least min_calls planned calls (a Poisson count can fall short: then it is
    lengthened); a lead-in (workload.lead_in_s) comes before it and is not counted."""
    cfg = dataclasses.replace(workload, rate_rps=rate, duration_s=max(min_duration_s, min_calls / rate))
    for _ in range(8):
        planned = len(generate(cfg).measured)
        if planned >= min_calls:
            return cfg
        cfg = dataclasses.replace(
            cfg, duration_s=cfg.duration_s * max(1.1, 1.05 * min_calls / max(planned, 1))
        )
    raise RuntimeError(f"cannot plan {min_calls} calls at {rate} req/s")


# ---------------------------------------------------------------------- running it


def workload_name(workload: WorkloadConfig) -> str:
    """ "L<n>" for a fixed prefix length, else "mix"."""
    return f"L{workload.fixed_prefix_len}" if workload.fixed_prefix_len else "mix"


def _finite_or_none(value: float) -> float | None:
    """A figure for the JSON: None where it is not a number (JSON has no NaN)."""
    return value if math.isfinite(value) else None


def write_calls(path: Path, calls: list[dict[str, Any]]) -> None:
    """One point's calls (RequestRecord.breakdown, in send order), one JSON line each."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(c) + "\n" for c in calls))


class Runner:
    """Measures points through one running stack; every point gets fresh prefix versions."""

    def __init__(self, stack: Stack, args: argparse.Namespace, label: str = "",
                 load: LoadGenerator | None = None) -> None:  # fmt: skip
        self.stack = stack
        self.args = args
        self.load = load  # the load generator's processes (None: this one)
        self.label = label  # names the per-call files (--calls-dir)
        self._points = 0
        self.current: LimitSearch | None = None  # the search under way (its points, if cut short)

    async def measure(self, workload: WorkloadConfig, rate: float) -> Point:
        a = self.args
        self._points += 1
        # One (user, version) must always name the same tokens, and no point may hit psi that an
        # earlier one left in the tiers: each point has its own version range.
        cfg = point_config(dataclasses.replace(workload, version_base=self._points * 1_000_000), rate,
                           a.min_duration_s, a.min_calls)  # fmt: skip
        broken = ""
        if getattr(a, "fresh_broker_per_point", False):
            # Every point's events meet an empty broker: one search's records (~90k events by the
            # last point of an H200 mix search) would otherwise slow the signal path with time.
            try:
                await self.stack.renew_broker()
            except RuntimeError as exc:
                if self.stack.config.trigger_policy == "off":
                    # No signals to carry: the configuration's calls never touch Kafka (the
                    # baseline's side of k16e met this three times and its points stand).
                    print(f"[{self.label}] warning (no signal path in this configuration): {exc}", flush=True)
                else:
                    # The trigger or the router is not reading: a relay would run without
                    # pre-inference (H200, k16e). Measured and kept, but marked: it is no miss of
                    # the configuration, and the search ends there censored (Point.stack_broken).
                    broken = str(exc)
                    print(f"[{self.label}] STACK BROKEN, the search ends after this point: {exc}", flush=True)
        p = await run_point(self.stack, cfg, a.slo_ms, "rate", rate, eps_sample=0, load=self.load,
                            client_lag_bound_ms=a.client_lag_bound_ms)  # fmt: skip
        if getattr(a, "calls_dir", None):
            write_calls(Path(a.calls_dir) / f"{self.label}-{workload_name(workload)}-p{self._points}-{rate:g}.jsonl",
                        p.calls)  # fmt: skip
        s = p.summary
        record = {
            "rate_rps": rate,
            "p50_ms": s["p50_ms"],
            "p99_ms": s["p99_ms"],
            "p999_ms": s["p999_ms"],
            "meets_slo": p.ok,
            "calls": s["sent"],
            "ok": s["ok"],
            "failed": s["failed"],
            "duration_s": cfg.duration_s,
            "offered_rps": s["offered_rps"],
            "lag_ms_p99": s["lag_ms_p99"],
            # The load generator fell behind (lag_ms_p99 over --client-lag-bound-ms): not the stack's point.
            "client_bound": s["client_bound"],
            # The stack was broken when it ran (the renewed broker lost a service): no measurement
            # of the configuration; `stack_broken_reason` says which service and what it logged.
            "stack_broken": bool(broken),
            **({"stack_broken_reason": broken[:2000]} if broken else {}),
            "client_processes": s["client_processes"],
            "client_loop_lag_ms_p99": s["client_loop_lag_ms_p99"],
            "client_loop_lag_ms_max": s["client_loop_lag_ms_max"],
            # The load generator's own collector pauses (a cause of its loop lag, or not).
            "client_gc_pause_ms_max": s["client_gc_pause_ms_max"],
            "client_gc_pause_ms_total": s["client_gc_pause_ms_total"],
            # Where the tail's time went: P99 of each server stage, and the slowest calls whole.
            **{f"{stage}_ms_p99": s[f"{stage}_ms_p99"]
               for stage in ("queue", "compute", "launch", "server_total", "network")},
            "batch_p99": s["batch_p99"],
            "returning_share": s["returning_share"],
            "by_served": s["by_served"],  # latency, queue and compute per path (hit, full, ...)
            "by_user": s["by_user"],  # new and returning users' calls apart: paths, P99
            **{k: s.get(k, 0.0) for k in _SERVED},
            # nvidia-smi's busy share of the stack's GPUs (None: not sampled, e.g. on the CPU).
            "gpu_util": _finite_or_none(p.rankers["gpu_util"]),
            **{k: p.rankers[k] for k in ("busy_fraction", "starved_fraction", "starved_gaps_over_1ms",
                                         "device_gap_s", "device_starved_s", "device_fill_wait_s",
                                         "device_rank_s", "device_preinfer_s", "device_copy_s",
                                         "device_unused_psi_s", "psi_produced", "psi_from_rankings", "wasted_preinfer_rate", "reloads",
                                         "demotions", "hbm_evictions", "hbm_evicted_undemoted", "hbm_released", "resident_bytes_max",
                                         "prefetch", "prefetches_issued", "prefetches_used", "prefetches_wasted",
                                         "prefetches_failed", "demotion_lag_p99_ms", "dram_evictions",
                                         "dram_used_bytes_max", "alloc_retries", "device_mallocs", "device_frees", "demotions_skipped", "demotions_never_reloaded", "device_loop_slow", "demotions_shed", "ranking_psi_shed", "device_memory_short",
                                         "ranking_psi_declined", "ranking_psi_probed", "takeover_passes_partial",
                                         "takeover_passes_full")},
            # The rankers' host CPU ms per request as they report it (None where none did).
            "ranker_host_ms_per_request": _finite_or_none(p.rankers.get("host_ms_per_request", math.nan)),
            # What the demotion and keep gates weighed at the point's end: returns per action and
            # the host ms an action is priced at (None while not yet measured: the gate is open).
            **{k: _finite_or_none(p.rankers.get(k, math.nan)) for k in (*GATE_FIELDS, "keep_device_us_per_token")},
            **{k: v for k, v in p.rankers.items() if k.startswith("trigger_")},  # its decisions, and why
            # The host's CPUs over the point: busy, and stolen by the hypervisor (a VM's stalls).
            **{k: v for k, v in p.rankers.items() if k.startswith("host_cpu_")},
            # Our processes: cores used, their busiest thread's and their main thread's (the
            # event loop's; relaygr.cpu_usage).
            **{k: v for k, v in p.rankers.items() if k.startswith(("cpu_cores_", "cpu_top_thread_", "cpu_main_thread_"))},
            # CUDA graphs by family (cached, full, preinfer): batches replayed and run eagerly.
            **{k: v for k, v in p.rankers.items() if k.startswith("graph_")},
            # The rankers' pre-inference counters over the point (services/ranker/device_time.py,
            # every one the harness reads): steps by graph replay or eager (steps, device seconds,
            # prefixes built from, steps over 10 ms); starts (how many, their waits from submission
            # to the first step, over 50 ms, joined by then); completions (how many, build times
            # from the first step and times from submission, builds over 50 ms, completed after
            # their ranking call was planned to come).
            **{k: v for k, v in p.rankers.items() if k.startswith("preinfer_")},
            # The ranker's device loop by section (services/ranker/loop_time.py): wall, thread CPU.
            **{k: v for k, v in p.rankers.items() if k.startswith("loop_")},
            # HBM misses asked of the host tier (found, absent, no HBM room) and the reload choices.
            **{k: v for k, v in p.rankers.items() if k.startswith(("host_lookup_", "reload_decision_"))},
            # psi copies by stage (reload_*, demote_*), a call's reload path (reload_path_*): mean
            # ms per copy over the point (services/ranker/copy_stages.py).
            **{k: v for k, v in p.rankers.items() if k.endswith("_ms_mean")},
            # The ranker's garbage-collector pauses over the point: seconds, and pauses over 20 ms.
            **{k: v for k, v in p.rankers.items() if k.startswith("gc_pause")},
            # Pre-inferences dropped unstarted at the end of their lease (their calls ranked without).
            "preinfers_expired": p.rankers.get("preinfers_expired", 0.0),
            # Signals refused because their ranking call had come first (late on the signal path).
            "late_signals": p.rankers.get("late_signals", 0.0),
            # The signal path's trip (trigger -> ranker, p90 of the recent signals, ms).
            "signal_trip_p90_ms": p.rankers.get("signal_trip_p90_ms", 0.0),
            # Its trips over the point (and lead-in), and those over 50 ms.
            "signal_trips": p.rankers.get("signal_trips", 0.0),
            "signal_trips_over_50ms": p.rankers.get("signal_trips_over_50ms", 0.0),
            # Wake-ups > 20 ms late per service (ranker, router, trigger, expander): a host-wide
            # stall shows in all; event-loop timers > 20 ms late: that service's own Python work
            # (its log names what the loop was running: event_loop_stall).
            **{k: v for k, v in p.rankers.items() if k.startswith(("host_stalls_", "loop_stalls_"))},
            "slowest": p.slowest,
            "drain_s": None,  # until settle() has drained the stack after it
        }  # fmt: skip
        return Point(
            rate, s["p99_ms"], p.ok, record, client_bound=s["client_bound"], stack_broken=bool(broken)
        )

    async def settle(self, point: Point) -> None:
        """The next point starts from a quiet stack, whatever this one left queued (an overload's
        backlog on the signal path, pre-inferences, ranking calls): the seconds that took go in
        the point's record."""
        await asyncio.sleep(self.args.settle_s)
        point.record["drain_s"] = await drain(self.stack, timeout_s=self.args.drain_timeout_s)

    async def search(self, workload: WorkloadConfig, config: SearchConfig, must_reach: float,
                     compare: Sequence[float]) -> SearchResult:  # fmt: skip
        self.current = LimitSearch(config, must_reach, compare)
        while (rate := self.current.next_rate()) is not None:
            point = await self.measure(workload, rate)
            self.current.observe(point)  # kept, should the run be cut short while it settles
            await self.settle(point)
        return self.current.result()


def censored_note(result: SearchResult) -> str:
    if result.stack_broken_rps is not None and result.censored:
        return f" (CENSORED: the stack was broken at {result.stack_broken_rps:g} req/s)"
    if result.client_bound_rps is not None and result.censored:
        return f" (CENSORED: the load generator fell behind at {result.client_bound_rps:g} req/s)"
    return " (CENSORED at the cap)" if result.censored else ""


def plan(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(workload, repeat) in run order: every workload once, then the headline ones again."""
    out = [(w, 0) for w in args.workloads]
    for r in range(1, args.repeats):
        out += [(w, r) for w in args.workloads if w in args.repeat_workloads]
    return out


def repeat_seed(args: argparse.Namespace, repeat: int) -> int:
    """The workload seed of repeat `repeat`: --seed + repeat. Configurations compared at one
    repeat replay the same arrivals; repeats replay different ones, so that their spread is the
    workload's as well as the machine's (with one seed, every repeat and every rate of a search
    met the same bursts: at L8192 one burst, 14 s into each point, set the relay's
    limit in h7a and h7b)."""
    return args.seed + repeat


def incomplete_record(
    config: str, workload: str, repeat: int, search: LimitSearch, slo_ms: float
) -> dict[str, Any]:
    """A search cut short (a time limit): its points are real measurements and are kept (the
    never-worse table uses them), but it found no limit: goodput_rps and first_miss_rps are None,
    and the bounds its points set are given instead. Summaries skip it."""
    met, missed = search.bounds()
    return {
        "config": config,
        "workload": workload,
        "repeat": repeat,
        "slo_ms": slo_ms,
        "ranker_latency_target_ms": ranker_latency_target_ms(config, slo_ms),
        "ranker_slo_ms": ranker_slo_ms(config, slo_ms),
        "goodput_rps": None,
        "first_miss_rps": None,
        "censored": False,
        "client_bound_rps": search.client_bound_rps,
        "stack_broken_rps": search.stack_broken_rps,
        "incomplete": True,
        "met_rps_max": met,
        "missed_rps_min": missed,
        "points": [p.record | {"phase": phase} for phase, p in search.points()],
    }


def record_of(config: str, workload: str, repeat: int, result: SearchResult, slo_ms: float) -> dict[str, Any]:
    return {
        "config": config,
        "workload": workload,
        "repeat": repeat,
        "slo_ms": slo_ms,
        "ranker_latency_target_ms": ranker_latency_target_ms(config, slo_ms),
        "ranker_slo_ms": ranker_slo_ms(config, slo_ms),
        "goodput_rps": result.goodput_rps,
        "first_miss_rps": result.first_miss_rps,
        "censored": result.censored,
        "client_bound_rps": result.client_bound_rps,  # the load generator fell behind here (censored)
        "stack_broken_rps": result.stack_broken_rps,  # the stack was broken here (censored)
        # A rate above the first miss that met (None: none): the limit is within the run's spread.
        "met_above_miss_rps": result.met_above_miss_rps,
        "points": [p.record | {"phase": phase} for phase, p in result.points],
    }


def stack_settings(stack: Stack) -> dict[str, Any]:
    """What a search record carries of its stack for the capacity model (relaygr.sim)."""
    return {
        # The ranker's measured pre-inference step costs (the capacity model plans by them).
        "ranker_step_costs": ranker_step_costs(stack),
        # The trigger's admission settings (the capacity model models its decisions by them).
        "trigger_settings": trigger_settings(stack),
    }


async def run_config(stack: Stack, name: str, args: argparse.Namespace, search: SearchConfig,
                     earlier: list[dict[str, Any]],
                     on_record: Callable[[dict[str, Any]], None] | None = None,
                     load: LoadGenerator | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Every (workload, repeat) of the plan through one configuration's stack; `on_record` is
    called with each search's record as soon as it is done."""
    base = WorkloadConfig(seed=args.seed, users=args.users, recent_tokens=args.recent, candidates=args.candidates,
                          length_scale=args.length_scale, max_prefix_len=args.max_prefix_len,
                          session_mean_requests=args.session_mean_requests, lead_in_s=args.lead_in_s)  # fmt: skip
    runner = Runner(stack, args, label=name, load=load)
    # A short replay first, thrown away: the first calls of a fresh stack pay one-off costs
    # (allocator growth, lazy initialisation) that belong to no configuration.
    warm = dataclasses.replace(workload_config(args.workloads[0], base), duration_s=args.warmup_s,
                               rate_rps=search.grid[0], version_base=999_000_000)  # fmt: skip
    await run_point(stack, warm, args.slo_ms, "warmup", search.grid[0], eps_sample=0, load=load)
    records = []
    for workload, repeat in plan(args):
        same = [r for r in earlier if r["workload"] == workload and r["repeat"] == repeat]
        must_reach = max((p["rate_rps"] for r in same for p in r["points"]
                          if p["meets_slo"] and p["phase"] == "grid" and not recorded_beyond_reach(p)),
                         default=0.0)  # fmt: skip
        compare = []
        if workload == NEVER_WORSE:
            reference = reference_for(name, [name, *(r["config"] for r in same)])
            compare = [
                p["rate_rps"] for r in same if r["config"] == reference for p in r["points"] if p["meets_slo"]
            ]
        print(f"[{name}] {workload} repeat {repeat}: grid from {search.grid[0]:g} req/s"
              f"{f', at least to {must_reach:g}' if must_reach else ''}", flush=True)  # fmt: skip
        seeded = dataclasses.replace(base, seed=repeat_seed(args, repeat))
        try:
            result = await runner.search(workload_config(workload, seeded), search, must_reach, compare)
        except asyncio.CancelledError:  # Ctrl-C or a time limit's SIGINT: keep what was measured
            if on_record is not None and runner.current is not None and runner.current.points():
                # With what the capacity model needs too: a cut search's points are checked
                # against it like a whole one's (k13c's were not: no step costs recorded).
                on_record(
                    incomplete_record(name, workload, repeat, runner.current, args.slo_ms)
                    | {"seed": repeat_seed(args, repeat), **stack_settings(stack)}
                )
            raise
        record = record_of(name, workload, repeat, result, args.slo_ms) | {
            "seed": repeat_seed(args, repeat),
            **stack_settings(stack),
        }
        print(f"[{name}] {workload} repeat {repeat}: goodput {result.goodput_rps:.4g} req/s, first miss "
              f"{result.first_miss_rps}{censored_note(result)}", flush=True)  # fmt: skip
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records


# ---------------------------------------------------------------------- the report


def summary_rows(records: list[dict[str, Any]], configs: list[str]) -> list[dict[str, Any]]:
    """Per workload: each configuration's median goodput over repeats (every value beside it),
    and each configuration's median over the reference's."""
    rows = []
    for workload in dict.fromkeys(r["workload"] for r in records):
        row: dict[str, Any] = {"workload": workload}
        medians = {}
        for config in configs:
            values = [
                r["goodput_rps"]
                for r in records
                if r["workload"] == workload and r["config"] == config and not r.get("incomplete")
            ]
            if values:
                medians[config] = statistics.median(values)
                row[config] = f"{medians[config]:.4g} ({', '.join(f'{v:.4g}' for v in values)})"
        for config in configs:
            reference = reference_for(config, configs)
            if reference is not None and config in medians and medians.get(reference):
                row[f"{config} / {reference}"] = medians[config] / medians[reference]
        rows.append(row)
    return rows


def reference_for(config: str, configs: Sequence[str]) -> str | None:
    """The configuration `config` is compared with: the baseline of the same layout or variant
    among `configs` (relay-2p-mps against baseline-2p-mps, relay-edf against baseline-edf: the
    baseline whose name after "baseline" ends `config`'s, the longest such), else the plain
    baseline; a baseline's variant is compared with the plain baseline (a layout's ratio); None
    for the plain baseline, or when no baseline ran."""
    if config == REFERENCE:
        return None
    if config.startswith(REFERENCE):
        return REFERENCE if REFERENCE in configs else None
    matching = [c for c in configs if c.startswith(REFERENCE) and config.endswith(c[len(REFERENCE) :])]
    return max(matching, key=len, default=None)


def reference_columns(configs: Sequence[str]) -> list[str]:
    """The ratio columns of the summary: each configuration over its reference (reference_for)."""
    return [f"{c} / {ref}" for c in configs if (ref := reference_for(c, configs)) is not None]


def never_worse_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every rate at which the reference met the SLO on the never-worse workload: each other
    configuration's P99 at that rate (same repeat) beside the reference's, and their ratio."""
    rows = []
    configs = list(dict.fromkeys(r["config"] for r in records))
    for ref in (r for r in records if r["workload"] == NEVER_WORSE and r["config"].startswith(REFERENCE)):
        others = [r for r in records if r["workload"] == NEVER_WORSE and r["repeat"] == ref["repeat"]
                  and reference_for(r["config"], configs) == ref["config"]]  # fmt: skip
        for p in sorted((p for p in ref["points"] if p["meets_slo"]), key=lambda p: p["rate_rps"]):
            for other in others:
                twin = next((q for q in other["points"]
                             if math.isclose(q["rate_rps"], p["rate_rps"], rel_tol=RATE_TOL)), None)  # fmt: skip
                ratio = twin["p99_ms"] / p["p99_ms"] if twin is not None and p["p99_ms"] > 0 else float("nan")
                rows.append({
                    "repeat": ref["repeat"],
                    "rate_rps": p["rate_rps"],
                    "reference": ref["config"],
                    f"{REFERENCE}_p99_ms": p["p99_ms"],
                    "config": other["config"],
                    "p99_ms": twin["p99_ms"] if twin is not None else "not measured",
                    "ratio": ratio,
                    "not_worse": bool(ratio <= NEVER_WORSE_TOLERANCE) if twin is not None else "",
                })  # fmt: skip
    return rows


def plot(records: list[dict[str, Any]], slo_ms: float, stem: Path, device: str) -> list[Path]:
    """One PNG per workload: ranking P99 vs offered rate, a line per (configuration, repeat)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for workload in dict.fromkeys(r["workload"] for r in records):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for r in (r for r in records if r["workload"] == workload):
            pts = sorted(r["points"], key=lambda p: p["rate_rps"])
            ax.plot([p["rate_rps"] for p in pts], [p["p99_ms"] for p in pts], marker="o",
                    label=f"{r['config']} #{r['repeat']} "
                          + ("(cut short)" if r.get("incomplete") else f"(goodput {r['goodput_rps']:.3g})"))  # fmt: skip
        ax.axhline(slo_ms, color="black", linestyle="--", linewidth=1, label=f"SLO {slo_ms:g} ms")
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel("ranking P99 (ms)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{workload}: ranking P99 vs rate ({device})")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
        path = stem.with_name(f"{stem.name}-p99-vs-rate-{workload}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(records: list[dict[str, Any]], run_config: dict[str, Any], args: argparse.Namespace,
                 configs: list[str], info: dict[str, Any] | None = None, quiet: bool = False) -> list[Path]:  # fmt: skip
    """The JSON, the markdown and the plots of `records`; `info` is the machine that measured
    them (default: this one)."""
    info = info or machine()
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    session = (f"sessions of mean {args.session_mean_requests:g} requests (geometric), think times ML-100K gaps "
               f"x{run_config['think_scale']:g}, retrieval -> ranking gap {run_config['gap_ms']} ms, "
               f"{run_config.get('lead_in_s', 0.0):g} s of unmeasured lead-in per point")  # fmt: skip
    header = (f"SLO {args.slo_ms:g} ms, preset {args.preset}, {args.rankers} ranker(s); {session}; each point "
              f">= {args.min_duration_s:g} s and >= {args.min_calls} calls; limits bisected to "
              f"{args.precision:.0%}.\n\n## Goodput (req/s): median (every repeat)\n\n"
              + markdown_table(summary_rows(records, configs), ["workload", *configs, *reference_columns(configs)])
              + "\n## Every search\n\n")  # fmt: skip
    footer = ""
    rows = never_worse_rows(records)
    if any(r["workload"] == NEVER_WORSE for r in records):
        columns = [
            "repeat",
            "rate_rps",
            "reference",
            f"{REFERENCE}_p99_ms",
            "config",
            "p99_ms",
            "ratio",
            "not_worse",
        ]
        references = [c for c in configs if c.startswith(REFERENCE)]
        if rows:
            table = markdown_table(rows, columns)
        elif references:
            table = f"{', '.join(references)} met the SLO at no rate beside another configuration.\n"
        else:
            table = f"no {REFERENCE} ran: nothing to compare with.\n"
        footer = (
            f"\n## Never worse ({NEVER_WORSE}): every rate at which a {REFERENCE} meets the SLO, beside the "
            f"configurations compared with it\n\n{table}"
        )
    json_path, md_path = write_result("goodput", run_config, records,
                                      ["config", "workload", "repeat", "goodput_rps", "first_miss_rps", "censored",
                                       "client_bound_rps", "met_above_miss_rps", "incomplete"],
                                      out_dir=out_dir, header=header, tag=args.tag, footer=footer,
                                      info=info)  # fmt: skip
    stem = json_path.with_suffix("")
    pngs = plot(records, args.slo_ms, stem, info["device"])
    if not quiet:
        print(md_path.read_text())
        print("wrote", json_path, md_path, *pngs)
    return [json_path, md_path, *pngs]


# ---------------------------------------------------------------------- merging parallel runs


def merge(paths: Sequence[Path]) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """Records of several goodput files measured on one host at once (one GPU each: the repeats of
        a sitting run side by side), with repeats renumbered in file order per (config, workload).
        Returns (records, the first file's settings plus `merged_from`, the machine with every GPU
        index). ValueError if the files come from different hosts (or boots of one: leased machines
    here share a host name), devices or commits, or if their
        protocol settings differ: such results do not share a sitting and their ratios mean nothing."""
    if len(paths) < 2:
        raise ValueError("--merge needs at least two result files")
    docs = []
    for path in paths:
        try:
            docs.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from exc
    first = docs[0]
    for key in ("host", "boot_id", "device", "commit"):
        values = {d["machine"].get(key) for d in docs}
        if len(values) > 1:
            raise ValueError(
                f"the files differ in machine.{key} ({sorted(map(str, values))}): not one sitting"
            )
    protocol = ("preset", "slo_ms", "rankers", "min_duration_s", "min_calls", "precision", "session_mean_requests",
                "hbm_budget_mb", "arena_gb", "users", "recent", "candidates", "length_scale", "max_prefix_len",
                "lead_in_s", "fresh_broker_per_point")  # fmt: skip
    for key in protocol:
        values = {json.dumps(d["config"].get(key)) for d in docs}
        if len(values) > 1:
            raise ValueError(f"the files differ in config.{key} ({sorted(values)}): not one protocol")
    records: list[dict[str, Any]] = []
    for doc in docs:
        taken: dict[tuple[str, str], int] = {}
        for r in records:
            pair = (r["config"], r["workload"])
            taken[pair] = max(taken.get(pair, 0), r["repeat"] + 1)
        for r in doc["results"]:
            records.append(r | {"repeat": taken.get((r["config"], r["workload"]), 0) + r["repeat"]})
    settings = first["config"] | {"merged_from": [Path(p).name for p in paths],
                                  "configs": list(dict.fromkeys(r["config"] for r in records))}  # fmt: skip
    info = first["machine"] | {
        "cuda_visible_devices": ",".join(str(d["machine"].get("cuda_visible_devices")) for d in docs)
    }
    return records, settings, info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="baseline,relay", help="comma-separated, of " + ", ".join(CONFIGS))
    p.add_argument(
        "--workloads",
        default="L2048,L4096,L8192,L12288,mix",
        help="comma-separated: L<tokens> | mix, each optionally -s1 (sessions of one request)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each repeated workload (--repeat-workloads), repeat r with seed --seed + r",
    )
    p.add_argument("--repeat-workloads", default=None,
                   help="comma-separated: the workloads of --workloads that --repeats repeats "
                        f"(default: those of {','.join(HEADLINE)} it has)")  # fmt: skip
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rankers", type=int, default=1)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--slo-ms", type=float, default=300.0)
    p.add_argument("--grid", type=float, nargs="+", default=[2, 4, 8, 16], help="ascending rates (req/s)")
    p.add_argument("--growth", type=float, default=2.0, help="step past the grid's top / under its bottom")
    p.add_argument("--cap-rps", type=float, default=4096.0, help="the grid is never extended past this")
    p.add_argument("--floor-rps", type=float, default=0.0, help="lowest rate stepped down to (0: grid[0]/64)")
    p.add_argument(
        "--precision", type=float, default=0.10, help="bisect until first miss <= goodput x (1+this)"
    )
    p.add_argument("--min-duration-s", type=float, default=10.0, help="each point lasts at least this")
    p.add_argument("--min-calls", type=int, default=400, help="each point sends at least this many calls")
    p.add_argument("--risk-fraction", type=float, default=0.5,
                   help="trigger: at risk when predicted full ranking > this x SLO")  # fmt: skip
    p.add_argument("--length-scale", type=float, default=16.0, help="mix: ML-100K lengths x this")
    p.add_argument("--max-prefix-len", type=int, default=16384, help="mix: clip")
    p.add_argument("--session-mean-requests", type=float, default=3.0, help="1: no reuse across requests")
    p.add_argument("--users", type=int, default=100_000)
    p.add_argument("--recent", type=int, default=64)
    p.add_argument("--candidates", type=int, default=256)
    p.add_argument("--hbm-budget-mb", type=float, default=512.0)
    p.add_argument("--arena-gb", type=float, default=1.0)
    p.add_argument("--settle-s", type=float, default=2.0, help="pause between points")
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=60.0,
        help="after each point (and its pause), wait at most this long for the stack to hold no "
        "work from it: rankers' queues empty and the signal path quiet for 1 s (drain_s per point)",
    )
    p.add_argument("--lead-in-s", type=float, default=10.0,
                   help="each point first replays this long of the same workload, unmeasured, so that its "
                   "measured window meets users returning from sessions begun before it (steady state; "
                   "0: the window starts cold and only ~1/3 of a 10 s point's calls return)")  # fmt: skip
    p.add_argument("--warmup-s", type=float, default=4.0, help="a discarded replay per stack")
    p.add_argument("--fresh-broker-per-point", action=argparse.BooleanOptionalAction, default=True,
                   help="an empty embedded broker before each point (Stack.renew_broker: Tansu's memory "
                        "storage slows as its partitions fill)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--tag", default="", help="suffix of the result file name")
    p.add_argument("--logs-dir", default=None, help="write every service's log records here (JSON lines)")
    p.add_argument("--calls-dir", default=None,
                   help="write every measured call of every point here (JSON lines: when sent, by whom, where its time went)")  # fmt: skip
    p.add_argument("--client-processes", type=int, default=1,
                   help="replay each point from this many processes, users sharded across them (relaygr/load.py): "
                        "one Python client falls behind near 500 calls/s")  # fmt: skip
    p.add_argument("--client-lag-bound-ms", type=float, default=CLIENT_LAG_BOUND_MS,
                   help="a point whose calls were sent later than this behind schedule (P99) measured the "
                        "load generator: client_bound, no miss, the search ends there censored")  # fmt: skip
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="measure nothing: combine result files of one sitting (one host, GPUs side by side) "
                        "into one report, repeats renumbered; written under --tag")  # fmt: skip
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    named = args.repeat_workloads is not None
    names = args.repeat_workloads.split(",") if named else HEADLINE
    args.repeat_workloads = [w.strip() for w in names if w.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown}")
    try:
        for w in args.workloads:
            workload_config(w, WorkloadConfig())
        args.search = SearchConfig(
            tuple(args.grid), args.precision, args.growth, args.cap_rps, args.floor_rps
        )
    except ValueError as exc:
        p.error(str(exc))
    if args.repeats < 1 or args.min_calls < 1 or args.min_duration_s <= 0:
        p.error("--repeats and --min-calls must be >= 1, --min-duration-s > 0")
    missing = [w for w in args.repeat_workloads if w not in args.workloads]
    if named and missing:
        p.error(f"--repeat-workloads: {','.join(missing)} not in --workloads ({','.join(args.workloads)})")
    if args.repeats > 1 and len(missing) == len(args.repeat_workloads):
        print(f"note: --repeats {args.repeats} repeats nothing: none of {','.join(HEADLINE)} is in --workloads "
              "(--repeat-workloads names the workloads to repeat)", file=sys.stderr)  # fmt: skip
    if not args.lead_in_s >= 0:
        p.error("--lead-in-s must be >= 0")
    if not (args.settle_s >= 0 and args.drain_timeout_s >= 0):
        p.error("--settle-s and --drain-timeout-s must be >= 0")
    if not 1 <= args.client_processes <= 64:
        p.error("--client-processes must be in [1, 64]")
    if not args.client_lag_bound_ms > 0:
        p.error("--client-lag-bound-ms must be > 0")
    if args.tag and not re.fullmatch(r"[A-Za-z0-9_.-]+", args.tag):
        p.error("--tag: letters, digits, '.', '_' and '-' only")
    return args


@contextlib.contextmanager
def load_generator(processes: int) -> Iterator[LoadGenerator | None]:
    """The load generator's worker processes for one stack's run (None: replay in this process)."""
    if processes == 1:
        yield None
        return
    with LoadGenerator(processes) as load:
        yield load


def main(argv: list[str] | None = None) -> list[Path]:
    """Runs the benchmark; returns the paths written (JSON, markdown, PNGs)."""
    args = parse_args(argv)
    if args.merge:
        try:
            merged, merged_settings, info = merge([Path(p) for p in args.merge])
        except ValueError as exc:
            raise SystemExit(f"bench.goodput --merge: {exc}") from None
        as_args = argparse.Namespace(**(merged_settings | {"tag": args.tag, "out_dir": args.out_dir}))
        return write_report(merged, merged_settings, as_args, merged_settings["configs"], info=info)
    # A time limit's SIGTERM (`timeout`'s default) ends the run as Ctrl-C does: the search under
    # way keeps its points. SIGINT is what asyncio.run turns into cancelling the run.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: os.kill(os.getpid(), signal.SIGINT))
    # The reference runs first: later configurations step at least through the rates it met.
    configs = sorted(args.configs, key=lambda c: c != REFERENCE)
    if args.arena_gb * 2**30 < args.rankers * args.hbm_budget_mb * 2**20:
        print(f"note: the expander's arena ({args.arena_gb:g} GiB) holds less than the rankers' HBM "
              f"({args.rankers} x {args.hbm_budget_mb:g} MiB): psi evicted from HBM will rarely be in DRAM "
              "(dram_reload near 0)", flush=True)  # fmt: skip
    started = time.time()
    records: list[dict[str, Any]] = []
    defaults = WorkloadConfig()

    def settings() -> dict[str, Any]:
        out = {k: v for k, v in vars(args).items() if k not in ("out_dir", "search", "merge")}
        return out | {"configs": configs, "think_scale": defaults.think_scale, "wall_s": time.time() - started,
                      "gap_ms": [defaults.gap_min_ms, defaults.gap_max_ms], "protocol": "bench/goodput.py docstring"}  # fmt: skip

    def save_so_far(record: dict[str, Any]) -> None:
        # Every finished search is on disk at once: a run cut short (a time limit) keeps them.
        write_report([*records, *done_here, record], settings(), args, configs, quiet=True)
        done_here.append(record)

    for name in configs:
        stack_config = relay.stack_config(name, args)
        per_device = (
            f", {stack_config.rankers_per_device} processes each"
            if stack_config.rankers_per_device > 1
            else ""
        )
        print(
            f"[{name}] starting the stack ({args.rankers} ranker(s) on {args.device}{per_device})", flush=True
        )
        done_here: list[dict[str, Any]] = []
        with (
            Stack(stack_config) as stack,
            load_generator(args.client_processes) as load,
        ):  # from the main thread
            try:
                records += asyncio.run(run_config(stack, name, args, args.search, records, save_so_far, load))
            finally:  # a run cut short keeps its services' logs too
                if args.logs_dir:
                    relay.save_logs(stack, Path(args.logs_dir), name)
    return write_report(records, settings(), args, configs)


if __name__ == "__main__":
    main()
