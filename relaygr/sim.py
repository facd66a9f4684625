"""A discrete-event model of one ranker's device loop under the benchmarks' workload: the first
part of the capacity model (issue "How many GPUs and how much DRAM"), checked against the GPU's
goodput files.

    python -m relaygr.sim bench/results/goodput-nvidia-h100-80gb-hbm3-ed2.json --config baseline
    python -m relaygr.sim FILE --config relay-nospare --workload L4096 --json out.json
    python -m relaygr.sim FILE --config relay-nospare --arena-gb 100 --cached-scale 0.5  # what if
    python -m relaygr.sim FILE --config relay --ceiling --session-mean-requests 6  # an upper bound

What it models, per ranking call of `relaygr.workload.generate` (the generator bench.goodput
replays, same seed, same lead-in, the measured window only counted):
  * one device loop, non-preemptive, planned step by step by the ranker's own scheduler
    (services/ranker/scheduler.py: earliest deadline first, calls of one kind per batch, the
    batch limits and the wait to fill), its batch costs fitted the way the engine fits them;
  * a batch's device time: the fit of the measured batches of its kind (full rankings, calls
    against psi) times a ratio drawn from the measured / fitted ratios of the measured batches of
    its shape class, so that the measured tail (eager launches, copy contention, noise) comes
    with it;
  * a call's time outside the device loop (network, decoding, the reply) drawn from the measured
    calls of its path: latency - queue - compute - cache;
  * `relay-nospare`: rankings keep psi (prefixes of at least `keep_min_tokens`), HBM and host
    DRAM as LRU caches by bytes; a call finds its psi in HBM (a call against psi), in DRAM (a
    reload: its measured cache time, then a call against psi; the psi returns to HBM) or nowhere
    (a full ranking, which leaves psi in HBM); psi evicted from HBM goes to DRAM, through the
    ranker's demotion gate where the file's rankers had it (since k11: a copy only while reloads
    pay for its host time, else a sample; services/ranker/demotion_gate.py), a gate that may
    close from its first copies, as a search's ranker's gate enters each point past its first
    256 (a fresh one stayed open through whole modelled points: k23c);
  * `preinfer-all`: besides, every request's signal reaches the ranker the file's P90 signal trip
    after its retrieval event; psi held nowhere is pre-inferred (the scheduler's chunks, costed
    as a forward of the prefix), psi in DRAM prefetched; a call that comes before its psi is
    complete joins it or takes it over, as the scheduler decides;
  * `relay`: as `preinfer-all`, but each retrieval event goes through the trigger's admission
    (services/trigger/admission.py's decide, AdmissionPolicy) with its inputs as it has them:
    the full ranking's cost (the calibration's fit), the call against psi (the median per call
    of the recent batches against psi), a psi's cost as the scheduler plans it, the offered
    load, the keys' returns, the device's busy share and queue as of its last Stats report
    (every 0.2 s), its ledger of admissions, and the lead test (TriggerView: a signal whose
    pre-inference would not start before its call is refused, judged on that report and its
    admissions since, each psi priced at its measured cost, decided its event lag after the
    retrieval event). Its settings are the run's (`trigger_settings`, recorded since the
    twenty-second session; earlier files: the defaults of their time, no spare_min_saving),
    `--trigger-setting NAME=VALUE` changes one; `--lead-test-only` models the lead test alone
    (every signal that passes it pre-inferred: the model before the twenty-second session),
    `--exact-lead-test` that by the model's exact queue. The ranker's own pre-inference steps
    as it measured them at start-up (the file's `ranker_step_costs`, or `--eager-step-costs` /
    `--graph-step-costs`; required): the scheduler plans chunks by them as the engine does
    (graph replays of first chunks, eager steps that pay a per-step cost of ~4 ms on an H200),
    and each step costs what its kind's measurement says, scaled to what a psi cost in the
    file's points (`--preinfer-scale`). Each point reports the trigger's decisions on its
    events as shares (`trigger_<reason>`, admissions as admitted_risk / _reuse / _spare: the
    trigger's own counters).
  * the host's launch of each ranking batch (packing, staging, issuing: the records'
    `launch_ms`, drawn by shape class like the device time) with the engine's launch-ahead: the
    next batch is planned and launched while the one before it runs, and it starts on the device
    once both that one is done and its own launch is; a launch longer than the batch ahead of it
    leaves the device idle with calls waiting (measured: 11.6% of the time for relay-nospare at
    225 req/s on an H200, whose hit batches run 1.2-1.5 ms). Between launches the host settles
    the batch before, issues copies and plans: their mean time per batch from the file's loop_*
    sections where it has them (`host_step_s`). `--launch-scale` scales both, 0 turns them off
    (the device-only model of earlier checks).
  * the event loop's work under the interpreter lock the device loop shares: each Rank call
    and PreInfer signal owes its share (the rankers' main-thread CPU per request, from the
    file's points where they record it: event_loop_ms), paid while the device loop waits for
    the device or for work, else delaying the next launch. Files before the twenty-ninth session
    have no such figure: 0 there (the event loop as if on a CPU of its own), as their checks were
    made. On the H200's length mix that left the baseline's modelled limit 15-22% over the
    measured (k15a, k15c; the process at 0.96-1.0 cores, the lock's limit); 0.5 ms a request
    (`--request-host-ms`, a what-if) brought all eight L4096 and mix checks of k15a-d within 12%.
    The calls' measured `launch_ms` and the loop's host-step sections by wall time already hold
    the device loop's waits for the lock, so where the event loop is charged, they are taken at
    the device loop's own thread CPU instead (the points' loop_<section>_cpu_s: launches scaled
    by the launch section's CPU over its wall time: on an H200 0.69-0.73 at L4096 and on the
    mix, 0.76-0.94 at 8192-16384 tokens; `launch_own_share`).
    Checked on the first single-process files with the event loop's CPU (k25a-b, one H200):
    baseline / relay at L4096 1.04 / 0.91 of measured, on the mix 0.86 / 1.00, where the wall
    times with the charge gave 0.97 / 0.86 and 0.77 / 0.86, and no charge 1.04 / 0.91 and
    0.94 / 1.30. `--host-by-wall` and `--request-host-ms 0` are the models without it.
Several ranker processes of one GPU (`<name>-<N>p[-mps]`) are modelled as rankers of their own,
each with its users (rendezvous placement, as the router's) and its share of the tiers, at the
device costs the file measured with them side by side (Setup.processes). The copy engines (since
k22; `--copy-engines off`: the model before): at a fixed length, psi's copies to and from DRAM
occupy them at the file's measured device time per byte, and a ranking batch or pre-inference
step whose own copy (inputs in, scores out) comes while they run waits until the engine is idle,
pieces or no pieces (k23b; CopyEngine), unless the ranker moves those bytes by kernels
(`--batch-copies`, the ranker's RELAYGR_RANKER_BATCH_COPIES). Not modelled yet: the router's load bound and failover, several
GPUs, the signal path's tail.

Why a loop of our own and not a DES library (SimPy): the model is one device loop per ranker,
the same plan -> launch -> settle cycle as services/ranker/engine.py, and at each step it calls
the ranker's own scheduler, keep and demotion gates and the trigger's admission, all plain
synchronous functions of the state and a clock. A next-event loop over that state is what the
engine's loop is; SimPy would wrap each call and the loop in generator processes and resources
without modelling anything more (one resource, no preemption), and put its scheduling between
our code and the code it checks. GPUs are modelled one at a time (each serves its own users),
so a plan's size does not grow the event count.

Calibration comes only from a goodput result file and the per-call records beside it
(bench/results/calls/<file stem>-<config>-<workload>-p<n>-<rate>.jsonl.xz), never from
constants: the costs of a configuration on a workload are fitted on all its measured points.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import itertools
import json
import math
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from relaygr.compressed import open_text
from relaygr.search import Point, SearchConfig, find_limit, recorded_beyond_reach
from relaygr.workload import PlannedRequest, WorkloadConfig, generate
from services.ranker.call_cost import CostFit, CostPrior
from services.ranker.config import BatchCopies
from services.ranker.cost_model import BUSY_COPY_PREFERENCE, COPY_OVERHEAD_MS
from services.ranker.demotion_gate import DemotionGate
from services.ranker.graphs import FULL, GraphLimits, bucket_for, multi_full_keys
from services.ranker.keep_gate import KeepGate
from services.ranker.loop_time import SECTIONS as LOOP_SECTIONS
from services.ranker.rank_queue import RankQueue
from services.ranker.scheduler import (
    Chunk,
    IterationScheduler,
    PreinferItem,
    RankItem,
    RankKind,
    Relay,
    SchedulerConfig,
    chunk_work,
)
from services.ranker.transfer import stored_nbytes
from services.trigger.admission import (
    Bounds,
    InstanceLedger,
    OfferedLoad,
    Policy,
    Reason,
    ReturnRate,
    adds_little_work,
    decide,
    host_has_spare,
    reuse_pays,
    risk_threshold_ms,
    spare_outweighs_waits,
    spare_shortens,
    too_late,
)
from services.trigger.config import ADMISSION_SETTINGS, TriggerConfig
from shared.placement import stable_hash
from shared.wire import MAX_PREINFER_DUES

PSI_BYTES_PER_TOKEN = 32 * 1024  # the bench preset: 8 layers x 2 (K, V) x 1024 x 2 bytes
# The bench preset's psi in host DRAM as fp8 (values, a scale per 16 tokens of each of 4 heads,
# timestamps) over psi as computed: ~0.5.
HOST_FP8_SCALE = stored_nbytes(8, 4096, 1024, 2, "fp8", heads=4) / stored_nbytes(8, 4096, 1024, 2)
PSI_PATHS = (  # how a call is served from psi (the per-call records' served_by)
    "hbm_hit",
    "dram_reload",
    "inflight_join",
    "partial_prefix",
)


# ---------------------------------------------------------------------- calibration


def shape_of(calls: int, tokens: int) -> tuple[int, int]:
    """A batch's shape class: its calls (1, 2, 3-4, 5+) and its tokens' power of two. Batches
    of one class run alike (on a GPU: a CUDA graph or eager, the same kernels' regime)."""
    calls_class = calls if calls <= 2 else 4 if calls <= 4 else 5
    return calls_class, max(0, int(tokens).bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class KindCost:
    """Device time of one kind of batch: seconds = per_batch + per_token x tokens + per_pair x
    pairs, times a ratio (measured / fitted) drawn from the measured batches of the same shape
    class (`shape_of`), or from all of them where that class was never measured: a linear fit
    over 300-16k tokens misses where long batches run eagerly, and one pool of ratios spread the
    eager batches' tail over every batch."""

    per_batch_s: float
    per_token_s: float
    per_pair_s: float
    ratios: tuple[float, ...]
    by_shape: dict[tuple[int, int], tuple[float, ...]] = dataclasses.field(default_factory=dict)
    # The host's launch of a batch (seconds), measured, by shape class and all together; empty
    # where the records carry no launch time (files before it was recorded).
    launches: tuple[float, ...] = ()
    launches_by_shape: dict[tuple[int, int], tuple[float, ...]] = dataclasses.field(default_factory=dict)
    # The fewest and most tokens a call of the measured batches had (their tokens over their
    # calls): outside them the fit extrapolates ((0, 0): not recorded).
    call_tokens: tuple[int, int] = (0, 0)

    def fitted_s(self, tokens: int, pairs: int) -> float:
        return self.per_batch_s + self.per_token_s * tokens + self.per_pair_s * pairs

    def draw_s(self, tokens: int, pairs: int, rng: np.random.Generator, calls: int = 1) -> float:
        pool = self.by_shape.get(shape_of(calls, tokens)) or self.ratios
        return self.fitted_s(tokens, pairs) * float(pool[rng.integers(len(pool))])

    def draw_launch_s(self, tokens: int, rng: np.random.Generator, calls: int = 1) -> float:
        """A measured launch of a batch of this shape class (of any, where the class was never
        measured); 0 without launch records."""
        pool = self.launches_by_shape.get(shape_of(calls, tokens)) or self.launches
        return float(pool[rng.integers(len(pool))]) if pool else 0.0


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What the model takes from one configuration's measured run (module docstring)."""

    full: KindCost
    cached: KindCost | None  # None: no call was served from psi (the baseline)
    overhead_ms: dict[str, tuple[float, ...]]  # per served path: time outside the device loop
    reload_cache_ms: tuple[float, ...]  # a reload's wait for its copy
    batches: int  # measured batches it was fitted on
    # A full ranking's wait before it reaches the engine: its psi looked for in the host tier
    # (an RPC to the expander before the presence index answered absent keys locally).
    miss_cache_ms: tuple[float, ...] = ()


@dataclasses.dataclass
class _Batch:
    full: bool
    tokens: int = 0
    pairs: int = 0
    compute_ms: float = 0.0
    calls: int = 0
    launch_ms: float | None = None  # the host's launch (None: not recorded)


def _fit(samples: Sequence[_Batch]) -> KindCost:
    """Non-negative least squares on relative error (as services.ranker.call_cost fits)."""
    if not samples:
        raise ValueError("no measured batches to fit")
    x = np.array([[1.0, b.tokens / 1e3, b.pairs / 1e6] for b in samples])
    y = np.array([b.compute_ms / 1e3 for b in samples])
    w = 1.0 / np.maximum(y, 1e-3)
    active = [0, 1, 2]
    coef = np.zeros(3)
    for _ in range(3):  # drop a negative coefficient and refit (at most three times)
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        active = [a for a, v in zip(active, sol, strict=True) if v >= 0] or [0]
    else:
        coef[:] = 0.0
        coef[0] = float(np.median(y))
    per_batch, per_token, per_pair = float(coef[0]), float(coef[1]) / 1e3, float(coef[2]) / 1e6
    fitted = [per_batch + per_token * b.tokens + per_pair * b.pairs for b in samples]
    by_shape: dict[tuple[int, int], list[float]] = collections.defaultdict(list)
    for b, v, f in zip(samples, y, fitted, strict=True):
        if f > 0:
            by_shape[shape_of(b.calls, b.tokens)].append(float(v / f))
    ratios = tuple(r for pool in by_shape.values() for r in pool)
    launches: dict[tuple[int, int], list[float]] = collections.defaultdict(list)
    for b in samples:
        if b.launch_ms is not None:
            launches[shape_of(b.calls, b.tokens)].append(b.launch_ms / 1e3)
    per_call = [b.tokens // max(1, b.calls) for b in samples]
    return KindCost(
        per_batch, per_token, per_pair, ratios, {k: tuple(v) for k, v in by_shape.items()},
        tuple(x for pool in launches.values() for x in pool), {k: tuple(v) for k, v in launches.items()},
        (min(per_call), max(per_call)),
    )  # fmt: skip


def calibrate(
    records: Iterable[dict[str, Any]], wait_records: Iterable[dict[str, Any]] | None = None
) -> Calibration:
    """The costs of the served calls' records (bench.goodput --calls-dir): batches grouped by
    their `batch_seq`, pairs counted as the scheduler counts them (CallWork). The waits outside
    the device loop (each path's overhead, a reload's wait for its copy, a miss's host lookup)
    come from `wait_records` where given: they grow with load, and drawn from a point past the
    limit they put that point's queues into every simulated rate (h4a: a reload waited 67 ms
    mean at 262.5 req/s, 19 at 237.5; the model then missed at 162 req/s what met 237.5)."""
    batches: dict[int, _Batch] = {}
    overhead: dict[str, list[float]] = collections.defaultdict(list)
    reloads: list[float] = []
    misses: list[float] = []
    for r in records:
        if r.get("status") != "OK":
            continue
        path = str(r["served_by"])
        full = path == "full_recompute"
        prefix, suffix = int(r["prefix_len"]), int(r["suffix_len"])
        launch = r.get("launch_ms")
        b = batches.setdefault(
            int(r["batch_seq"]),
            _Batch(
                full, compute_ms=float(r["compute_ms"]), launch_ms=None if launch is None else float(launch)
            ),
        )
        b.calls += 1
        b.tokens += prefix + suffix if full else suffix
        b.pairs += prefix * (prefix + suffix) if full else 0
        if wait_records is None:
            _add_waits(r, overhead, reloads, misses)
    for r in wait_records or ():
        if r.get("status") == "OK":
            _add_waits(r, overhead, reloads, misses)
    # A batch's size comes from its records; the measured window cuts a few batches short (their
    # first calls were lead-in), which the fit tolerates.
    full_batches = [b for b in batches.values() if b.full]
    cached_batches = [b for b in batches.values() if not b.full]
    return Calibration(
        full=_fit(full_batches),
        cached=_fit(cached_batches) if cached_batches else None,
        overhead_ms={k: tuple(v) for k, v in overhead.items()},
        reload_cache_ms=tuple(reloads),
        batches=len(batches),
        miss_cache_ms=tuple(misses),
    )


def _add_waits(
    r: dict[str, Any], overhead: dict[str, list[float]], reloads: list[float], misses: list[float]
) -> None:
    path = str(r["served_by"])
    rest = float(r["latency_ms"]) - float(r["queue_ms"]) - float(r["compute_ms"]) - float(r["cache_ms"])
    overhead[path].append(max(0.0, rest))
    if path == "dram_reload":
        reloads.append(float(r["cache_ms"]))
    elif path == "full_recompute":
        misses.append(float(r["cache_ms"]))


def met_files(result: dict[str, Any], config: str, workload: str, files: Sequence[Path]) -> list[Path]:
    """Those of `files` (calls_files) whose point met the SLO."""
    met = {
        round(float(p["rate_rps"]), 3)
        for r in result["results"]
        if r["config"] == config and r["workload"] == workload
        for p in r["points"]
        if p["meets_slo"] and not recorded_beyond_reach(p)
    }
    out = []
    for f in files:
        found = re.search(r"-p\d+-([0-9.]+)\.jsonl", f.name)
        if found and round(float(found.group(1)), 3) in met:
            out.append(f)
    return out


def scaled(cal: Calibration, full: float = 1.0, cached: float = 1.0) -> Calibration:
    """The calibration with full rankings' and calls against psi's device times scaled (what
    if a kernel made them cheaper)."""

    def scale(k: KindCost, f: float) -> KindCost:
        return dataclasses.replace(k, per_batch_s=k.per_batch_s * f, per_token_s=k.per_token_s * f,
                                   per_pair_s=k.per_pair_s * f)  # fmt: skip

    return dataclasses.replace(
        cal, full=scale(cal.full, full), cached=None if cal.cached is None else scale(cal.cached, cached)
    )


def calls_files(result_file: Path, config: str, workload: str) -> list[Path]:
    """The per-call records of one configuration and workload beside a goodput result file."""
    stem = result_file.name.removesuffix(".json")
    pattern = re.compile(re.escape(f"{stem}-{config}-{workload}-p") + r"\d+-[0-9.]+\.jsonl(\.gz|\.xz)?$")
    return sorted(
        p for p in (result_file.parent / "calls").glob(f"{stem}-{config}-*") if pattern.match(p.name)
    )


def read_records(paths: Iterable[Path]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in paths:
        with open_text(p) as f:
            out.extend(json.loads(line) for line in f if line.strip())
    return out


# ---------------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class Setup:
    """The ranker being modelled (defaults: the ranker's and bench.goodput's)."""

    slo_ms: float = 50.0
    psi: bool = False  # rankings keep psi, HBM and DRAM tiers (relay-nospare)
    hbm_budget_bytes: int = 60_000 * 2**20
    dram_bytes: int = 24 * 2**30
    keep_min_tokens: int = 512
    # Full rankings batched only into shapes a captured CUDA graph holds (the scheduler's
    # full_replays, since 7f46ff9): here every single full ranking of at most this many tokens
    # (the batch-1 graphs captured at start-up) and no batch of several; 0: not modelled, full
    # rankings batched by cost alone (the ranker before 7f46ff9, and the CPU).
    graph_full_tokens: int = 0
    # Full rankings also replay graphs of several sequences (up to the scheduler's graph_batch)
    # totalling at most this many tokens (the ranker's RELAYGR_RANKER_GRAPH_FULL_BATCH_TOKENS,
    # captured at start-up); 0: none, every full ranking alone (the ranker before it).
    full_batch_tokens: int = 0
    # Pre-inference of every request whose psi is held nowhere (the `preinfer-all` policy), its
    # signal reaching the ranker this long after the retrieval event; None: no pre-inference.
    preinfer_trip_ms: float | None = None
    # The ranker's pre-inference steps as it measured them (StepCosts); None: a step costs a
    # forward of its tokens by the full rankings' calibration.
    preinfer_steps: StepCosts | None = None
    # The trigger's lead test (`relay`): a signal whose pre-inference would not start before its
    # call comes (the backlog due no later than it, at the modelled step costs) is refused.
    lead_test: bool = False
    # With `lead_test`, the trigger's own test (TriggerView) instead of the model's exact
    # knowledge of the ranker's queue; None: exact.
    trigger: TriggerView | None = None
    # With `trigger`: the trigger's whole admission (AdmissionPolicy) instead of its lead test
    # alone; None: every signal that passes the lead test is pre-inferred.
    admission: AdmissionPolicy | None = None
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    # The host's launch of each ranking batch, as measured times this (module docstring); 0:
    # not modelled, every batch starts when the device is free.
    launch_scale: float = 1.0
    # The device loop's own CPU share of a measured launch (the launch section's thread CPU over
    # its wall time): where the model charges the event loop's lock time apart (request_host_s),
    # a launch's measured wall time already holds its waits for that lock, so only this share of
    # it is the loop's own work (module docstring); 1: the launch's wall time whole.
    launch_own_share: float = 1.0
    # The host's time per batch between launches (settling the batch before, copies, planning:
    # `host_step_s`), also times launch_scale; 0: not modelled.
    host_step_s: float = 0.0
    # The host's time to issue one copy of psi (a demotion to DRAM, a reload from it), added to
    # the next batch's host step, also times launch_scale (host_costs); 0: inside host_step_s.
    copy_issue_s: float = 0.0
    # The ranker's demotion gate (RELAYGR_RANKER_DEMOTION=earned, its default since k11;
    # services/ranker/demotion_gate.py): psi leaving HBM goes to DRAM only while reloads pay for
    # the host time of a copy (`copy_cost_ms`: the device loop's per copy issued, plus the event
    # loop's own steps per demotion where the file measured them, k21 on), else one user in the
    # gate's sample; False: every psi leaving HBM is copied (pressure).
    demotion_gate: bool = False
    copy_cost_ms: float | None = None
    # The ranker's keep gate (RELAYGR_RANKER_RANKING_PSI_KEEP=earned; services/ranker/keep_gate.py):
    # a full ranking keeps its prefix's psi only while later calls reading kept psi save more
    # device time than a keep costs the host (`keep_cost_ms`, as the file's rankers measured
    # it; None: unknown, the gate open), else one user in the gate's sample; False: every full
    # ranking of at least keep_min_tokens keeps it. `keep_reuse`: the reads per keep the file's
    # rankers had measured (their gates enter each point warm), None: learned from nothing.
    keep_gate: bool = False
    keep_cost_ms: float | None = None
    keep_reuse: float | None = None
    # The event loop's work per request (decoding, validating, answering a Rank call or a
    # PreInfer signal) held under the interpreter lock the device loop's host work shares: owed
    # by each arrival, paid while the device loop waits for the device or for work, else it
    # delays the loop's next launch; 0: not modelled (the event loop as if it had its own CPU).
    request_host_s: float = 0.0
    # What the trigger prices one request to the ranker's host at, where its admission has
    # host_cost on (StatsReply.host_ms_per_request: services/ranker/host_cost.py); estimated from
    # the run's points (request_host_ms()); 0: device time alone.
    trigger_host_ms: float = 0.0
    # The deadline the ranker's scheduler orders calls by and lets short work pass over long
    # by: the benchmarks' gRPC timeout (relaygr.replay's rank_timeout_s), or the rankers'
    # latency target where the file's run set one (call_deadline_s()).
    call_deadline_s: float = 10.0
    # The SLO past which the ranker's scheduler holds a call doomed (scheduler.doomed), from its
    # arrival: the file's rankers' --slo-ms (call_slo_s()); inf: none (runs before it existed).
    call_slo_s: float = math.inf
    # Pre-inference graph steps launched ahead (the ranker's --chunks-ahead, off by default): the
    # host is free once it has launched one instead of waiting for it to finish.
    chunks_ahead: bool = False
    # Ranker processes per GPU (the configurations `<name>-<N>p[-mps]`: StackConfig.
    # rankers_per_device), each modelled as one ranker of its own with its share of the users (the
    # router's rendezvous placement, without its load bound) and of the tiers (the budgets here
    # are one process's); their device costs are the file's, measured with the processes beside
    # each other. The device is not modelled as shared: under MPS the processes' kernels overlap,
    # and what they cost each other is in their measured times.
    processes: int = 1
    # The copy engines' seconds per byte of psi, each way (CopyEngine; the file's points'
    # demote_copy_ms_mean and reload_copy_ms_mean over their psi's bytes: copy_seconds_per_byte);
    # 0: copies take no engine time and hold no ranking batch (the model before k22).
    demote_s_per_byte: float = 0.0
    reload_s_per_byte: float = 0.0
    # How a batch's or step's own inputs and scores cross (the ranker's --batch-copies): "engine",
    # copies on the compute stream, behind psi's copies; "scores_aside", scores out on a stream of
    # their own (the call waits for them, the device goes on; inputs still wait); "kernel", moved
    # by kernels through device views of page-locked memory, waiting for no copy engine.
    batch_copies: str = "engine"
    # psi no reload would take back (the ranker's CostModel.may_reload, since k25) is not copied
    # to host DRAM; False: the ranker before it, which offered every candidate to the gate.
    skip_unreloadable: bool = False
    # psi's bytes in host DRAM and over the link, against HBM's (the ranker's host_psi_format:
    # 1 native; fp8 about half, HOST_FP8_SCALE): the arena holds that many more, each copy moves
    # that share of the bytes, and a call's reload waits that much less of its copy.
    host_bytes_scale: float = 1.0
    # HBM and host DRAM enter the modelled point full of earlier points' psi (other users', as
    # big as this workload's), as a search's stack has them: psi leaves HBM, through the gate, from
    # the lead-in's first calls. False: both start empty (the model before k23; at 16384 tokens
    # the lead-in then filled HBM and its copies and the gate's state began late).
    carried: bool = False
    # A what-if: a pre-inference graph step's K/V, copied out of the graph's buffer into the psi
    # blocks by a device memcpy, waits for the device -> host copies in progress, as where a device
    # memcpy ran on that copy engine (on an H200 it does not: bench.copy_contention k23, kv_d2d).
    kv_copies_on_engine: bool = False


def _from_log_units(ms: float, us: float, ns: float) -> tuple[float, float, float]:
    """Step costs in the ranker's log units (per step ms, per token us, per pair ns) in seconds."""
    if min(ms, us, ns) < 0:
        raise ValueError(f"step costs {ms},{us},{ns} must be >= 0")
    return ms / 1e3, us / 1e6, ns / 1e9


@dataclasses.dataclass(frozen=True)
class TriggerView:
    """What the trigger knows when it applies its lead test (services/trigger/admission.py's
    too_late, with its InstanceLedger): the ranker's backlog and its pre-inferences' ranking
    deadlines as of its last Stats report (every `stats_interval_s`), plus its own admissions
    since that it expects not done yet; each pre-inference ahead costing `preinfer_ms` (the
    rankers' measured cost of a psi), the signal's trip `trip_ms` (the rankers' P90). It decides
    `event_lag_ms` after the retrieval event (its consumer's lag)."""

    preinfer_ms: float
    trip_ms: float
    event_lag_ms: float
    stats_interval_s: float = 0.2


# The trigger's own defaults (TriggerConfig): what AdmissionPolicy's fields default to.
_TRIGGER_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(TriggerConfig)}


@dataclasses.dataclass(frozen=True)
class AdmissionPolicy:
    """The trigger's admission as it runs (services/trigger/service.py, decide): every retrieval
    event through admission.decide, with the trigger's inputs as it has them: the full ranking's
    cost from the rankers' measurements (here the calibration's fit), the call against psi as the
    median of the recent batches against psi per call, a psi's cost as the scheduler plans it,
    the instance's offered load (OfferedLoad), the keys' returns (ReturnRate), the device's busy
    share over the last 2 s and its queue as of the last Stats report, its footprint and backlog
    in the ledger, and the lead test (TriggerView). Its settings are the trigger's
    (ADMISSION_SETTINGS), defaulting to the trigger's defaults; `of_run` takes a run's."""

    slo_ms: float = _TRIGGER_DEFAULTS["slo_ms"]
    risk_fraction: float = _TRIGGER_DEFAULTS["risk_fraction"]
    max_extra_work: float = _TRIGGER_DEFAULTS["max_extra_work"]
    spare_busy_max: float = _TRIGGER_DEFAULTS["spare_busy_max"]
    spare_min_saving: float = _TRIGGER_DEFAULTS["spare_min_saving"]
    load_window_s: float = _TRIGGER_DEFAULTS["load_window_s"]
    prefetch: bool = _TRIGGER_DEFAULTS["prefetch"]
    reuse_window_s: float = _TRIGGER_DEFAULTS["reuse_window_s"]
    footprint_fraction: float = _TRIGGER_DEFAULTS["footprint_fraction"]
    max_backlog: int = _TRIGGER_DEFAULTS["max_backlog"]
    lease_slack_ms: float = _TRIGGER_DEFAULTS["lease_slack_ms"]
    max_lease_ms: float = _TRIGGER_DEFAULTS["max_lease_ms"]
    stats_interval_s: float = _TRIGGER_DEFAULTS["stats_interval_s"]
    suffix_tokens_estimate: int = _TRIGGER_DEFAULTS["suffix_tokens_estimate"]
    # With it the trigger adds the ranker's host ms per request to each request it prices, as
    # the rankers report it (Setup.trigger_host_ms: estimated from the file's points).
    host_cost: bool = _TRIGGER_DEFAULTS["host_cost"]
    # The spare term weighs the waits a pre-inference imposes on other calls (its call rate from
    # the events the trigger routes, OfferedLoad.rate).
    spare_prices_waits: bool = _TRIGGER_DEFAULTS["spare_prices_waits"]
    # The spare term needs the host to have room too (admission.host_has_spare): the ranker's
    # host ms per request (Setup.trigger_host_ms) at the events' rate under this; 0: no bound.
    spare_host_max: float = _TRIGGER_DEFAULTS["spare_host_max"]

    @classmethod
    def of_run(cls, record: dict[str, Any]) -> AdmissionPolicy:
        """The settings a goodput record's trigger ran with (`trigger_settings`, recorded since
        2026-11-29's twenty-second session). A record without them is from a trigger of before
        then: the defaults of the time, which had no spare_min_saving (0: every spare admission
        passed the saving test), and its `risk_fraction` / `slo_ms` as the record gives them.
        Settings a record lacks are from a trigger of before them, which had them off
        (_LATER_SETTINGS: host pricing came in the twenty-fourth session, the spare term's waits
        in the twenty-sixth, its host bound in the thirty-ninth and on by default in the fortieth)."""
        settings = record.get("trigger_settings")
        if settings:
            known = {f.name for f in dataclasses.fields(cls)}
            return dataclasses.replace(
                cls(), **{**_LATER_SETTINGS, **{k: v for k, v in settings.items() if k in known}}
            )
        return dataclasses.replace(
            cls(), spare_min_saving=0.0, slo_ms=float(record.get("slo_ms", 50.0)), **_LATER_SETTINGS
        )


# Trigger settings added after runs were recorded, as the triggers before them behaved.
_LATER_SETTINGS: dict[str, Any] = {"host_cost": False, "spare_prices_waits": False, "spare_host_max": 0.0}


class _Report(NamedTuple):
    """One Stats report of the modelled ranker, as the trigger polls them."""

    at: float
    backlog: int
    dues: tuple[float, ...]
    busy: float  # device busy share over the last 2 s (DeviceTime.recent_busy_fraction)
    queue_depth: int
    leased_bytes: int  # psi admitted and not yet consumed (StatsReply.hbm_leased_bytes)


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """A ranker's pre-inference step costs, (per step s, per token s, per attention pair s):
    `eager` steps, and `graph` replays of chunks from a prefix's first token (None: no graphs),
    which hold at most `graph_batch` prefixes and `graph_tokens` tokens; with `graph_reads_psi`
    later chunks (they read the psi built so far) replay graphs too, at the same fit (the
    ranker's RELAYGR_RANKER_GRAPH_PSI_CHUNKS, on since k20)."""

    eager: tuple[float, float, float]
    graph: tuple[float, float, float] | None = None
    graph_tokens: int = 0
    graph_batch: int = 2
    graph_reads_psi: bool = False

    @staticmethod
    def fit(costs: tuple[float, float, float]) -> CostFit:
        """A fit that holds these costs (as the engine's holds its start-up measurement)."""
        per_step, per_token, per_pair = costs
        return CostFit(CostPrior(per_batch_s=per_step, per_token_s=per_token, per_pair_s=per_pair,
                                 pairs_measured=True, batches=1e9))  # fmt: skip

    def seconds(self, chunks: Sequence[Chunk], graphed: bool) -> float:
        """A step of these chunks: a graph replay costs its measured fit; an eager step costs
        its per-step host time or its device work (the graph fit's, the same kernels), whichever
        is longer: the eager fit was measured on short steps (256 tokens to one prefix), where
        the host's launches are all of it, and learns no per-token cost there (0 on an H200)."""
        tokens, pairs = chunk_work(chunks)

        def cost(c: tuple[float, float, float]) -> float:
            return c[0] + c[1] * tokens + c[2] * pairs

        if self.graph is None:
            return cost(self.eager)
        return cost(self.graph) if graphed else max(cost(self.eager), cost(self.graph))

    def scaled(self, factor: float) -> StepCosts:
        """Every step costing `factor` x as much (in service against at start-up)."""

        def times(c: tuple[float, float, float]) -> tuple[float, float, float]:
            return (c[0] * factor, c[1] * factor, c[2] * factor)

        return dataclasses.replace(
            self, eager=times(self.eager), graph=None if self.graph is None else times(self.graph)
        )

    @classmethod
    def parse(
        cls, eager: str, graph: str | None = None, graph_tokens: int = 17_408, graph_batch: int = 2
    ) -> StepCosts:
        """From 'per step ms,per token us,per pair ns' strings (the ranker's log units)."""

        def one(text: str) -> tuple[float, float, float]:
            try:
                ms, us, ns = (float(v) for v in text.split(","))
            except ValueError:
                raise ValueError(f"step costs {text!r}: 'per step ms,per token us,per pair ns'") from None
            return _from_log_units(ms, us, ns)

        return cls(one(eager), one(graph) if graph else None, graph_tokens if graph else 0, graph_batch)

    @classmethod
    def recorded(cls, record: dict[str, Any]) -> StepCosts | None:
        """From a goodput search record's `ranker_step_costs` (bench.goodput); None without."""
        costs = record.get("ranker_step_costs") or {}
        if "eager" not in costs:
            return None

        def one(c: dict[str, Any]) -> tuple[float, float, float]:
            return _from_log_units(float(c["per_step_ms"]), float(c["per_token_us"]), float(c["per_pair_ns"]))

        graph = costs.get("graph")
        return cls(one(costs["eager"]), one(graph) if graph else None,
                   int(costs.get("graph_tokens", 0)) if graph else 0, int(costs.get("graph_batch", 2)),
                   bool(graph) and bool(costs.get("graph_reads_psi", False)))  # fmt: skip

    def plans(self, scheduler: IterationScheduler) -> IterationScheduler:
        """`scheduler`, planning and graphing chunks as a ranker with these steps does."""
        scheduler.graph_reads_psi = self.graph is not None and self.graph_reads_psi
        return scheduler


class _Lru:
    """Bytes-bounded LRU of psi keys. Psi filled in from earlier points (fill) is held as a run
    that put evicts piece by piece, oldest first: a tier of a petabyte (the ceiling's HBM) costs
    nothing to fill, where one key per psi would take millions."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._items: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()
        self._filled: list[tuple[int, list[int], int, int]] = []  # (first user, sizes, next, end)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._items

    def touch(self, key: tuple[int, int]) -> None:
        self._items.move_to_end(key)

    def pop(self, key: tuple[int, int]) -> None:
        self.used -= self._items.pop(key)

    def fill(self, first_user: int, sizes: Sequence[int]) -> None:
        """Fills the free room with psi of users first_user, first_user - 1, ... (sizes in turn,
        until one does not fit): what a stack holds from the points before this one. They are
        older than anything put later, and go first."""
        if self._items:
            raise ValueError("a tier is filled before anything is put in it (what it fills is older)")
        positive = [n for n in sizes if 0 < n <= self.capacity]
        if not positive:
            return
        room = self.capacity - self.used
        cycles, room = divmod(room, sum(positive))
        count, filled = cycles * len(positive), cycles * sum(positive)
        for n in positive:
            if n > room:
                break
            room, count, filled = room - n, count + 1, filled + n
        if count:
            self._filled.append((first_user, positive, 0, count))
            self.used += filled

    def __len__(self) -> int:
        return len(self._items) + sum(end - nxt for _, _, nxt, end in self._filled)

    def _evict_oldest(self) -> tuple[tuple[int, int], int]:
        if self._filled:
            first_user, sizes, nxt, end = self._filled[0]
            size = sizes[nxt % len(sizes)]
            if nxt + 1 < end:
                self._filled[0] = (first_user, sizes, nxt + 1, end)
            else:
                self._filled.pop(0)
            self.used -= size
            return (first_user - nxt, 0), size
        old, size = self._items.popitem(last=False)
        self.used -= size
        return old, size

    def put(self, key: tuple[int, int], nbytes: int) -> list[tuple[tuple[int, int], int]]:
        """Inserts (most recent); returns what it evicted, oldest first."""
        if key in self._items:
            self.pop(key)
        evicted = []
        while (self._items or self._filled) and self.used + nbytes > self.capacity:
            evicted.append(self._evict_oldest())
        if nbytes <= self.capacity:
            self._items[key] = nbytes
            self.used += nbytes
        return evicted


# The ranker's batch_copies, in the order the what-if changes encode them (float indices).
BATCH_COPIES = tuple(b.value for b in BatchCopies)


def _no_wait(t: float) -> float:
    return t


class CopyEngine:
    """One direction's copy engine (device -> host: demotions; host -> device: reloads) as a
    resource: psi's copies run on it back to back, in the order issued, each after the compute
    queued when it was issued (the engine orders a copy after it: services/ranker/engine.py). A
    ranking batch's own small copy on the compute stream (its scores out, its inputs in) that
    becomes ready while psi copies run waits until the engine is idle, and the compute stream
    waits with it. Measured on an H200 (bench.copy_contention k23b): a few-KiB copy issued 1 ms
    into a 512 MiB copy (9.7 ms) waited 8.1-8.7 ms, whole copy, 16 or 64 MiB pieces all queued,
    or 16 MiB pieces queued two at a time; in calls at 16384 tokens (k22) calls against psi took
    up to 9-11 ms of device time behind one copy and 20-29 ms behind two or three."""

    def __init__(self, seconds_per_byte: float) -> None:
        self.seconds_per_byte = seconds_per_byte
        self.free_at = 0.0  # when the last copy issued ends
        self.busy_s = 0.0
        self._spans: collections.deque[tuple[float, float]] = collections.deque()  # (start, end)

    def copy(self, issued_at: float, nbytes: int) -> float:
        """A psi copy of `nbytes` issued at `issued_at` (after the compute then queued): its end."""
        if self.seconds_per_byte <= 0:
            return issued_at
        start = max(issued_at, self.free_at)
        self.free_at = start + nbytes * self.seconds_per_byte
        self.busy_s += self.free_at - start
        self._spans.append((start, self.free_at))
        return self.free_at

    def stalled_until(self, t: float) -> float:
        """When a small copy ready at `t` gets the engine: `t`, or the end of the run of back to
        back copies in progress then (those issued so far). Queried at non-decreasing times (the
        device's clock)."""
        while self._spans and self._spans[0][1] <= t:
            self._spans.popleft()
        if not self._spans or self._spans[0][0] >= t:
            return t
        end = self._spans[0][1]
        for start, stop in itertools.islice(self._spans, 1, None):
            if start > end:  # the engine idles in between: the small copy goes then
                break
            end = stop
        return end


@dataclasses.dataclass
class Served:
    request: PlannedRequest
    path: str
    latency_ms: float
    device_ms: float  # its share of its batch's device time


@dataclasses.dataclass
class _Production:
    """A pre-inference under way in the model: the scheduler's view of it, and the calls that
    joined it (each: its rank item, request, arrival)."""

    item: PreinferItem
    key: tuple[int, int]
    waiters: list[tuple[RankItem, PlannedRequest, float]] = dataclasses.field(default_factory=list)


def _warm_keep_gate(reuse: float | None, seeded: int = 64) -> KeepGate:
    """The ranker's keep gate as a search's ranker enters a point: past its first keeps, its
    reads per keep the file's measured (`reuse`: `seeded` keeps and as many reads), or nothing
    yet learned (None: open until its first keep, as a fresh one is after min_kept)."""
    gate = KeepGate(min_kept=0)
    if reuse is not None:  # nothing decays until the point's first opportunity: order is moot
        for _ in range(seeded):
            gate.kept()
        for _ in range(round(reuse * seeded)):
            gate.read()
    return gate


def reload_saving_ms(cal: Calibration, prefix_len: int, suffix: int) -> float:
    """What a reload saves a call, as the ranker prices it (Engine.reload_saving_s: its fit of
    the batches it measured, full rankings of such prefixes among them): the calibrated full
    ranking of the call less its call against psi. The scheduler's fit, fed sizes up to 8832
    tokens, put a 16704-token full ranking at 7.6 ms where the calibration has 20.0 (k23a): the
    modelled gate then asked 2.7 times the returns the ranker's did."""
    tokens = prefix_len + suffix
    full = cal.full.fitted_s(tokens, prefix_len * tokens)
    against_psi = (cal.cached or cal.full).fitted_s(suffix, 0)
    return max(0.0, full - against_psi) * 1e3


# The sizes a modelled scheduler's fit observes where it is given no workload (tokens of a call,
# 320 of them its suffix).
_FIT_SIZES = (320, 1280, 4416, 8832)
# The workload's full rankings the fit observes (quantiles of their tokens), and the batches of
# calls against psi (this many calls of the workload's suffix each).
_FIT_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
_FIT_CACHED_CALLS = (1, 2, 4, 8)


def _scheduler_fit(cal: Calibration, requests: Sequence[PlannedRequest] = ()) -> CostFit:
    """The one fit the scheduler judges every batch and step by, fed what the ranker's own fit
    learns from (services/ranker/call_cost.py, observe_batches): full rankings at the sizes of
    `requests` (quantiles of their tokens, each with its prefix's pairs as CallWork counts them)
    and batches of 1-8 calls against psi of their suffix, at the calibrated costs. Fed full
    rankings of fixed sizes instead (320-8832 tokens), it extrapolated a fit of one length's
    records (L4096: every full ranking one shape) down to sizes the ranker never served and
    priced calls against psi at a full ranking's tokens: on k27c (H200, L4096) it came out with
    no cost per batch, so the scheduler never batched two calls against psi where the GPU's
    ranker batched 1.16-2.4 a batch, and the modelled relay missed at 312.5 req/s (P99 ~2 s)
    what the GPU met (44 ms). Without `requests`, the fixed sizes."""
    fit = CostFit(CostPrior(per_batch_s=cal.full.per_batch_s, per_token_s=cal.full.per_token_s, batches=0.0))
    if requests:
        by_tokens = sorted(requests, key=lambda r: r.prefix_len + r.recent_len + r.candidates)
        picks = {by_tokens[min(len(by_tokens) - 1, int(q * len(by_tokens)))] for q in _FIT_QUANTILES}
        full = sorted({(r.prefix_len, r.recent_len + r.candidates) for r in picks})
        suffix = int(np.median([r.recent_len + r.candidates for r in requests]))
    else:
        full = [(max(tokens - 320, 0), min(tokens, 320)) for tokens in _FIT_SIZES]
        suffix = 320
    for prefix, call_suffix in full:
        tokens = prefix + call_suffix
        fit.observe(tokens, prefix * tokens, cal.full.fitted_s(tokens, prefix * tokens))
    if cal.cached is not None:
        for calls in _FIT_CACHED_CALLS:
            fit.observe(suffix * calls, 0, cal.cached.fitted_s(suffix * calls, 0))
    return fit


def simulate(
    requests: Sequence[PlannedRequest],
    cal: Calibration,
    setup: Setup,
    seed: int = 0,
    preinfer_steps: list[tuple[float, float]] | None = None,
    preinfers: list[tuple[float, float, float, float]] | None = None,
    decisions: list[tuple[float, str]] | None = None,
    copies: list[tuple[float, str]] | None = None,
    gate: DemotionGate | None = None,
) -> list[Served]:
    """Every call of `requests` through one modelled ranker (module docstring), in order of
    service; the latencies of all of them (the caller drops the lead-in's). `preinfer_steps`, when
    given, receives each pre-inference step's (start, seconds); `preinfers` each completed
    pre-inference's (submitted, first step's start, completed, its call's planned time), as the
    ranker counts them (relaygr_ranker_preinfer_*); `decisions` (with `setup.admission`) the
    trigger's decision on each retrieval event: (its time, the trigger's counter label:
    services/trigger/admission.py's Reason, an admission as admitted_risk / _reuse / _spare);
    `copies` each psi leaving HBM for DRAM or not, and each back: (time, "demotions",
    "demotions_skipped" or "reloads", the ranker's point fields); `gate` (with the setup's
    demotion gate) the gate to go on with, as a search's ranker carries its own from point to
    point (otherwise a warm one of this point's own)."""
    rng = np.random.default_rng(seed)
    rank_fit = _scheduler_fit(cal, requests)
    limit = setup.graph_full_tokens
    steps = setup.preinfer_steps
    graph_batch = steps.graph_batch if steps is not None else 2
    scheduler = IterationScheduler(
        setup.scheduler,
        # Pre-inference steps: as the ranker measured them, else a prefix's forward costs what
        # a full ranking of it does.
        StepCosts.fit(steps.eager) if steps is not None else rank_fit,
        rank_fit,
        first_costs=StepCosts.fit(steps.graph) if steps is not None and steps.graph is not None else None,
        graph_tokens=steps.graph_tokens if steps is not None else 0,
        full_replays=_full_replays(limit, setup.full_batch_tokens, graph_batch) if limit > 0 else None,
        graph_batch=graph_batch,
    )
    if steps is not None:
        steps.plans(scheduler)
    hbm, dram = _Lru(setup.hbm_budget_bytes), _Lru(setup.dram_bytes)
    if setup.carried and requests:
        sizes = [r.prefix_len * PSI_BYTES_PER_TOKEN for r in requests]
        for tier in (dram, hbm):  # foreign users: negative ids, never asked for again
            tier.fill(-1 - len(tier), sizes)
    # Warm: the ranker's gate enters a point past its min_demotions (module docstring).
    if not setup.demotion_gate:
        gate = None
    elif gate is None:
        gate = DemotionGate(min_demotions=0)
    keep_gate = _warm_keep_gate(setup.keep_reuse) if setup.keep_gate else None
    kept_by_ranking: set[tuple[int, int]] = set()  # psi in HBM that a full ranking kept
    to_host = CopyEngine(setup.demote_s_per_byte)  # demotions
    to_device = CopyEngine(setup.reload_s_per_byte)  # reloads
    # The batches' and steps' own copies: behind psi's on the engines, or by kernels.
    inputs_wait = to_device.stalled_until if setup.batch_copies != "kernel" else _no_wait
    scores_wait = to_host.stalled_until if setup.batch_copies != "kernel" else _no_wait
    scores_hold_device = setup.batch_copies == "engine"
    by_arrival = sorted(requests, key=lambda r: r.t_rank_s)
    trip_s = (setup.preinfer_trip_ms or 0.0) / 1e3
    signals = sorted(requests, key=lambda r: r.t_retrieval_s) if setup.preinfer_trip_ms is not None else []
    queue: dict[int, tuple[RankItem, PlannedRequest, str, float]] = {}
    # The calls the engine plans from, as it holds them (no call waiting for its copy).
    rank_queue = RankQueue()
    view = setup.trigger if setup.lead_test else None
    policy = setup.admission if view is not None else None
    ledger = InstanceLedger()
    reports: collections.deque[_Report] = collections.deque(maxlen=64)
    # The trigger's own measurements (AdmissionPolicy): the instance's offered load, the keys'
    # returns, the recent calls against psi (ms a call), psi leased (admitted, not yet consumed).
    offered = OfferedLoad(policy.load_window_s) if policy is not None else None
    returns = ReturnRate(policy.reuse_window_s) if policy is not None else None
    cached_ms: collections.deque[float] = collections.deque(maxlen=128)
    leased: dict[tuple[int, int], int] = {}
    psi_ms: dict[int, float] = {}  # a psi's cost by prefix length, as the scheduler plans it
    busy_spans: collections.deque[tuple[float, float]] = collections.deque()  # device work, last ~2 s
    next_report = 0.0
    producing: dict[tuple[int, int], _Production] = {}
    productions: dict[int, _Production] = {}
    first_step: dict[int, float] = {}  # production id -> its first step's start
    out: list[Served] = []
    now, i, j, ids = 0.0, 0, 0, 0  # now: the host's clock (it plans); device_free: the device's
    device_free = 0.0
    reloads: list[tuple[float, int]] = []  # (ready time, id): calls waiting for their copy
    ready_at: dict[tuple[int, int], float] = {}  # psi produced ahead of its call: when it is complete

    def next_id() -> int:
        nonlocal ids
        ids += 1
        return ids

    copy_debt = 0.0  # the host's time owed for copies issued since the last batch's host step
    lock_debt = 0.0  # the event loop's time under the interpreter lock, owed by arrivals (Setup)

    def owe_request() -> None:
        nonlocal lock_debt
        lock_debt += setup.request_host_s

    def pay_while_waiting(seconds: float) -> None:
        """The device loop waits `seconds` (for the device, for work): the event loop runs then."""
        nonlocal lock_debt
        lock_debt = max(0.0, lock_debt - max(seconds, 0.0))

    def copied() -> None:
        nonlocal copy_debt
        copy_debt += setup.copy_issue_s

    def keep(key: tuple[int, int], prefix_len: int, suffix: int) -> None:
        kept_by_ranking.discard(key)  # psi of another source from here on (a ranking's: serve adds it)
        for old, size in hbm.put(key, prefix_len * PSI_BYTES_PER_TOKEN):
            if dram.capacity <= 0:
                continue
            saving = reload_saving_ms(cal, size // PSI_BYTES_PER_TOKEN, suffix)
            stored = round(size * setup.host_bytes_scale)
            if setup.skip_unreloadable and setup.reload_s_per_byte > 0 and not may_reload(stored, saving):
                if copies is not None:
                    copies.append((now, "demotions_never_reloaded"))
                continue  # no reload would take it back (CostModel.may_reload): not copied
            if gate is not None and not gate.admits(old[0], saving, setup.copy_cost_ms):
                if copies is not None:
                    copies.append((now, "demotions_skipped"))
                continue  # evicted without a copy
            dram.put(old, stored)  # demoted before it goes (demotion under pressure)
            to_host.copy(max(now, device_free), stored)  # issued now, after the compute queued
            copied()
            if copies is not None:
                copies.append((now, "demotions"))
            if gate is not None:
                gate.demoted()

    def may_reload(nbytes: int, saving_ms: float) -> bool:
        """The ranker's rule (CostModel.may_reload) at the file's copy rate."""
        return COPY_OVERHEAD_MS + nbytes * setup.reload_s_per_byte * 1e3 <= BUSY_COPY_PREFERENCE * saving_ms

    def reloaded() -> None:
        copied()
        if copies is not None:
            copies.append((now, "reloads"))
        if gate is not None:
            gate.reloaded()

    def draw_reload_ms(nbytes: int) -> float:
        """A call's wait for its reload of `nbytes` of psi, drawn from the file's; with a host
        format of fewer bytes, less the copy time those bytes no longer take."""
        pool = cal.reload_cache_ms
        drawn = float(pool[rng.integers(len(pool))]) if pool else 0.0
        saved_s = (1.0 - setup.host_bytes_scale) * nbytes * setup.reload_s_per_byte
        return max(0.0, drawn - saved_s * 1e3)

    def reload_copy(nbytes: int) -> None:
        to_device.copy(max(now, device_free), round(nbytes * setup.host_bytes_scale))

    def busy_share(t: float, window_s: float = 2.0) -> float:
        """The device's busy share over the last `window_s` (as the ranker reports it)."""
        while busy_spans and busy_spans[0][1] < t - window_s:
            busy_spans.popleft()
        since = max(0.0, t - window_s)
        if t <= since:
            return 0.0
        busy = sum(max(0.0, min(end, t) - max(start, since)) for start, end in busy_spans)
        return min(1.0, busy / (t - since))

    def full_ms(prefix_len: int, suffix: int) -> float:
        tokens = prefix_len + suffix
        return cal.full.fitted_s(tokens, prefix_len * tokens) * 1e3

    def psi_cost_ms(prefix_len: int) -> float:
        if prefix_len not in psi_ms:
            psi_ms[prefix_len] = (
                _psi_plan_ms(scheduler, steps, prefix_len)
                if steps is not None
                else cal.full.fitted_s(prefix_len, prefix_len * prefix_len) * 1e3
            )
        return psi_ms[prefix_len]

    def admitted_by_trigger(r: PlannedRequest, key: tuple[int, int], need_by: float) -> Reason:
        """The trigger's decision on r's retrieval event, taken its event lag after it, on what it
        knows then (AdmissionPolicy; services/trigger/service.py's decide, step for step)."""
        assert view is not None
        assert policy is not None
        assert offered is not None
        assert returns is not None
        decided = r.t_retrieval_s + view.event_lag_ms / 1e3
        report = sync_ledger(decided)
        ledger.forget_expired(decided)
        returning = returns.observe(key, decided)
        suffix = policy.suffix_tokens_estimate
        full = full_ms(r.prefix_len, suffix)
        depth = report.queue_depth if report is not None else 0
        busy = report.busy if report is not None else None
        predicted = full * (1 + depth)  # LatencyModel.predict: its compute and the queue ahead
        offered.add(decided, full)
        load = offered.fraction(decided)
        cached = statistics.median(cached_ms) if cached_ms else full_ms(0, suffix)
        prefix = psi_cost_ms(r.prefix_len)
        keeps = setup.psi and 0 < setup.keep_min_tokens <= r.prefix_len
        # Each request priced with what it costs the ranker's host too (the trigger's host_cost):
        # the pre-inference and the call against psi are two requests where a full ranking is one.
        host = setup.trigger_host_ms if policy.host_cost else 0.0
        pays = policy.reuse_window_s > 0 and reuse_pays(
            full + host, prefix + host, cached + host, returns.expected_later(), keeps
        )
        adds_little = adds_little_work(full + host, prefix + host, cached + host, policy.max_extra_work)
        spare = (
            busy is not None
            and busy < policy.spare_busy_max
            and host_has_spare(setup.trigger_host_ms or None, offered.rate(decided), policy.spare_host_max)
            and spare_shortens(full, cached, policy.slo_ms, policy.spare_min_saving)
            and (
                not policy.spare_prices_waits
                or spare_outweighs_waits(full, cached, prefix, offered.rate(decided))
            )
        )
        ahead = ledger.backlog_ahead(decided, need_by)
        late = too_late(r.t_rank_s - decided, view.trip_ms / 1e3, prefix, ahead)
        prefetch = policy.prefetch and not (setup.psi and 0 < r.prefix_len < setup.keep_min_tokens)
        bounds = Bounds(policy.slo_ms, policy.risk_fraction, policy.footprint_fraction, policy.max_backlog)
        nbytes = r.prefix_len * PSI_BYTES_PER_TOKEN
        reason = decide(Policy.SEQUENCE_AWARE, bounds, predicted, nbytes, ledger, key, decided, load, pays,
                        adds_little, returning, prefetch, spare, late)  # fmt: skip
        label = reason.value
        if reason is Reason.ADMITTED:
            at_risk = predicted > risk_threshold_ms(bounds, load) and adds_little
            label = "admitted_risk" if at_risk else "admitted_reuse" if pays else "admitted_spare"
            lease = min(need_by + policy.lease_slack_ms / 1e3, decided + policy.max_lease_ms / 1e3)
            queued_s = view.trip_ms / 1e3 + prefix / 1e3 * (1 + ahead)
            ledger.admit(key, nbytes, decided, lease, queued_until=decided + queued_s, due=need_by)
        if decisions is not None:
            decisions.append((r.t_retrieval_s, label))
        return reason

    def sync_ledger(decided: float) -> _Report | None:
        """The trigger's ledger as of its last Stats report before `decided`; that report (None:
        none yet)."""
        known = [rep for rep in reports if rep.at <= decided]
        if not known:
            return None
        rep = known[-1]
        if ledger.reported_at != rep.at:
            budget = setup.hbm_budget_bytes if policy is not None else 0  # no footprint test otherwise
            ledger.report(rep.at, budget, rep.leased_bytes, rep.backlog, rep.queue_depth, rep.dues)
        return rep

    def signal(r: PlannedRequest, t: float) -> None:
        """A pre-inference signal (every request: the `preinfer-all` policy): psi held is kept,
        psi in DRAM comes back, a prefix held nowhere is pre-inferred."""
        key = (r.user_id, r.prefix_version)
        need_by = r.t_rank_s + setup.slo_ms / 1e3  # its call's deadline (the retrieval event's)
        if policy is not None:
            reason = admitted_by_trigger(r, key, need_by)
            if reason is not Reason.ADMITTED and not (reason is Reason.PREFETCH and key in dram):
                return  # turned away; a prefetch of psi held nowhere is refused by the ranker
            leased[key] = r.prefix_len * PSI_BYTES_PER_TOKEN
        if key in producing or key in hbm:
            return
        if key in dram:
            dram.pop(key)
            reload_copy(r.prefix_len * PSI_BYTES_PER_TOKEN)
            keep(key, r.prefix_len, r.recent_len + r.candidates)  # a prefetch: back in HBM before its call
            reloaded()
            ready_at[key] = t + draw_reload_ms(r.prefix_len * PSI_BYTES_PER_TOKEN) / 1e3
            return
        pid = next_id()
        # The lead test alone (with the trigger's whole admission, its decision included it):
        if view is not None and policy is None:
            # as the trigger runs it: decided at the event's lag, on the last report it had then
            # and its own admissions since;
            decided = r.t_retrieval_s + view.event_lag_ms / 1e3
            sync_ledger(decided)
            ahead_count = ledger.backlog_ahead(decided, need_by)
            if too_late(r.t_rank_s - decided, view.trip_ms / 1e3, view.preinfer_ms, ahead_count):
                return
            queued_s = (view.trip_ms + view.preinfer_ms * (1 + ahead_count)) / 1e3
            ledger.admit(key, 0, decided, math.inf, queued_until=decided + queued_s, due=need_by)
        elif view is None and setup.lead_test:
            # or by the model's exact queue: the trigger's too_late (services/trigger/admission.py)
            # refuses it when the backlog due no later than it would not let it start before its
            # call comes; the call then ranks in full.
            ahead = sum(
                scheduler.remaining_seconds(p.item.done, p.item.length)
                for p in productions.values()
                if not p.item.taken and p.item.due <= need_by
            )
            if t + ahead > r.t_rank_s:
                return
        production = _Production(PreinferItem(pid, r.prefix_len, 0, t, need_by=need_by), key)
        producing[key], productions[pid] = production, production
        keep(key, r.prefix_len, r.recent_len + r.candidates)  # its block is taken at admission

    def arrive(r: PlannedRequest, t: float) -> None:
        key = (r.user_id, r.prefix_version)
        leased.pop(key, None)  # its lease is converted: the psi is the call's now, then evictable
        suffix = r.recent_len + r.candidates
        deadline = t + setup.call_deadline_s  # what the ranker's scheduler orders by
        due_by = t + setup.call_slo_s  # and holds it doomed past
        production = producing.get(key)
        if production is not None:
            decision = scheduler.relay(production.item, t, deadline)
            if decision is Relay.JOIN:
                joined = production.item.joined_deadline
                production.item = dataclasses.replace(
                    production.item,
                    joined_deadline=deadline if joined is None else min(joined, deadline),
                    joined_due_by=max(due_by, production.item.joined_due_by),
                )
                production.waiters.append(
                    (RankItem(next_id(), RankKind.CACHED, deadline, t, suffix, due_by=due_by), r, t)
                )
                return
            # Taken over: the call computes the rest of the prefix and its suffix in its own step.
            del producing[key], productions[production.item.id]
            rest = production.item.remaining
            path = "partial_prefix" if production.item.done else "full_recompute"
            item = RankItem(
                next_id(),
                RankKind.FULL,
                deadline,
                t,
                rest + suffix,
                rest * (r.prefix_len + suffix),
                due_by=due_by,
            )
            queue[item.id] = (item, r, path, t)
            rank_queue.add(item)
            return
        path = "full_recompute"
        if setup.psi and key in hbm:
            hbm.touch(key)
            path = "hbm_hit"
            if keep_gate is not None and key in kept_by_ranking:
                keep_gate.read()  # a read of psi a full ranking kept (the ranker's claim source)
            if ready_at.get(key, -math.inf) > t:  # produced ahead, not complete when the call came
                path = "inflight_join"
                item = RankItem(next_id(), RankKind.CACHED, deadline, t, suffix, due_by=due_by)
                queue[item.id] = (item, r, path, t)
                reloads.append((ready_at[key], item.id))
                return
        elif setup.psi and key in dram:
            path = "dram_reload"
        cached = path != "full_recompute"
        tokens = suffix if cached else r.prefix_len + suffix
        pairs = 0 if cached else r.prefix_len * (r.prefix_len + suffix)
        kind = RankKind.CACHED if cached else RankKind.FULL
        item = RankItem(next_id(), kind, deadline, t, tokens, pairs, due_by=due_by)
        queue[item.id] = (item, r, path, t)
        if path != "dram_reload":
            rank_queue.add(item)
        else:
            reloads.append((t + draw_reload_ms(r.prefix_len * PSI_BYTES_PER_TOKEN) / 1e3, item.id))
            dram.pop(key)
            reload_copy(r.prefix_len * PSI_BYTES_PER_TOKEN)
            keep(key, r.prefix_len, suffix)  # back in HBM (a reload is admitted like any psi)
            reloaded()

    def serve(batch: list[tuple[RankItem, PlannedRequest, str, float]], seconds: float, end: float) -> None:
        for item, r, path, arrived in batch:
            samples = cal.overhead_ms.get(path) or cal.overhead_ms.get("full_recompute") or (0.0,)
            extra = float(samples[rng.integers(len(samples))])
            if path == "full_recompute" and cal.miss_cache_ms:
                extra += float(cal.miss_cache_ms[rng.integers(len(cal.miss_cache_ms))])
            out.append(Served(r, path, (end - arrived) * 1e3 + extra, seconds * 1e3 / len(batch)))
            if setup.psi and item.kind is RankKind.FULL and r.prefix_len >= setup.keep_min_tokens:
                key, suffix = (r.user_id, r.prefix_version), r.recent_len + r.candidates
                if path != "full_recompute" or keep_gate is None:
                    keep(key, r.prefix_len, suffix)
                    if copies is not None and path == "full_recompute":
                        copies.append((now, "psi_from_rankings"))
                    continue
                if not keep_gate.admits(
                    r.user_id, reload_saving_ms(cal, r.prefix_len, suffix), setup.keep_cost_ms
                ):
                    if copies is not None:
                        copies.append((now, "ranking_psi_declined"))
                    continue  # declined: this call's psi is not kept
                keep(key, r.prefix_len, suffix)
                keep_gate.kept()
                kept_by_ranking.add(key)
                if copies is not None:
                    copies.append((now, "psi_from_rankings"))

    while i < len(by_arrival) or j < len(signals) or queue or productions:
        while view is not None and next_report <= now:  # the rankers' Stats, as the trigger polls them
            dues = tuple(sorted(p.item.need_by for p in productions.values()))
            busy = busy_share(next_report) if policy is not None else 0.0
            leased_bytes = sum(leased.values())
            reports.append(
                _Report(next_report, len(dues), dues[:MAX_PREINFER_DUES], busy, len(queue), leased_bytes)
            )
            next_report += view.stats_interval_s
        while j < len(signals) and signals[j].t_retrieval_s + trip_s <= now:
            before = len(producing)
            signal(signals[j], signals[j].t_retrieval_s + trip_s)
            if len(producing) > before or policy is None:  # a PreInfer the ranker handles
                owe_request()
            j += 1
        while i < len(by_arrival) and by_arrival[i].t_rank_s <= now:
            arrive(by_arrival[i], by_arrival[i].t_rank_s)
            owe_request()
            i += 1
        landed = [rid for t, rid in reloads if t <= now]
        if landed:  # copies done: their calls join the engine's queue
            for rid in landed:
                rank_queue.add(queue[rid][0])
            reloads = [(t, rid) for t, rid in reloads if t > now]
        pending = [p.item for p in productions.values()]
        plan = scheduler.plan(now, rank_queue, pending) if len(rank_queue) or pending else None
        if plan is None or plan.empty:
            if device_free > now:
                # Nothing to launch ahead: the engine collects the batch in flight first, and a
                # call that comes meanwhile is launched after it (its launch then on the path).
                pay_while_waiting(device_free - now)
                now = device_free
                continue
            next_times = [t for t, rid in reloads if t > now]
            if i < len(by_arrival):
                next_times.append(by_arrival[i].t_rank_s)
            if j < len(signals):
                next_times.append(signals[j].t_retrieval_s + trip_s)
            if plan is not None and plan.wait_s > 0:
                next_times.append(now + plan.wait_s)
            if not next_times:
                break
            pay_while_waiting(min(next_times) - now)
            now = max(now, min(next_times))
            continue
        if plan.chunks:
            graphed = steps is not None and scheduler.step_graphed(plan.chunks)
            if steps is not None:  # what the ranker measured such a step to cost
                seconds = steps.seconds(plan.chunks, graphed)
            else:
                tokens, pairs = chunk_work(plan.chunks)
                seconds = cal.full.draw_s(tokens, pairs, rng, len(plan.chunks))
            launched_ahead = setup.chunks_ahead and graphed and setup.launch_scale > 0
            if launched_ahead:
                # Launched ahead (the ranker's --chunks-ahead): the host launches the graph's
                # replay (drawn as a batch against psi's launch of as many tokens) and goes on;
                # the step runs once the device is free. Its chunks count as built at the
                # launch: what reads their psi next is launched behind the step on the stream.
                tokens, _ = chunk_work(plan.chunks)
                launch = (
                    setup.launch_scale
                    * setup.launch_own_share
                    * (cal.cached or cal.full).draw_launch_s(tokens, rng, len(plan.chunks))
                )
                begin = inputs_wait(max(device_free, now + launch))
                now += launch
            else:
                pay_while_waiting(device_free - now)
                begin = now = max(now, device_free)  # run in place: after the batch in flight
                begin = inputs_wait(begin)  # its inputs staged in behind a reload
                pay_while_waiting(seconds + begin - now)
                now = begin + seconds
            end = device_free = begin + seconds
            if setup.kv_copies_on_engine and graphed:
                # The step's K/V copied out of the graph's buffer into the psi blocks (a device
                # memcpy) behind the device -> host piece in progress; run in place, the loop waits.
                end = device_free = to_host.stalled_until(end)
                if not launched_ahead:
                    pay_while_waiting(end - now)
                    now = max(now, end)
            if preinfer_steps is not None:
                preinfer_steps.append((begin, seconds))
            if policy is not None:
                busy_spans.append((begin, end))
            for c in plan.chunks:
                first_step.setdefault(c.id, begin)
            for c in plan.chunks:
                production = productions[c.id]
                production.item = dataclasses.replace(production.item, done=c.end)
                if c.end >= production.item.length:  # psi complete: its joined calls rank against it
                    del productions[c.id], producing[production.key]
                    if preinfers is not None:
                        built = production.item
                        planned = built.need_by - setup.slo_ms / 1e3
                        preinfers.append((built.submitted, first_step.pop(c.id, begin), end, planned))
                    ready_at[production.key] = now  # in place, its end; ahead, its launch
                    for item, r, arrived in production.waiters:
                        queue[item.id] = (item, r, "inflight_join", arrived)
                        rank_queue.add(item)
            continue
        batch = [queue.pop(rid) for rid in plan.rank]
        for rid in plan.rank:
            rank_queue.remove(rid)
        cost = cal.full if batch[0][0].kind is RankKind.FULL else (cal.cached or cal.full)
        tokens = sum(b[0].tokens for b in batch)
        seconds = cost.draw_s(tokens, sum(b[0].pairs for b in batch), rng, len(batch))
        launch_s = setup.launch_scale * setup.launch_own_share * cost.draw_launch_s(tokens, rng, len(batch))
        if batch[0][0].kind is RankKind.CACHED:
            cached_ms.append(seconds * 1e3 / len(batch))  # what the trigger prices a call against psi by
        if launch_s <= 0.0:
            lock_debt = 0.0  # the device-only model: no host
            start = inputs_wait(max(now, device_free))  # the device-only model: back to back
            scores_at = scores_wait(start + seconds)  # its scores out
            now = device_free = scores_at if scores_hold_device else start + seconds
            if policy is not None:
                busy_spans.append((start, start + seconds))
            serve(batch, seconds, scores_at)
            continue
        # Launch-ahead: this batch was planned now and is launched while the one before it runs;
        # it starts once both are done (its inputs in, behind the piece of a reload in progress),
        # and ends once its scores are out (behind the piece of a demotion in progress). The host
        # then collects the one before and plans the next.
        ahead_ends = device_free
        start = inputs_wait(max(device_free, now + launch_s))
        scores_at = scores_wait(start + seconds)
        device_free = scores_at if scores_hold_device else start + seconds
        if policy is not None:
            busy_spans.append((start, start + seconds))
        serve(batch, seconds, scores_at)
        # The event loop's owed work runs while this launch waits for the batch ahead; what
        # the wait does not cover delays the loop (one interpreter lock).
        now = max(now + launch_s + lock_debt, ahead_ends) + setup.launch_scale * (
            setup.host_step_s + copy_debt
        )
        lock_debt = copy_debt = 0.0
    return out


# ---------------------------------------------------------------------- goodput


def p99_at(
    workload: WorkloadConfig,
    rate: float,
    cal: Calibration,
    setup: Setup,
    seed: int = 0,
    gates: dict[int, DemotionGate] | None = None,
) -> dict[str, Any]:
    """One modelled point: the workload at `rate` (bench.goodput's point: 10 s and 400 calls at
    least, after its lead-in), its measured window's P99 and path shares. `gates`: each ranker
    process's demotion gate, carried from the points before (made at its first)."""
    cfg = dataclasses.replace(workload, rate_rps=rate, duration_s=max(10.0, 400 / rate))
    plan = generate(cfg)
    steps: list[tuple[float, float]] = []
    built: list[tuple[float, float, float, float]] = []
    decided: list[tuple[float, str]] = []
    copied: list[tuple[float, str]] = []
    served = [
        s
        for k, requests in enumerate(by_process(plan.requests, setup.processes))
        for s in simulate(
            requests,
            cal,
            setup,
            seed + 7919 * k,
            steps,
            built,
            decided,
            copied,
            None if gates is None else gates.setdefault(k, DemotionGate()),
        )
        if not s.request.lead_in
    ]
    # Over the whole replay, lead-in included: the harness reads the rankers' counters before
    # the replay starts and after it ends (harness.run_point).
    copy_counts = collections.Counter(label for _, label in copied)
    # The trigger's decisions on the window's events, as shares (its counters, relaygr_trigger_*).
    reasons = collections.Counter(label for t, label in decided if t >= cfg.lead_in_s)
    events = sum(reasons.values())
    built = [b for b in built if b[0] >= cfg.lead_in_s]
    preinfer_s = sum(seconds for start, seconds in steps if start >= cfg.lead_in_s)
    lat = np.array([s.latency_ms for s in served])
    paths = collections.Counter(s.path for s in served)
    return {
        "rate_rps": rate,
        "calls": len(served),
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "meets_slo": bool(np.percentile(lat, 99) <= setup.slo_ms),
        # A process's share of its device time, the mean over the processes.
        "busy": (sum(s.device_ms for s in served) / 1e3 + preinfer_s) / cfg.duration_s / setup.processes,
        **{k: v / len(served) for k, v in sorted(paths.items())},
        # As the rankers count them (relaygr_ranker_preinfer_*): the psi built in the window,
        # their mean wait to start and time to build, and those complete after their call's time.
        "preinfer_done": len(built),
        "preinfer_start_wait_ms_mean": float(np.mean([s - t for t, s, _, _ in built]) * 1e3)
        if built
        else None,
        "preinfer_build_ms_mean": float(np.mean([d - s for _, s, d, _ in built]) * 1e3) if built else None,
        "preinfer_done_after_call": sum(d > c for _, _, d, c in built),
        # The tiers' copies, as the ranker's point fields count them.
        **{
            label: copy_counts.get(label, 0)
            for label in (
                "demotions",
                "demotions_skipped",
                "demotions_never_reloaded",
                "reloads",
                "psi_from_rankings",
                "ranking_psi_declined",
            )
        },
        **{f"trigger_{label}": n / events for label, n in sorted(reasons.items())},
    }


def by_process(requests: Sequence[PlannedRequest], processes: int) -> list[list[PlannedRequest]]:
    """The requests each of `processes` ranker processes gets: a user's all go to the process
    of its highest rendezvous score (shared/placement.py, as the router places them while no
    process is over its load bound)."""
    if processes <= 1:
        return [list(requests)]
    ids = [f"process-{k}" for k in range(processes)]
    placed: dict[int, int] = {}
    out: list[list[PlannedRequest]] = [[] for _ in ids]
    for r in requests:
        k = placed.get(r.user_id)
        if k is None:
            k = placed[r.user_id] = max(range(processes), key=lambda i: stable_hash(r.user_id, ids[i]))
        out[k].append(r)
    return out


def processes_of(config: str) -> tuple[str, int]:
    """A configuration's model and its ranker processes per GPU: `relay-2p-mps` -> (relay, 2);
    `-expandable`, `-alloc-gc` and `-alloc-nosplit` (the allocator's settings) are the same model."""
    name = config.removesuffix("-expandable").removesuffix("-alloc-gc").removesuffix("-alloc-nosplit")
    match = re.fullmatch(r"(.+)-(\d+)p(-mps)?", name)
    return (match.group(1), int(match.group(2))) if match else (name, 1)


def goodput(
    workload: WorkloadConfig,
    cal: Calibration,
    setup: Setup,
    start_rps: float,
    growth: float = 1.3,
    precision: float = 0.05,
    cap_rps: float = 4096.0,
    seed: int = 0,
    search: SearchConfig | None = None,
) -> tuple[float, float, list[dict[str, Any]]]:
    """bench.goodput's search (relaygr.search) on the model, its grid the one rate `start_rps`:
    up by `growth` until a miss (down, when that misses), then bisection to `precision`. Returns
    the highest rate met (0: none), the lowest missed (inf: none up to `cap_rps`), every point.
    `search`: the run's own search instead (its grid, growth, precision), every point in its
    order with one demotion gate per ranker process carried through them, as the run's rankers
    carried theirs (its warm-up is not modelled)."""
    config = search or SearchConfig(
        grid=(start_rps,), precision=precision, growth=growth, cap_rps=max(cap_rps, start_rps)
    )
    gates: dict[int, DemotionGate] | None = {} if search is not None else None

    def measure(rate: float) -> Point:
        point = p99_at(workload, rate, cal, setup, seed, gates)
        return Point(rate, point["p99_ms"], point["meets_slo"], point)

    result = find_limit(measure, config)
    high = math.inf if result.first_miss_rps is None else result.first_miss_rps
    return result.goodput_rps, high, [point.record for _, point in result.points]


# ---------------------------------------------------------------------- the command


def run_search_config(result: dict[str, Any]) -> SearchConfig:
    """The search a goodput result file ran (its config's grid, growth, precision, cap, floor)."""
    c = result["config"]
    try:
        return SearchConfig(
            grid=tuple(float(r) for r in c["grid"]),
            precision=float(c["precision"]),
            growth=float(c["growth"]),
            cap_rps=float(c.get("cap_rps", 10_000.0)),
            floor_rps=float(c.get("floor_rps", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the file's search cannot be read: {exc}") from exc


def _workload(result: dict[str, Any], name: str) -> WorkloadConfig:
    c = result["config"]
    match = re.fullmatch(r"(mix|L(\d+))", name)
    if match is None:
        raise ValueError(f"workload {name!r}: L<prefix tokens> or mix")
    return WorkloadConfig(
        seed=int(c.get("seed", 0)),
        users=int(c.get("users", 100_000)),
        recent_tokens=int(c.get("recent", 64)),
        candidates=int(c.get("candidates", 256)),
        length_scale=float(c.get("length_scale", 16.0)),
        max_prefix_len=int(c.get("max_prefix_len", 16_384)),
        session_mean_requests=float(c.get("session_mean_requests", 3.0)),
        think_scale=float(c.get("think_scale", 0.1)),
        lead_in_s=float(c.get("lead_in_s", 10.0)),
        fixed_prefix_len=int(match.group(2)) if match.group(2) else None,
    )


# The configurations the model covers: no psi; rankings keep psi; and pre-inference of every
# request (no trigger: the policy `preinfer-all`, where no admission test stands in between).
MODELLED = ("baseline", "relay", "relay-nospare", "preinfer-all", "relay-nospare-far", "relay-nospare-target25",
            "baseline-gil005", "baseline-gil05", "relay-nospare-gil005", "relay-nospare-gil05",
            "relay-nospare-slack50", "relay-psi-chunk-graphs", "relay-eager-psi-chunks",
            "relay-demote-pressure", "relay-budget-by-kind", "no-expander", "relay-scores-aside",
            "relay-kernel-copies", "relay-engine-copies", "relay-host-fp8", "relay-spare-host",
            "relay-host-fp8-pressure", "relay-spare-device", "baseline-fused-norms", "relay-fused-norms",
            "baseline-torch-norms", "relay-torch-norms", "relay-psi-classes")  # fmt: skip
# The relay with pre-inference chunks that read psi replaying graphs (True) or run eagerly
# (False), whatever its file's step record says (k20's relay-psi-chunk-graphs predates the record).
PSI_CHUNK_VARIANTS = {"relay-psi-chunk-graphs": True, "relay-eager-psi-chunks": False}
# The relay with one ranker setting changed, modelled as the what-if of that setting (main's
# flags; one given on the command line wins): every psi leaving HBM copied (the harness's
# relay-demote-pressure, --demotion pressure), steps budgeted by their kind (--budget-by-kind),
# no DRAM tier (no-expander, --arena-gb 0).
RELAY_VARIANTS: dict[str, dict[str, float]] = {
    "relay-demote-pressure": {"demotion_earned": 0.0},
    "relay-budget-by-kind": {"budget_by_kind": 1.0},
    # No host tier (the harness's no-expander): nothing copied, nothing reloaded.
    "no-expander": {"arena_gb": 0.0},
    # A batch's scores out on a stream of their own; inputs and scores by kernels (--batch-copies).
    "relay-scores-aside": {"batch_copies": float(BATCH_COPIES.index("scores_aside"))},
    "relay-kernel-copies": {"batch_copies": float(BATCH_COPIES.index("kernel"))},
    "relay-engine-copies": {"batch_copies": float(BATCH_COPIES.index("engine"))},
    # psi in host DRAM as fp8 (--host-psi-format): half the bytes held and copied.
    "relay-host-fp8": {"host_bytes_scale": HOST_FP8_SCALE},
    "relay-host-fp8-pressure": {"host_bytes_scale": HOST_FP8_SCALE, "demotion_earned": 0.0},
    # The spare term bounded by the host too: a trigger setting, taken from the run's record of
    # its trigger (AdmissionPolicy.of_run), nothing else changed.
    "relay-spare-host": {},
    "relay-spare-device": {},
    # Each layer's norms fused or as torch's kernels (the ranker's --layer-kernels): kernels the
    # run's own calls measure; nothing the model plans changes.
    "relay-fused-norms": {},
    "relay-torch-norms": {},
    # psi blocks in size classes: the allocator's behaviour, which the model does not plan; the
    # run's own calls measure what it changes.
    "relay-psi-classes": {},
}
# relay-nospare with another latency target: the same model, calls due as its rankers had them.
# The -gil and -slack variants (the rankers' interpreter switch interval, timer slack) and
# baseline-fused-norms / -torch-norms: the same models, the host's time per batch and the
# device's per call as their files measured them.


def modelled_configs(result_path: Path) -> list[str]:
    """The configurations a goodput result file holds that the model covers as it stands, in the
    file's order (`relay` only where a record of it has the ranker's step costs: load_model
    refuses it otherwise); ValueError, one line, where the file cannot be read as one."""
    try:
        result = json.loads(result_path.read_text())
        held = [(r["config"], bool(r.get("ranker_step_costs"))) for r in result["results"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"cannot read {result_path} as a goodput result file: {exc}") from None
    usable = [
        c
        for c, steps in held
        if (m := processes_of(c)[0]) in MODELLED
        and ((m != "relay" and m not in PSI_CHUNK_VARIANTS and m not in RELAY_VARIANTS) or steps)
    ]
    return list(dict.fromkeys(usable))


def measured_trigger_shares(result: dict[str, Any], config: str, workload: str) -> list[dict[str, Any]]:
    """The trigger's decisions at each of the file's points of `config`, as shares of its events
    (its counters, `trigger_<reason>`; admissions by ground where the point has them), what the
    model's points report as `trigger_<label>`: [{"rate_rps", "trigger_<label>": share, ...}]."""
    out = []
    for r in result["results"]:
        if r["config"] != config or r["workload"] != workload:
            continue
        for p in r["points"]:
            counts = {
                k[len("trigger_") :]: float(v)
                for k, v in p.items()
                if k.startswith("trigger_") and "lag" not in k and isinstance(v, (int, float))
            }
            grounds = {k: v for k, v in counts.items() if k.startswith("admitted_")}
            if grounds:  # the admissions by ground replace their total
                counts.pop("admitted", None)
            else:
                counts = {k: v for k, v in counts.items() if not k.startswith("admitted_")}
            events = sum(counts.values())
            if events > 0:
                shares = {f"trigger_{k}": v / events for k, v in sorted(counts.items())}
                out.append({"rate_rps": float(p["rate_rps"]), **shares})
    return sorted(out, key=lambda row: row["rate_rps"])


def preinfer_ms_per_psi(result: dict[str, Any], config: str, workload: str) -> float | None:
    """The device time one psi's pre-inference cost in service, as the file measured it: the
    median over the configuration's points of their pre-inference device seconds over the psi
    they built (produced, less reloads); None where the file has none."""
    per_psi = []
    for r in result["results"]:
        if r["config"] != config or r["workload"] != workload:
            continue
        for p in r["points"]:
            built = float(p.get("psi_produced", 0.0)) - float(p.get("reloads", 0.0))
            if built > 0 and p.get("device_preinfer_s"):
                per_psi.append(float(p["device_preinfer_s"]) / built * 1e3)
    return float(np.median(per_psi)) if per_psi else None


def _signal_legs_ms(result: dict[str, Any], config: str) -> tuple[float | None, float]:
    """The medians over the configuration's points of the rankers' P90 of the trigger -> ranker
    leg (None: none measured) and of the trigger's mean retrieval event -> decision lag (0:
    none recorded; recorded since the nineteenth session)."""
    points = [p for r in result["results"] if r["config"] == config for p in r["points"]]
    trips = [t for t in (float(p.get("signal_trip_p90_ms", 0.0)) for p in points) if t > 0]
    lags = [
        float(p["trigger_event_lag_ms_sum"]) / float(p["trigger_event_lags"])
        for p in points
        if p.get("trigger_event_lags")
    ]
    return (float(np.median(trips)) if trips else None), (float(np.median(lags)) if lags else 0.0)


def trigger_view(result: dict[str, Any], config: str, workload: str, preinfer_ms: float) -> TriggerView:
    """The trigger's inputs to its lead test as the file measured them (TriggerView): the
    rankers' P90 signal trip (as the trigger takes it: its assumption before any report, at
    least its floor), its event lag, and `preinfer_ms`, the cost of a psi it prices each one
    ahead at."""
    trip, lag = _signal_legs_ms(result, config)
    return TriggerView(
        preinfer_ms, max(_TRIGGER_TRIP_MS if trip is None else trip, _TRIGGER_MIN_TRIP_MS), lag
    )


# services/trigger/service.py's signal trip before any report, and its floor.
_TRIGGER_TRIP_MS, _TRIGGER_MIN_TRIP_MS = 50.0, 5.0


def signal_trip_ms(result: dict[str, Any], config: str) -> float:
    """The signal's trip to the ranker as the file measured it: the median over the
    configuration's points of their P90 of the trigger -> ranker leg (the rankers report no other
    quantile), plus the median of their mean retrieval event -> trigger decision; 0 without
    either."""
    trip, lag = _signal_legs_ms(result, config)
    return (trip or 0.0) + lag


# The device loop's sections (services/ranker/loop_time.py) that run between one batch's launch
# and the next's, on the host: settling the batch before, issuing copies, planning.
_HOST_STEP_SECTIONS = ("settle", "copies", "plan")
_RANK_FAMILIES = ("cached", "full", "full_keep")  # full_keep: from k30 on (graphs.py)


def call_deadline_s(result: dict[str, Any], config: str, workload: str) -> float:
    """The deadline the file's rankers scheduled calls by, from their arrival: the client's
    10 s gRPC timeout, or sooner the rankers' latency target where it was set (recorded per
    search since 16bd40c's successor; before it, only the configuration relay-nospare-target25
    set one, 25 ms)."""
    grpc_s = Setup.call_deadline_s
    for r in result.get("results", []):
        if r.get("config") == config and r.get("workload") == workload and "ranker_latency_target_ms" in r:
            target_ms = float(r["ranker_latency_target_ms"])
            return min(grpc_s, target_ms / 1e3) if target_ms > 0 else grpc_s
    return 0.025 if config == "relay-nospare-target25" else grpc_s


def call_slo_s(result: dict[str, Any], config: str, workload: str) -> float:
    """The SLO the file's rankers held calls doomed past, from their arrival (`ranker_slo_ms`,
    recorded since the rankers' --slo-ms; 0 or absent: none, inf)."""
    for r in result.get("results", []):
        if r.get("config") == config and r.get("workload") == workload and "ranker_slo_ms" in r:
            slo_ms = float(r["ranker_slo_ms"])
            return slo_ms / 1e3 if slo_ms > 0 else math.inf
    return math.inf


def _full_replays(single_tokens: int, batch_tokens: int, graph_batch: int) -> Callable[[Sequence[int]], bool]:
    """The scheduler's full_replays as the ranker's captured full graphs answer it: one full
    ranking of at most `single_tokens`, or 2..`graph_batch` of them totalling at most
    `batch_tokens` (services/ranker/graphs.py warm_full_keys)."""

    limits = GraphLimits(
        max_full_tokens=max(single_tokens, batch_tokens),
        max_full_batch=graph_batch,
        full_batch_tokens=batch_tokens,
    ).validate()
    held = set(multi_full_keys(limits))

    def replays(tokens: Sequence[int]) -> bool:
        if len(tokens) == 1:
            return tokens[0] <= single_tokens
        return bucket_for(len(tokens), sum(tokens), max(tokens), limits, FULL) in held

    return replays


def full_batch_tokens(result: dict[str, Any], config: str, workload: str) -> int:
    """The most tokens a multi-sequence full graph of the file's ranker held
    (`ranker_step_costs.full_batch_tokens`); 0 where it recorded none (none captured)."""
    for r in result.get("results", []):
        if r.get("config") == config and r.get("workload") == workload:
            costs = r.get("ranker_step_costs") or {}
            return int(costs.get("full_batch_tokens", 0)) if costs.get("graph") else 0
    return 0


def graph_full_tokens(result: dict[str, Any], config: str, workload: str) -> int:
    """The longest full ranking the file's ranker replayed alone as a captured graph (its
    `ranker_step_costs.graph_tokens`: full rankings and pre-inference steps share the ladder); 0
    where it recorded none (a CPU run, or a file from before the record). The model batches
    full rankings by cost alone only then: on the GPU the scheduler batches a full ranking only
    into a shape a captured graph holds, and the ranker captures one-sequence shapes alone
    (services/ranker/graphs.py warm_full_keys). Modelled as batchable, the length mix's full
    rankings shared batches the ranker never formed: the baseline's limit modelled 677 req/s
    where an H200 met 337.5 (k11b; 426 with this)."""
    for r in result.get("results", []):
        if r.get("config") == config and r.get("workload") == workload:
            costs = r.get("ranker_step_costs") or {}
            return int(costs.get("graph_tokens", 0)) if costs.get("graph") else 0
    return 0


def host_step_s(result: dict[str, Any], config: str, workload: str, by: str = "wall") -> float:
    """The host's time per ranking batch between launches (settle, copies, plan), as the file's
    points measured it (loop_* seconds over the batches replayed or run eagerly in the same
    span), weighted by batches; 0 where the file has no loop sections (runs before 598c4dc).
    `by`: "wall" (the sections' wall time, waits for the interpreter lock included) or "cpu"
    (the device loop's thread CPU in them: its own work)."""
    per_batch, per_copy, copies_per_batch = _host_costs(result, config, workload, by)
    return per_batch + per_copy * copies_per_batch


def launch_own_share(result: dict[str, Any], config: str, workload: str) -> float | None:
    """The device loop's thread CPU in its launch section over that section's wall time, summed
    over the file's points (on an H200 0.69-0.73 at L4096 and on the mix, k25a-b; 0.76-0.94 at
    8192-16384 tokens, k18-k24); None where the points have no
    thread CPU figures for it."""
    cpu = wall = 0.0
    for r in result["results"]:
        if r["config"] != config or r["workload"] != workload:
            continue
        for p in r["points"]:
            if p.get("loop_launch_cpu_s") is not None and p.get("loop_launch_wall_s"):
                cpu += float(p["loop_launch_cpu_s"])
                wall += float(p["loop_launch_wall_s"])
    return min(1.0, cpu / wall) if wall > 0 else None


def host_costs(result: dict[str, Any], config: str, workload: str, by: str = "wall") -> tuple[float, float]:
    """host_step_s split in two: the host's time per ranking batch between launches less the
    copies' issue (settle, plan), and the loop's time per copy of psi issued (its `copies` section
    over the demotions and reloads of the same points: 0.34-0.46 ms on an H200, L4096 and L16384,
    k10c / k10d). Where the file counts no copies, they stay in the first (0 for the second)."""
    per_batch, per_copy, _ = _host_costs(result, config, workload, by)
    return per_batch, per_copy


def _host_costs(
    result: dict[str, Any], config: str, workload: str, by: str = "wall"
) -> tuple[float, float, float]:
    """(seconds per batch less the copies counted, seconds per copy, copies per batch), by the
    sections' wall time or thread CPU (`by`)."""
    seconds = batches = copy_s = copies = 0.0
    for r in result["results"]:
        if r["config"] != config or r["workload"] != workload:
            continue
        for p in r["points"]:
            n = sum(float(p.get(f"graph_{what}_{family}", 0.0))
                    for what in ("replays", "eager_batches") for family in _RANK_FAMILIES)  # fmt: skip
            spent = {section: p.get(f"loop_{section}_{by}_s") for section in _HOST_STEP_SECTIONS}
            if n <= 0 or any(v is None for v in spent.values()):
                continue
            issued = float(p.get("demotions", 0.0)) + float(p.get("reloads", 0.0))
            if issued > 0:  # the copies' section priced per copy, apart
                copy_s += float(spent.pop("copies") or 0.0)
                copies += issued
            seconds += sum(float(v or 0.0) for v in spent.values())
            batches += n
    if not batches:
        return 0.0, 0.0, 0.0
    return seconds / batches, (copy_s / copies if copies else 0.0), copies / batches


def demote_loop_cpu_ms(result: dict[str, Any], config: str, workload: str) -> float:
    """The event loop's CPU ms per copy of psi to host DRAM (`demote_loop_cpu_ms_mean`, weighted
    by the points' demotions), which the ranker's gate adds to the device loop's issue when it
    prices a copy (RelayCache.host_ms_per_demotion); 0 where the file did not measure it (before
    k21: the gate then priced the device loop's issue alone, as the model does for such files)."""
    ms = copies = 0.0
    for r in result["results"]:
        if r["config"] != config or r["workload"] != workload:
            continue
        for p in r["points"]:
            n = float(p.get("demotions", 0.0) or 0.0)
            if "demote_loop_cpu_ms_mean" in p and n > 0:
                ms += float(p["demote_loop_cpu_ms_mean"]) * n
                copies += n
    return ms / copies if copies else 0.0


def copy_seconds_per_byte(result: dict[str, Any], config: str, workload: str) -> tuple[float, float]:
    """The copy engines' seconds per byte of psi (demotions, reloads): the points' device time per
    copy (`demote_copy_ms_mean`, `reload_copy_ms_mean`, weighted by their copies) over a psi's
    bytes at the workload's fixed length (an H200: 9.75 ms for 512 MiB, k22). (0, 0) on the mix,
    whose points do not say how many bytes they copied, and where nothing was copied."""
    match = re.fullmatch(r"L(\d+)", workload)
    if match is None:
        return 0.0, 0.0
    nbytes = int(match.group(1)) * PSI_BYTES_PER_TOKEN
    rates = []
    for mean_field, count_field in (("demote_copy_ms_mean", "demotions"), ("reload_copy_ms_mean", "reloads")):
        ms = n = 0.0
        for r in result["results"]:
            if r["config"] != config or r["workload"] != workload:
                continue
            for p in r["points"]:
                count = float(p.get(count_field, 0.0) or 0.0)
                mean = float(p.get(mean_field, 0.0) or 0.0)
                if count > 0 and mean > 0:
                    ms += mean * count
                    n += count
        rates.append(ms / n / 1e3 / nbytes if n else 0.0)
    return rates[0], rates[1]


def ran_demotion_gate(result: dict[str, Any], config: str, workload: str) -> bool:
    """Whether the file's rankers copied psi to DRAM through the demotion gate (its points count
    the candidates it skipped, `demotions_skipped`, since the gate came in with k11)."""
    return any(
        "demotions_skipped" in p
        for r in result["results"]
        if r["config"] == config and r["workload"] == workload
        for p in r["points"]
    )


def ran_keep_gate(result: dict[str, Any], config: str, workload: str) -> bool:
    """Whether the file's rankers' keep gate turned full rankings away (their points count
    `ranking_psi_declined`): on the length mix it did (k18c on), at fixed lengths it never has."""
    return any(
        float(p.get("ranking_psi_declined", 0.0) or 0.0) > 0
        for r in result["results"]
        if r["config"] == config and r["workload"] == workload
        for p in r["points"]
    )


def keep_gate_figures(
    result: dict[str, Any], config: str, workload: str
) -> tuple[float | None, float | None]:
    """What the file's rankers' keep gates weighed at their points' ends, the median over the
    points that report it: (host ms a keep costs, reads per keep); None where none did (k25 on)."""
    costs, reuse = [], []
    for r in result["results"]:
        if r["config"] != config or r["workload"] != workload:
            continue
        for p in r["points"]:
            if p.get("keep_gate_host_ms_per_action") is not None:
                costs.append(float(p["keep_gate_host_ms_per_action"]))
            if p.get("keep_gate_returns_per_action") is not None:
                reuse.append(float(p["keep_gate_returns_per_action"]))
    return (statistics.median(costs) if costs else None, statistics.median(reuse) if reuse else None)


def ran_batch_copies(result: dict[str, Any], config: str, workload: str) -> str:
    """How the file's rankers' batches' copies ran (the ranker's --batch-copies, after any
    fallback), as its search records logged it (`ranker_step_costs.batch_copies`, since k24);
    "engine" for files before that, when it was every ranker's default."""
    for r in result["results"]:
        if r["config"] == config and r["workload"] == workload:
            copies = (r.get("ranker_step_costs") or {}).get("batch_copies")
            if copies in BATCH_COPIES:
                return str(copies)
    return "engine"


def ran_skip_unreloadable(result: dict[str, Any], config: str, workload: str) -> bool:
    """Whether the file's rankers left psi no reload would take back out of host DRAM
    (CostModel.may_reload): their points count such candidates (`demotions_never_reloaded`)."""
    return any(
        "demotions_never_reloaded" in p
        for r in result["results"]
        if r["config"] == config and r["workload"] == workload
        for p in r["points"]
    )


def event_loop_ms(result: dict[str, Any], config: str, workload: str) -> float:
    """The rankers' event loops' CPU ms per request they handle (Rank calls and PreInfer
    signals): what Setup.request_host_s charges each arrival under the interpreter lock. From
    the points' main-thread CPU (`cpu_main_thread_ranker_<i>`, relaygr.cpu_usage; recorded since
    the twenty-ninth session) over the replay's requests (the point's calls at its rate, lead-in
    included, plus the pre-inferences the trigger admitted meanwhile); the median over the
    points. 0 where the file has no such figure: the event loop as if it had a CPU of its own, as
    the checks before it."""
    figures = []
    lead_in_s = float(result["config"].get("lead_in_s", 10.0))
    for r in result["results"]:
        if r["config"] != config or r["workload"] != workload:
            continue
        for p in r["points"]:
            cores = [
                float(v) for k, v in p.items() if k.startswith("cpu_main_thread_ranker_") and v is not None
            ]
            rate = float(p.get("offered_rps", 0.0) or 0.0)
            if not cores or rate <= 0:
                continue
            replay_s = float(p.get("duration_s", 0.0) or 0.0) + lead_in_s
            signals_per_s = float(p.get("trigger_admitted", 0.0) or 0.0) / replay_s if replay_s > 0 else 0.0
            figures.append(sum(cores) / (rate + signals_per_s) * 1e3)
    return statistics.median(figures) if figures else 0.0


def request_host_ms(result: dict[str, Any], config: str, workload: str) -> float:
    """The ranker's host CPU ms per request as its Stats report it to the trigger (HostCost: the
    process's CPU less the device loop's waits, over the requests): the points' own record of it
    where they have one (`ranker_host_ms_per_request`, since the twenty-sixth session), else
    estimated from the file's points: the ranker's cores over the point less the share of the loop's wall time that its
    waiting sections (settle_wait, idle, fill_wait) spent on the CPU (the loop's counters span
    the point's lead-in too), over the point's calls; the median over the points, 0 where the
    file has no CPU figures. On k14c (H200, L4096, relay) it gives 3.0-3.1 ms at 200-250 req/s
    where the trigger's log said 2.98-3.17."""
    figures = []
    for r in result["results"]:
        if r["config"] != config or r["workload"] != workload:
            continue
        for p in r["points"]:
            if p.get("ranker_host_ms_per_request") is not None:  # as the rankers reported it
                figures.append(float(p["ranker_host_ms_per_request"]))
                continue
            cores, calls = p.get("cpu_cores_ranker_0"), float(p.get("calls", 0) or 0)
            duration = float(p.get("duration_s", 0.0) or 0.0)
            walls = [p.get(f"loop_{section}_wall_s") for section in LOOP_SECTIONS]
            if cores is None or calls <= 0 or duration <= 0 or any(w is None for w in walls):
                continue
            loop_wall = sum(float(w) for w in walls)
            waits = sum(float(p.get(f"loop_{section}_cpu_s", 0.0) or 0.0)
                        for section in ("settle_wait", "idle", "fill_wait"))  # fmt: skip
            waiting_cores = waits / loop_wall if loop_wall > 0 else 0.0
            figures.append(max(0.0, float(cores) - waiting_cores) * duration / calls * 1e3)
    return statistics.median(figures) if figures else 0.0


def measured_limit(result: dict[str, Any], config: str, workload: str) -> tuple[float, float]:
    """The highest rate met and the lowest missed among a file's points of one configuration."""
    met, missed = 0.0, math.inf
    for r in result["results"]:
        if r["config"] != config or r["workload"] != workload:
            continue
        for p in r["points"]:
            # The load generator's point, or a broken stack's: not the configuration's.
            if recorded_beyond_reach(p):
                continue
            if p["meets_slo"]:
                met = max(met, float(p["rate_rps"]))
            else:
                missed = min(missed, float(p["rate_rps"]))
    return met, missed


def search_start_rps(met: float, missed: float) -> float:
    """Where the model's search of a configuration starts: the file's highest rate met, else half
    its lowest missed, else (no point usable: each beyond the load generator's reach, or a
    broken stack's) 10 req/s, from where the search steps up as the benchmark's does."""
    if met > 0:
        return met
    return missed / 2 if math.isfinite(missed) else 10.0


def write_result(path: Path, machine: dict[str, Any], record: dict[str, Any]) -> None:
    """Adds `record` to the result file at `path` (EVALUATION.md's layout: machine, config,
    results), replacing one of the same configuration, workload, measured file and what-if."""
    doc: dict[str, Any] = {"machine": machine, "config": {"model": "relaygr.sim"}, "results": []}
    if path.exists():
        doc = json.loads(path.read_text())
    same = ("config", "workload", "measured_from", "what_if")
    doc["results"] = [r for r in doc["results"] if any(r.get(k) != record[k] for k in same)] + [record]
    path.write_text(json.dumps(doc, indent=1) + "\n")


@dataclasses.dataclass(frozen=True)
class Model:
    """One configuration's model: its source file, workload, calibration, ranker and traffic."""

    result: dict[str, Any]
    config: str
    workload: str
    cal: Calibration
    setup: Setup
    traffic: WorkloadConfig


def _modelled_ms_per_psi(steps: StepCosts, traffic: WorkloadConfig, config: SchedulerConfig) -> float:
    """The mean cost of building one psi the workload asks for, by these step costs, each
    prefix alone in the steps the scheduler plans for it (a graph step where one holds its first
    chunk, eager steps for the rest). Before 2026-11-29 (twenty-first session) each prefix was
    costed as one step, which at 16384 tokens (three planned steps, two of them eager) put the
    measured cost over the modelled at 2.2x and scaled every step by that."""
    return _mean_psi_ms(steps, _psi_lengths(traffic), config)


def _psi_lengths(traffic: WorkloadConfig) -> collections.Counter[int]:
    """The prefix lengths of the psi the workload asks for (sessions' first calls), counted."""
    plan = generate(dataclasses.replace(traffic, rate_rps=50.0, duration_s=10.0, lead_in_s=0.0))
    lengths = [r.prefix_len for r in plan.requests if r.session_index == 0] or [
        r.prefix_len for r in plan.requests
    ]
    return collections.Counter(lengths)


def _mean_psi_ms(steps: StepCosts, lengths: collections.Counter[int], config: SchedulerConfig) -> float:
    """The mean of `_psi_plan_ms` over `lengths` (0.0 without any)."""
    if not lengths:
        return 0.0
    scheduler = steps.plans(
        IterationScheduler(
            config,
            StepCosts.fit(steps.eager),
            first_costs=StepCosts.fit(steps.graph) if steps.graph is not None else None,
            graph_tokens=steps.graph_tokens if steps.graph is not None else 0,
            graph_batch=steps.graph_batch,
        )
    )
    total = sum(lengths.values())
    return sum(_psi_plan_ms(scheduler, steps, n) * count for n, count in lengths.items()) / total


def preinfer_scale_to(
    steps: StepCosts, traffic: WorkloadConfig, config: SchedulerConfig, measured_ms: float
) -> float | None:
    """The factor on every step cost at which a psi, in the steps the scheduler plans at those
    scaled costs, costs `measured_ms` on average (None where no psi is modelled). A scale taken
    from the start-up plan alone is no fixed point: dearer steps plan smaller chunks, so more of
    them. At 16384 tokens on an H200 (k20b, eager chunks) the start-up plan's 26 steps cost
    161.5 ms a psi against 23.3 measured; scaled by 0.145 the scheduler planned larger chunks in
    fewer steps, and the model's psi cost 7.5 ms, a third of the measured."""
    lengths = _psi_lengths(traffic)

    @functools.cache  # the bracket's ends are compared again at every bisection
    def at(scale: float) -> float:
        return _mean_psi_ms(steps.scaled(scale), lengths, config)

    start = at(1.0)
    if start <= 0 or measured_ms <= 0:
        return None
    # The cost grows with the scale (dearer steps, smaller chunks, more of them): bracket the
    # measured cost, then bisect on a log scale.
    lo = hi = measured_ms / start
    for _ in range(40):
        if at(lo) <= measured_ms:
            break
        lo /= 2
    for _ in range(40):
        if at(hi) >= measured_ms:
            break
        hi *= 2
    best = min((lo, hi), key=lambda s: abs(at(s) - measured_ms))
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        got = at(mid)
        if abs(got - measured_ms) < abs(at(best) - measured_ms):
            best = mid
        if abs(got / measured_ms - 1) < 1e-3 or hi / lo < 1 + 1e-6:
            break
        lo, hi = (mid, hi) if got < measured_ms else (lo, mid)
    return best


def _psi_plan_ms(scheduler: IterationScheduler, steps: StepCosts, prefix_len: int) -> float:
    """What building one psi of `prefix_len` tokens alone costs (ms) in the steps `scheduler`
    plans for it, each at `steps`' cost of its kind (graph or eager)."""
    done, total = 0, 0.0
    while done < prefix_len:
        size = scheduler.chunk_size(done, prefix_len - done, scheduler.step_budget_s(done))
        chunk = [Chunk(0, done, done + size)]
        total += steps.seconds(chunk, scheduler.step_graphed(chunk))
        done += size
    return total * 1e3


def load_model(
    result_path: Path,
    config: str,
    workload: str | None = None,
    changes: dict[str, float] | None = None,
    step_costs: StepCosts | None = None,
    trigger_settings: dict[str, Any] | None = None,
) -> Model:
    """The model of `config` calibrated on a goodput result file and its per-call records, with
    the what-if `changes` (keys as main's flags: hbm_budget_mb, arena_gb, lead_in_s,
    graph_full_tokens, cached_scale, full_scale, launch_scale, call_deadline_s, ranker_slo_ms,
    preinfer_scale, signal_trip_ms, psi_chunk_graphs, first_chunk_absorbs, budget_by_kind,
    demotion_earned);
    `step_costs`: the ranker's pre-inference steps (`relay`), instead of the file's record of
    them; `trigger_settings`: the trigger's admission settings (`relay`) that differ from the
    run's (AdmissionPolicy.of_run). ValueError, one line, on bad input."""
    changes = dict(changes or {})
    model, processes = processes_of(config)  # the model's name; the file's records are config's
    if "processes" in changes:
        if changes["processes"] < 1 or changes["processes"] != int(changes["processes"]):
            raise ValueError("--processes: a whole number >= 1")
        processes = int(changes["processes"])
    if model not in MODELLED:
        raise ValueError(
            f"--config: the model covers {', '.join(MODELLED)}, each also as <name>-<N>p[-mps][-expandable] or <name>-alloc-gc|nosplit"
        )
    psi_chunk_graphs = PSI_CHUNK_VARIANTS.get(model)
    if psi_chunk_graphs is not None:
        model = "relay"
    if model in RELAY_VARIANTS:
        changes = {**RELAY_VARIANTS[model], **changes}
        model = "relay"
    try:
        result = json.loads(result_path.read_text())
        workloads = sorted({r["workload"] for r in result["results"] if r["config"] == config})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read {result_path} as a goodput result file: {exc}") from None
    if not workloads:
        held = sorted({r["config"] for r in result["results"]})
        raise ValueError(
            f"{result_path.name} holds no records of {config} (it holds {', '.join(held) or 'none'})"
        )
    chosen = workload or (workloads[0] if len(workloads) == 1 else None)
    if chosen is None or chosen not in workloads:
        raise ValueError(f"--workload: one of {workloads} for {config} in {result_path}")
    files = calls_files(result_path, config, chosen)
    if not files:
        raise ValueError(f"no per-call records of {config} / {chosen} beside {result_path}")
    if any(v < 0 for v in changes.values()) or any(
        changes.get(k, 1.0) <= 0
        for k in ("cached_scale", "full_scale", "call_deadline_s", "preinfer_scale", "max_rank_delay_ms")
    ):
        raise ValueError("what-if sizes must be >= 0, cost scales and the call deadline > 0")
    # Device costs from every point; the waits outside the device loop from the points that met
    # the SLO (calibrate), where there are any.
    met = met_files(result, config, chosen, files)
    cal = scaled(
        calibrate(read_records(files), read_records(met) if met else None),
        changes.get("full_scale", 1.0),
        changes.get("cached_scale", 1.0),
    )
    if step_costs is None:
        recorded = [r for r in result["results"] if r["config"] == config and r["workload"] == chosen]
        step_costs = next((sc for sc in map(StepCosts.recorded, recorded) if sc is not None), None)
    if step_costs is not None and psi_chunk_graphs is not None:
        step_costs = dataclasses.replace(step_costs, graph_reads_psi=psi_chunk_graphs)
    if model == "relay" and step_costs is None:
        # The ranker plans pre-inference by its measured step costs (graph steps at ~0.5 ms a
        # step, eager ones at ~4 ms on an H200): modelled with a full ranking's fit instead, the
        # relay's limit at L8192 came out 1.1-1.3x higher again (k8a-h7b), so none is guessed.
        raise ValueError(
            f"relay: {result_path.name} records no ranker step costs (runs before 2026-11-29): "
            "python -m relaygr.sim takes them as --eager-step-costs / --graph-step-costs "
            "(the ranker's preinfer_*_calibrated log lines)"
        )
    traffic = _workload(result, chosen)
    run_scheduler = SchedulerConfig()  # the run's rankers' (the modelled configurations set none)
    scheduler = run_scheduler
    if "max_rank_delay_ms" in changes:  # the ranker's step budget (--max-rank-delay-ms)
        scheduler = dataclasses.replace(scheduler, max_rank_delay_s=changes["max_rank_delay_ms"] / 1e3)
    if changes.get("first_chunk_absorbs", 0.0):  # the ranker's --first-chunk-absorbs
        scheduler = dataclasses.replace(scheduler, first_chunk_absorbs=True)
    if changes.get("budget_by_kind", 0.0):  # the ranker's --step-budget-by-kind
        scheduler = dataclasses.replace(scheduler, budget_by_kind=True)
    preinfer_scale = changes.get("preinfer_scale")
    if model == "relay" and step_costs is not None and preinfer_scale is None:
        # Start-up costs scaled to what a psi cost in service (the file's points): at L8192 on an
        # H200 (k8b) 5.2 ms a psi at start-up, 6.4-7.2 in service (eager rests, batched eager
        # steps, graph steps beside copies), and the model's limit moved from 150 to ~105 req/s.
        # The scale is the run's (its steps as its rankers planned them): a what-if scheduler
        # then plans other steps at that scale, and a psi costs what those steps do.
        measured_ms = preinfer_ms_per_psi(result, config, chosen)
        if measured_ms is not None:
            preinfer_scale = preinfer_scale_to(step_costs, traffic, run_scheduler, measured_ms)
    if step_costs is not None and preinfer_scale is not None:
        step_costs = step_costs.scaled(preinfer_scale)
    if step_costs is not None and "psi_chunk_graphs" in changes:
        # What-if: the ranker's RELAYGR_RANKER_GRAPH_PSI_CHUNKS, its steps at the run's scale.
        step_costs = dataclasses.replace(step_costs, graph_reads_psi=bool(changes["psi_chunk_graphs"]))
    view = None
    if model == "relay" and step_costs is not None and changes.get("exact_lead_test", 0.0) == 0.0:
        measured_ms = preinfer_ms_per_psi(result, config, chosen)
        view = trigger_view(
            result, config, chosen,
            measured_ms if measured_ms is not None else _modelled_ms_per_psi(step_costs, traffic, scheduler),
        )  # fmt: skip
    # The host's time between launches: by default per batch as measured, the copies' issue at
    # the measured rate included. With `copies_apart` (what-ifs of the tiers), the copies are
    # priced per copy the model issues: its copies can differ from the run's (at L16384, k10d,
    # the ranker demoted ~18 psi a second where the model's LRU evicts fewer, and the split
    # alone moved the modelled limit 41 -> 46 req/s), so the checks keep the measured rate.
    # Where the event loop's lock time is charged apart (request_host_s), the device loop's host
    # work is its own thread CPU, not its sections' wall time, which holds its waits for the lock
    # (counted twice otherwise: k25b's baseline on the mix modelled 0.77 of measured); files
    # without thread CPU figures keep the wall time. --host-by-wall: the model before.
    request_host_s = float(changes.get("request_host_ms", event_loop_ms(result, config, chosen))) / 1e3
    keep_cost_ms, keep_reuse = keep_gate_figures(result, config, chosen)
    own_share = launch_own_share(result, config, chosen)
    by_cpu = request_host_s > 0 and own_share is not None and not changes.get("host_by_wall", 0.0)
    by = "cpu" if by_cpu else "wall"
    if changes.get("copies_apart", 0.0) and not model.startswith("baseline"):
        per_batch_s, per_copy_s = host_costs(result, config, chosen, by)
    else:
        per_batch_s, per_copy_s = host_step_s(result, config, chosen, by), 0.0
    admission = None
    if view is not None and changes.get("lead_test_only", 0.0) == 0.0:
        record = next(r for r in result["results"] if r["config"] == config and r["workload"] == chosen)
        admission = dataclasses.replace(AdmissionPolicy.of_run(record), **(trigger_settings or {}))
        view = dataclasses.replace(view, stats_interval_s=admission.stats_interval_s)  # its Stats polls
    elif trigger_settings:
        raise ValueError("--trigger-setting: the trigger's admission is modelled for relay only (not with "
                         "--lead-test-only or --exact-lead-test)")  # fmt: skip
    c = result["config"]
    setup = Setup(
        slo_ms=float(c["slo_ms"]),
        psi=not model.startswith("baseline"),
        preinfer_trip_ms=(
            float(changes.get("signal_trip_ms", signal_trip_ms(result, config)))
            if model in ("preinfer-all", "relay")
            else None
        ),
        preinfer_steps=step_costs if model == "relay" else None,
        lead_test=model == "relay",
        trigger=view,
        admission=admission,
        # The run's budget is the GPU's (bench.relay gives each process its share); the arena,
        # one per host, is shared alike.
        hbm_budget_bytes=int(float(changes.get("hbm_budget_mb", c.get("hbm_budget_mb", 60_000))) * 2**20)
        // processes,
        dram_bytes=int(float(changes.get("arena_gb", c.get("arena_gb", 24))) * 2**30) // processes,
        processes=processes,
        graph_full_tokens=int(changes.get("graph_full_tokens", graph_full_tokens(result, config, chosen))),
        full_batch_tokens=int(changes.get("full_batch_tokens", full_batch_tokens(result, config, chosen))),
        launch_scale=float(changes.get("launch_scale", 1.0)),
        launch_own_share=own_share if by_cpu and own_share is not None else 1.0,
        request_host_s=request_host_s,
        trigger_host_ms=float(changes.get("trigger_host_ms", request_host_ms(result, config, chosen))),
        host_step_s=per_batch_s,
        copy_issue_s=per_copy_s,
        demotion_gate=bool(changes.get("demotion_earned", ran_demotion_gate(result, config, chosen))),
        keep_gate=bool(changes.get("keep_gate", ran_keep_gate(result, config, chosen))),
        keep_cost_ms=keep_cost_ms,
        keep_reuse=keep_reuse,
        copy_cost_ms=(
            host_costs(result, config, chosen)[1] * 1e3 + demote_loop_cpu_ms(result, config, chosen)
        )
        or None,
    )
    setup = dataclasses.replace(
        setup,
        scheduler=scheduler,
        chunks_ahead=bool(changes.get("chunks_ahead", 0.0)),
        carried=not changes.get("cold_start", 0.0),
    )
    if changes.get("copy_engines", 1.0):
        demote_rate, reload_rate = copy_seconds_per_byte(result, config, chosen)
        setup = dataclasses.replace(
            setup,
            demote_s_per_byte=demote_rate,
            reload_s_per_byte=reload_rate,
            batch_copies=(
                BATCH_COPIES[int(changes["batch_copies"])]
                if "batch_copies" in changes
                else ran_batch_copies(result, config, chosen)
            ),
            kv_copies_on_engine=bool(changes.get("kv_copies_on_engine", 0.0)),
            skip_unreloadable=(
                bool(changes["skip_unreloadable"])
                if "skip_unreloadable" in changes
                else ran_skip_unreloadable(result, config, chosen)
            ),
        )
    setup = dataclasses.replace(setup, host_bytes_scale=float(changes.get("host_bytes_scale", 1.0)))
    deadline_s = changes.get("call_deadline_s", call_deadline_s(result, config, chosen))
    slo_s = call_slo_s(result, config, chosen)
    if "ranker_slo_ms" in changes:
        slo_s = changes["ranker_slo_ms"] / 1e3 if changes["ranker_slo_ms"] > 0 else math.inf
    setup = dataclasses.replace(setup, call_deadline_s=float(deadline_s), call_slo_s=slo_s)
    if "lead_in_s" in changes:
        traffic = dataclasses.replace(traffic, lead_in_s=float(changes["lead_in_s"]))
    return Model(result, config, chosen, cal, setup, traffic)


def parse_trigger_settings(items: Sequence[str]) -> dict[str, Any]:
    """`--trigger-setting NAME=VALUE` items as AdmissionPolicy fields of their types; ValueError,
    one line, for an unknown name or a value of the wrong kind."""
    types = {f.name: f.type for f in dataclasses.fields(AdmissionPolicy)}
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in types:
            raise ValueError(f"--trigger-setting {item!r}: NAME=VALUE, NAME one of {', '.join(types)}")
        kind = types[name]
        try:
            if kind in (bool, "bool"):
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(text)
                value: Any = text.lower() in ("true", "1")
            elif kind in (int, "int"):
                value = int(text)
            else:
                value = float(text)
        except ValueError:
            raise ValueError(f"--trigger-setting {item!r}: {text!r} is not a {kind}") from None
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and not (value >= 0 and math.isfinite(value))
        ):
            raise ValueError(f"--trigger-setting {item!r}: must be a finite number >= 0")
        out[name] = value
    return out


# What reuse and pre-inference could buy a workload were the device the only limit (--ceiling):
# psi tiers that never fill (1 PB of HBM), no host time (the launches and host steps, the event
# loop's share of each request, the trigger's host price), every full ranking keeping psi (no keep
# gate) and every psi leaving HBM copied (no demotion gate). The device's own costs stay the
# file's measured ones (batches, pre-inference steps, copies over the link), and so do the
# scheduler and the trigger's admission. On k27c (L4096, one H200) it put the relay at 482.4 req/s
# against the baseline's 259.4 (1.86x), on k27b (the mix) 576.2 against 518.0 (1.11x): targets
# above those need cheaper device work per call or more reuse, not a better policy. Optimistic
# where copies are many: on k28a (H100) the model put every psi copied at 1.4x its measured limit.
CEILING: dict[str, float] = {
    "hbm_budget_mb": 1e9,
    "launch_scale": 0.0,
    "request_host_ms": 0.0,
    "trigger_host_ms": 0.0,
    "keep_gate": 0.0,
    "demotion_earned": 0.0,
}


def session_what_if(mean_requests: float | None, think_scale: float | None) -> dict[str, float] | str:
    """The session model asked for on the command line as WorkloadConfig fields, or a one-line
    error (WorkloadConfig's own checks let NaN through)."""
    session: dict[str, float] = {}
    if mean_requests is not None:
        if not (math.isfinite(mean_requests) and mean_requests >= 1):
            return f"--session-mean-requests: a finite number >= 1, got {mean_requests}"
        session["session_mean_requests"] = mean_requests
    if think_scale is not None:
        if not (math.isfinite(think_scale) and think_scale > 0):
            return f"--think-scale: a finite number > 0, got {think_scale}"
        session["think_scale"] = think_scale
    return session


def with_session(model: Model, session: dict[str, float]) -> Model:
    """The model replaying users of another session model (WorkloadConfig's fields
    session_mean_requests, think_scale; those absent stay the run's), at the run's costs."""
    if not session:
        return model
    traffic = dataclasses.replace(
        model.traffic,
        session_mean_requests=session.get("session_mean_requests", model.traffic.session_mean_requests),
        think_scale=session.get("think_scale", model.traffic.think_scale),
    )
    return dataclasses.replace(model, traffic=traffic)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m relaygr.sim", description=__doc__.split("\n\n")[0])
    p.add_argument("result", type=Path, help="a bench.goodput result file, its calls/ directory beside it")
    p.add_argument("--config", required=True, help=f"one of {', '.join(MODELLED)} (what the model covers)")
    p.add_argument("--workload", default=None, help="L<n> or mix (default: the file's only one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1,
                   help="model seeds seed, seed+1, ...: the prediction is the median of their limits (its "
                   "draws of the measured costs put one seed's relay limit anywhere in 111-140 req/s for k9a, L8192)")  # fmt: skip
    what_if = p.add_argument_group(
        "what if (a prediction, not a check: the measured figures are not compared)"
    )
    what_if.add_argument("--hbm-budget-mb", type=float, default=None, help="instead of the file's")
    what_if.add_argument("--processes", type=int, default=None,
                         help="ranker processes per GPU instead of the configuration's (its name's -<N>p), "
                         "each at the file's measured costs, the budgets shared among them")  # fmt: skip
    what_if.add_argument("--lead-in-s", type=float, default=None, help="unmeasured lead-in per point")
    what_if.add_argument("--session-mean-requests", type=float, default=None,
                         help="requests per user session instead of the run's (geometric mean, >= 1): about "
                         "1 - 1/this of the calls come back to a psi that could be reused")  # fmt: skip
    what_if.add_argument("--think-scale", type=float, default=None,
                         help="think times between a session's requests: ML-100K's gaps x this instead of the run's")  # fmt: skip
    what_if.add_argument("--ceiling", action="store_true",
                         help="an upper bound at the file's device costs (CEILING): tiers that never fill, no host "
                         "time, every full ranking keeping psi and every psi leaving HBM copied; flags given "
                         "beside it win")  # fmt: skip
    what_if.add_argument(
        "--arena-gb", type=float, default=None, help="host DRAM for psi, instead of the file's"
    )
    what_if.add_argument(
        "--cached-scale", type=float, default=1.0, help="calls against psi cost this x measured"
    )
    what_if.add_argument("--graph-full-tokens", type=int, default=None,
                         help="full rankings of at most this many tokens replay batch-1 graphs and are never "
                         "batched (default: the file's ranker_step_costs.graph_tokens, 17408 on the GPU since "
                         "17182da; 0: batched by cost alone, as on the CPU)")  # fmt: skip
    what_if.add_argument("--full-batch-tokens", type=int, default=None,
                         help="full rankings also replay graphs of several sequences totalling at most this "
                         "many tokens (the ranker's RELAYGR_RANKER_GRAPH_FULL_BATCH_TOKENS; default: the "
                         "file's, 0 before it existed)")  # fmt: skip
    what_if.add_argument("--full-scale", type=float, default=1.0, help="full rankings cost this x measured")
    what_if.add_argument("--launch-scale", type=float, default=None,
                         help="the host's launch of a batch takes this x measured (default 1; 0: not modelled)")  # fmt: skip
    what_if.add_argument("--request-host-ms", type=float, default=None,
                         help="the event loop's work per request (Rank call or PreInfer) under the interpreter "
                         "lock the device loop shares, delaying its launches where the loop does not wait "
                         "for the device (default: the rankers' main-thread CPU per request in the file's "
                         "points, 0 where it has none; 0: not modelled)")  # fmt: skip
    what_if.add_argument("--trigger-host-ms", type=float, default=None,
                         help="what the trigger prices a request to the ranker's host at, where its admission "
                         "has host_cost on (default: estimated from the file's points; 0: device time alone)")  # fmt: skip
    what_if.add_argument("--call-deadline-s", type=float, default=None,
                         help="the deadline the ranker's scheduler orders calls by, from their arrival "
                         "(default: the benchmarks' 10 s gRPC timeout): how much its passing full "
                         "rankings over with calls against psi costs or gains")  # fmt: skip
    what_if.add_argument("--ranker-slo-ms", type=float, default=None,
                         help="the SLO the rankers hold calls doomed past (scheduler.doomed; 0: none; "
                         "default: the file's ranker_slo_ms, none before it was recorded)")  # fmt: skip
    what_if.add_argument("--eager-step-costs", default=None, metavar="MS,US,NS",
                         help="relay: the ranker's eager pre-inference step (per step ms, per token us, per "
                         "pair ns, as its preinfer_steps_calibrated log line), instead of the file's")  # fmt: skip
    what_if.add_argument("--graph-step-costs", default=None, metavar="MS,US,NS",
                         help="relay: its graph steps (preinfer_graph_steps_calibrated), with --eager-step-costs")  # fmt: skip
    what_if.add_argument("--preinfer-scale", type=float, default=None,
                         help="relay: pre-inference steps cost this x the ranker's start-up measurement "
                         "(default: scaled to what a psi cost in the file's points; 1: as at start-up)")  # fmt: skip
    what_if.add_argument("--signal-trip-ms", type=float, default=None,
                         help="preinfer-all / relay: a signal reaches the ranker this long after its retrieval "
                         "event (default: the file's, signal_trip_ms)")  # fmt: skip
    what_if.add_argument("--exact-lead-test", action="store_true",
                         help="relay: refuse a signal by the model's exact knowledge of the ranker's queue "
                         "instead of the trigger's own view of it (its last Stats report, its admissions "
                         "since, a psi priced at its measured cost)")  # fmt: skip
    what_if.add_argument("--lead-test-only", action="store_true",
                         help="relay: of the trigger's admission only its lead test (every signal that "
                         "passes it is pre-inferred; the model before its whole admission was modelled)")  # fmt: skip
    what_if.add_argument("--trigger-setting", action="append", default=[], metavar="NAME=VALUE",
                         help="relay: one of the trigger's admission settings instead of the run's (its "
                         f"recorded trigger_settings), e.g. spare_min_saving=0.1; names: {', '.join(ADMISSION_SETTINGS)}")  # fmt: skip
    what_if.add_argument("--max-rank-delay-ms", type=float, default=None,
                         help="the ranker's step budget (its --max-rank-delay-ms; default 5): longer "
                         "first chunks replay in one graph step")  # fmt: skip
    what_if.add_argument("--first-chunk-absorbs", action="store_true",
                         help="relay: the ranker's --first-chunk-absorbs (a first chunk a graph holds may "
                         "pass the step budget where that saves a step), its steps at the run's scale")  # fmt: skip
    what_if.add_argument("--demotion", choices=("earned", "pressure"), default=None,
                         help="psi leaving HBM is copied to DRAM while reloads pay for the copies (earned, "
                         "the ranker's demotion gate) or always (pressure), instead of as the run did (earned "
                         "where its points count demotions_skipped, since k11)")  # fmt: skip
    what_if.add_argument("--budget-by-kind", action="store_true",
                         help="relay: the ranker's --step-budget-by-kind (a step's budget counts the fixed "
                         "cost of the kind of step that runs), its steps at the run's scale")  # fmt: skip
    what_if.add_argument("--copies-apart", action="store_true",
                         help="price the host's issue of each psi copy (demotion, reload) per copy the model "
                         "issues instead of at the run's measured rate per batch: for what-ifs of the tiers "
                         "(--arena-gb 0: no DRAM tier, no copies)")  # fmt: skip
    what_if.add_argument("--copy-engines", choices=("on", "off"), default=None,
                         help="psi's copies hold the copy engines, and a ranking batch's own copy waits until "
                         "the engine is idle (on, where the file measured the copies' device time: "
                         "CopyEngine), or cost the host's issue alone (off: the model before k22)")  # fmt: skip
    what_if.add_argument("--batch-copies", choices=BATCH_COPIES, default=None,
                         help="with the copy engines: how ranking batches' and pre-inference steps' own "
                         "inputs and scores cross (the ranker's --batch-copies): engine (behind psi's "
                         "copies, the device waiting), scores_aside (scores behind them on their own "
                         "stream: the call waits, the device goes on), kernel (no copy engine); default: "
                         "as the file's rankers ran (its records' batch_copies; engine before k24)")  # fmt: skip
    what_if.add_argument("--keep-gate", choices=("on", "off"), default=None,
                         help="full rankings keep psi through the ranker's keep gate at the file's measured "
                         "cost and reuse (on), or every one of at least 512 tokens (off); default: as the "
                         "file's rankers ran (on where its points count ranking_psi_declined)")  # fmt: skip
    what_if.add_argument("--host-by-wall", action="store_true",
                         help="the device loop's launches and host steps at their measured wall time even "
                         "where the event loop's lock time is charged apart (the model before k25; "
                         "default there: their thread CPU, the wall time holding the waits for the lock)")  # fmt: skip
    what_if.add_argument("--skip-unreloadable", choices=("on", "off"), default=None,
                         help="with the copy engines: psi whose reload would never pay (the ranker's "
                         "CostModel.may_reload) is not copied to host DRAM (on), or offered to the gate "
                         "as any (off); default: as the file's rankers ran (on where its points count "
                         "demotions_never_reloaded)")  # fmt: skip
    what_if.add_argument("--host-psi-format", choices=("native", "fp8"), default=None,
                         help="how psi is held in host DRAM and copied (the ranker's --host-psi-format): "
                         "native, or fp8 (about half the bytes; its quantization's device time is not "
                         "modelled)")  # fmt: skip
    what_if.add_argument("--gate-history", action="store_true",
                         help="the run's own search (its grid, growth and precision) with one demotion gate "
                         "carried through its points, as the run's ranker carried its own, instead of a "
                         "search from the measured limit with a warm gate at each point")  # fmt: skip
    what_if.add_argument("--cold-start", action="store_true",
                         help="HBM and host DRAM start each modelled point empty (the model before k23), "
                         "instead of full of earlier points' psi as a search's stack has them")  # fmt: skip
    what_if.add_argument("--kv-copies-on-engine", action="store_true",
                         help="with the copy engines: a pre-inference graph step's K/V copy into the psi "
                         "blocks (a device memcpy) waits for the device -> host copies in progress, as where "
                         "a device memcpy ran on that engine (on an H200 it does not: bench.copy_contention "
                         "k23, kv_d2d)")  # fmt: skip
    what_if.add_argument("--chunks-ahead", action="store_true",
                         help="relay: the ranker's --chunks-ahead (pre-inference graph steps launched behind "
                         "the step on the device, the host going on meanwhile)")  # fmt: skip
    what_if.add_argument("--psi-chunk-graphs", choices=("on", "off"), default=None,
                         help="relay: pre-inference chunks that read psi replay graphs (on) or run eagerly "
                         "(off), the ranker's RELAYGR_RANKER_GRAPH_PSI_CHUNKS, instead of the run's (its "
                         "ranker_step_costs.graph_reads_psi, off before k20), its steps at the run's scale")  # fmt: skip
    what_if.add_argument("--graph-tokens", type=int, default=17_408,
                         help="relay: the most tokens a pre-inference graph holds (with --graph-step-costs)")  # fmt: skip
    p.add_argument("--json", type=Path, default=None,
                   help="add the comparison to this result file (bench/results/sim-<device>.json: "
                   "created, or its record of the same config, workload and source replaced)")  # fmt: skip
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds: at least 1")
    session = session_what_if(args.session_mean_requests, args.think_scale)
    if isinstance(session, str):
        p.error(session)
    changes = {k: v for k, v in (("hbm_budget_mb", args.hbm_budget_mb), ("arena_gb", args.arena_gb),
               ("lead_in_s", args.lead_in_s), ("graph_full_tokens", args.graph_full_tokens),
               ("full_batch_tokens", args.full_batch_tokens),
               ("cached_scale", args.cached_scale), ("full_scale", args.full_scale),
               ("launch_scale", args.launch_scale), ("call_deadline_s", args.call_deadline_s),
               ("ranker_slo_ms", args.ranker_slo_ms), ("preinfer_scale", args.preinfer_scale),
               ("signal_trip_ms", args.signal_trip_ms), ("max_rank_delay_ms", args.max_rank_delay_ms),
               ("exact_lead_test", 1.0 if args.exact_lead_test else None),
               ("lead_test_only", 1.0 if args.lead_test_only else None),
               ("first_chunk_absorbs", 1.0 if args.first_chunk_absorbs else None),
               ("budget_by_kind", 1.0 if args.budget_by_kind else None),
               ("demotion_earned", None if args.demotion is None else float(args.demotion == "earned")),
               ("chunks_ahead", 1.0 if args.chunks_ahead else None),
               ("psi_chunk_graphs", None if args.psi_chunk_graphs is None else float(args.psi_chunk_graphs == "on")),
               ("copies_apart", 1.0 if args.copies_apart else None),
               ("copy_engines", None if args.copy_engines is None else float(args.copy_engines == "on")),
               ("batch_copies", None if args.batch_copies is None else float(BATCH_COPIES.index(args.batch_copies))),
               ("kv_copies_on_engine", 1.0 if args.kv_copies_on_engine else None),
               ("host_by_wall", 1.0 if args.host_by_wall else None),
               ("keep_gate", None if args.keep_gate is None else float(args.keep_gate == "on")),
               ("skip_unreloadable", None if args.skip_unreloadable is None
                else float(args.skip_unreloadable == "on")),
               ("host_bytes_scale", None if args.host_psi_format is None
                else HOST_FP8_SCALE if args.host_psi_format == "fp8" else 1.0),
               ("cold_start", 1.0 if args.cold_start else None),
               ("request_host_ms", args.request_host_ms), ("trigger_host_ms", args.trigger_host_ms),
               ("processes", args.processes))
               if v is not None and not (k in ("cached_scale", "full_scale") and v == 1.0)}  # fmt: skip
    if changes.get("launch_scale") == 1.0 and not args.ceiling:
        del changes["launch_scale"]  # the default, as given (against the ceiling's 0, it is a change)
    if args.ceiling:
        changes = {**CEILING, **changes}
    try:
        if args.graph_step_costs and not args.eager_step_costs:
            raise ValueError("--graph-step-costs needs --eager-step-costs")
        step_costs = (
            StepCosts.parse(args.eager_step_costs, args.graph_step_costs, args.graph_tokens)
            if args.eager_step_costs
            else None
        )
        settings = parse_trigger_settings(args.trigger_setting)
        model = load_model(args.result, args.config, args.workload, changes, step_costs, settings)
    except ValueError as exc:
        p.error(str(exc))
    model = with_session(model, session)
    asked: dict[str, Any] = dict(changes) | session | {f"trigger_{k}": v for k, v in settings.items()}
    if args.eager_step_costs:  # the steps as given, not as the file recorded them
        asked["eager_step_costs"] = args.eager_step_costs
        asked["graph_step_costs"] = args.graph_step_costs
    result, workload, cal, setup, modelled = (
        model.result,
        model.workload,
        model.cal,
        model.setup,
        model.traffic,
    )
    met, missed = measured_limit(result, args.config, workload)
    start = search_start_rps(met, missed)
    run_search = run_search_config(result) if args.gate_history else None
    # One search per model seed; the median limit and that search's points (the lower median).
    searches = sorted(
        (
            goodput(modelled, cal, setup, start, seed=args.seed + i, search=run_search)
            for i in range(args.seeds)
        ),
        key=lambda found: found[0],
    )
    low, high, points = searches[(len(searches) - 1) // 2]
    summary = {
        "config": args.config,
        "workload": workload,
        "measured_from": args.result.name,
        # The file's points: the highest rate met and the lowest missed (a limit only where the
        # file bisected between them; fixed-rate points bracket it more coarsely).
        "measured_goodput_rps": met,
        "measured_first_miss_rps": None if math.isinf(missed) else missed,
        "predicted_goodput_rps": low,
        "predicted_over_measured": low / met if met > 0 and not asked else None,
        "what_if": asked,
        "predicted_first_miss_rps": None if math.isinf(high) else high,
        "predicted_goodput_rps_by_seed": [found[0] for found in searches],
        "calibration_batches": cal.batches,
        # The model's host launch (0: device only, as the checks before it) and the deadline its
        # scheduler orders calls by.
        "launch_scale": setup.launch_scale
        if (cal.full.launches or (cal.cached and cal.cached.launches))
        else 0.0,
        "call_deadline_s": setup.call_deadline_s,
        "call_slo_s": None if math.isinf(setup.call_slo_s) else setup.call_slo_s,
        "host_step_ms": setup.host_step_s * 1e3,
        # The share of each measured launch modelled as the device loop's own work (1: all of it).
        "launch_own_share": setup.launch_own_share,
        # The ranker's keep gate as modelled (False: every full ranking keeps psi), and its figures.
        "keep_gate": setup.keep_gate,
        "keep_cost_ms": setup.keep_cost_ms,
        "keep_reuse": setup.keep_reuse,
        "copy_issue_ms": setup.copy_issue_s * 1e3,
        # The event loop's CPU per request under the interpreter lock (0: not modelled).
        "request_host_ms": setup.request_host_s * 1e3,
        # What the modelled trigger priced a request to the ranker's host at (0: device time).
        "trigger_host_ms": setup.trigger_host_ms
        if setup.admission is not None and setup.admission.host_cost
        else 0.0,
        # relay: what building one psi costs in the model, and in the file's points.
        "preinfer_ms_per_psi_modelled": _modelled_ms_per_psi(setup.preinfer_steps, modelled, setup.scheduler)
        if setup.preinfer_steps is not None
        else None,
        "preinfer_ms_per_psi_measured": preinfer_ms_per_psi(result, args.config, workload),
        "points": points,
        # The trigger's decisions at the file's points, beside the modelled points' (relay).
        "measured_trigger": measured_trigger_shares(result, args.config, workload)
        if setup.admission is not None
        else [],
    }
    spread = (
        f" (seeds: {min(f[0] for f in searches):.1f}-{max(f[0] for f in searches):.1f})"
        if args.seeds > 1
        else ""
    )
    print(f"{args.config} {workload}: measured met {met:g}, missed {missed:g} req/s; "
          f"modelled goodput {low:.1f}{spread} (first miss {high:.1f}) req/s from {cal.batches} batches"
          + (f"; what if {asked}" if asked else ""))  # fmt: skip
    for pt in points:
        shares = " ".join(f"{k} {pt[k]:.2f}" for k in (*PSI_PATHS, "full_recompute") if k in pt)
        verdict = "meets " if pt["meets_slo"] else "misses"
        admitted = " ".join(
            f"{k[len('trigger_') :]} {pt[k]:.2f}"
            for k in sorted(pt)
            if k.startswith("trigger_") and pt[k] >= 0.005
        )
        print(
            f"  {pt['rate_rps']:8.1f} req/s  p99 {pt['p99_ms']:7.1f} ms  {verdict}  busy {pt['busy']:.2f}  {shares}"
            + (f"  | trigger: {admitted}" if admitted else "")
        )
    if summary["measured_trigger"]:
        print("  the trigger as measured (the file's points, shares of its events):")
        for row in summary["measured_trigger"]:
            shares = " ".join(
                f"{k[len('trigger_') :]} {v:.2f}"
                for k, v in row.items()
                if k.startswith("trigger_") and v >= 0.005
            )
            print(f"  {row['rate_rps']:8.1f} req/s  | trigger: {shares}")
    if args.json is not None:
        write_result(args.json, result.get("machine", {}), summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
