"""What `relaygr demo` and the benchmarks (bench/) share: the stack configurations, one replayed
point through a running stack (run_point), and the machine description and tables of the reports.

bench/ imports from here; relaygr never imports bench.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import os
import platform
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import torch

from kernels.device import accelerator, resolve_backend, visible_devices
from relaygr import cpu_usage
from relaygr.gpu_util import GpuUtilization, physical_index
from relaygr.launcher import RETRIEVAL_TOPIC, Stack
from relaygr.load import LoadGenerator
from relaygr.processes import ServiceProcess
from relaygr.replay import ReplayResult, replay
from relaygr.workload import Materializer, WorkloadConfig, generate
from services.ranker.copy_stages import RELOAD_PATH_STAGES
from services.ranker.copy_stages import STAGES as COPY_STAGES
from services.ranker.device_time import STEP_KINDS
from services.ranker.loop_time import SECTIONS as LOOP_SECTIONS
from shared.kafka import KafkaSettings, make_producer
from shared.protos import ranker_pb2 as pb
from shared.protos import ranker_pb2_grpc as pb_grpc

CONFIGS: dict[str, dict[str, Any]] = {
    # Plain full inference: no pre-inference, and full rankings keep no psi.
    "baseline": {
        "trigger_policy": "off",
        "expander": False,
        "ranker_args": ("--ranking-psi-min-tokens", "0"),
    },
    "preinfer-all": {"trigger_policy": "all"},
    "no-affinity": {"placement": "round_robin"},
    "no-expander": {"expander": False},
    "relay": {},
    # The trigger's spare term off (RELAYGR_TRIGGER_SPARE_BUSY_MAX 0): a first call is pre-inferred
    # only for risk or reuse, so at 4096 tokens on an H100 it is a full ranking keeping psi.
    "relay-nospare": {"trigger_args": ("--spare-busy-max", "0")},
    # Prefetch-only signals for returning users (RELAYGR_TRIGGER_PREFETCH, off by default).
    "relay-prefetch": {"trigger_args": ("--prefetch", "true")},
    # relay-nospare with prefetch-only signals: a returning user's psi held in DRAM is reloaded at
    # the retrieval event, 20-200 ms before the call, instead of by the call (which waited 12-15 ms
    # for it at p50 on an H200, h2e), and psi in HBM re-leased.
    "relay-nospare-prefetch": {"trigger_args": ("--spare-busy-max", "0", "--prefetch", "true")},
    # psi only from pre-inference (full rankings keep none): what the rankings' psi adds.
    "relay-preinfer-only": {"ranker_args": ("--ranking-psi-min-tokens", "0")},
    # Pre-inference in chunks of 512 tokens at most (the ranker's default is 4096).
    "relay-chunk512": {"ranker_args": ("--preinfer-chunk-tokens", "512")},
    # Calls against psi wait up to 4 ms for a batch to fill (the ranker's default is 1 ms): at
    # 4096 tokens on an H100 a hit alone costs ~2 ms of device time, each further one in its
    # batch ~0.4 (t1), and a relay at its limit runs ~60% of them alone.
    "relay-wait4": {"ranker_args": ("--max-wait-ms", "4")},
    # At most 2 pre-inferences queued or running per instance (the trigger's default is 32): less
    # pre-inference competing with full rankings for the device at high load.
    "relay-backlog2": {"trigger_args": ("--max-backlog", "2")},
    # The host-tier arena at 24 GiB whatever --arena-gb says: beside `relay` in one run, whether
    # pinning most of the host's memory (80 of 128 GiB on the H100 machines) stalls the host.
    "relay-arena24": {"arena_gb": 24.0},
    # The host-tier arena at 100 GiB: at L16384 on an H200 (k16e, 2026-11-30) HBM was full at
    # 33.75 req/s (115 GB, 512 MiB a user), the 48 GiB arena held ~96 users' psi, and the demotion
    # gate skipped 329 of 369 evictions (too few reloads to pay): whether a DRAM tier that holds
    # the working set moves the relay's limit. Beside `relay` on a two-GPU host (251 GiB).
    "relay-arena100": {"arena_gb": 100.0},
    # Every psi leaving HBM copied to DRAM (RELAYGR_RANKER_DEMOTION=pressure; the default, earned,
    # copies while reloads pay). The gate learns across a search's points: each point has its own
    # version range, so the LRU candidates at a point's start are the last point's dead psi; at
    # L16384 on an H200 (k20b) it copied 157 of them at 10 req/s and reloaded none, closed, and at
    # 42 req/s, where returns 7-17 s apart need DRAM, copied 160 of 447 (5 reloads). Since the
    # gate forgets by candidates it reopened there (k21b: a tie, both copying everything at
    # 35.86-42.19 req/s); at 22.5 and 33.75 req/s, gate closed, copying everything cost P99 +4.4 / +9.4 ms.
    "relay-demote-pressure": {"ranker_args": ("--demotion", "pressure")},
    # The ranker's GIL switch interval at 0.1 ms (default 0.05): how long the device thread waits
    # for the interpreter when it comes back from a CUDA wait while the event loop runs Python.
    "relay-gil01": {"ranker_args": ("--gil-switch-ms", "0.1")},
    # Pre-inference for risk admitted while it adds up to 50% device work over the full ranking it
    # replaces (the trigger's default is 15%): with launch-ahead a full ranking measures cheaper
    # (4.0-4.6 ms against 5.2-5.6 collected serially, H100, L4096) and the 15% rule then turned
    # away every first call at risk at 137.5 req/s (la2: half the calls ranked in full).
    "relay-extra50": {"trigger_args": ("--max-extra-work", "0.5")},
    # Every request priced at its device time plus the ranker's host time per request
    # (RELAYGR_TRIGGER_HOST_COST; the default since k12a, where it met >= 250 req/s at L4096 on
    # an H200 against 225 without), and the ablation: device time only.
    "relay-hostcost": {"trigger_args": ("--host-cost", "true")},
    "relay-devicecost": {"trigger_args": ("--host-cost", "false")},
    # Every full ranking of ranking_psi_min_tokens or more keeps psi (no keep gate: keep_gate.py).
    "relay-keepall": {"ranker_args": ("--ranking-psi-keep", "always")},
    # The spare term without its waits test (RELAYGR_TRIGGER_SPARE_PRICES_WAITS, on by default
    # since the twenty-sixth session): pre-inferences into "idle" device time whatever they make
    # other calls wait.
    "relay-spare-waits-unpriced": {"trigger_args": ("--spare-prices-waits", "false")},
    # The spare term only while the ranker's host has room too (RELAYGR_TRIGGER_SPARE_HOST_MAX):
    # on the H200's mix (k27b) the device was half idle, the host near one core, and spare
    # pre-inferences held the calls of the bursts that decided the points. 0.6 is the default
    # since k28b (an H100's mix: the same limit, P99 19.8 against 43.4 ms at 390.6 req/s), so
    # `relay-spare-host` names what `relay` runs, and `relay-spare-device` the term as before it
    # (the device's busy share alone decides): the A/B of the default.
    "relay-spare-host": {"trigger_args": ("--spare-host-max", "0.6")},
    "relay-spare-device": {"trigger_args": ("--spare-host-max", "0")},
    # A call that takes over a started pre-inference always completes it by the eager partial
    # pass (the default weighs it against the full graph, measured: services/ranker/takeover.py).
    "relay-takeover-partial": {"ranker_args": ("--takeover-pass", "partial")},
    # Pre-inference steps may last up to 10 ms beyond their fixed cost (the ranker's default is
    # 5): at 4096 tokens two queued first touches then share a step (a step of 4 cost 2.65 ms a
    # user on an H100 against 3.6 alone) for up to ~5 ms more wait of a ranking call behind it.
    "relay-delay10": {"ranker_args": ("--max-rank-delay-ms", "10")},
    # A first chunk that a graph holds may pass the step budget where that saves a step
    # (RELAYGR_RANKER_FIRST_CHUNK_ABSORBS, off by default): at 16384 tokens on an H200 a psi was
    # a graph step and two eager ones (23 ms in service, k10b), one of them 256 tokens.
    "relay-absorb": {"ranker_args": ("--first-chunk-absorbs", "true")},
    # A step's budget counts the fixed cost of the step that runs (RELAYGR_RANKER_STEP_BUDGET_BY_KIND,
    # off by default): at 16384 tokens on an H200 (k20b) graph steps sized by the eager fixed
    # cost lasted ~10.4 ms, holding the calls that came meanwhile.
    "relay-budget-by-kind": {"ranker_args": ("--step-budget-by-kind", "true")},
    # Pre-inference steps launched ahead too (RELAYGR_RANKER_CHUNKS_AHEAD, off by default): a
    # step's host launch overlaps the batch before it, and the next batch's overlaps the step.
    "relay-chunks-ahead": {"ranker_args": ("--chunks-ahead", "true")},
    # Pre-inference chunks that read psi run eagerly (RELAYGR_RANKER_GRAPH_PSI_CHUNKS off; on by
    # default since k20, where the chunk graphs, then the config `relay-psi-chunk-graphs`, raised
    # the relay's limit at 16384 tokens on an H200 from 33.75 to 37.97 req/s in one call).
    "relay-eager-psi-chunks": {"ranker_args": ("--graph-psi-chunks", "false")},
    # Each ranking batch collected before the next is launched (RELAYGR_RANKER_LAUNCH_AHEAD off):
    # beside `relay` in one sitting, what overlapping the host's work with the device's buys.
    "relay-serial": {"ranker_args": ("--launch-ahead", "false")},
    # The relay shedding its optional work (keeping psi from full rankings, copies to DRAM) while
    # its event loop runs over 2 ms behind (services/ranker/loop_lag.py; off by default until
    # measured): on the mix on an H200 (k17b, 587.5 req/s) the relay's calls waited 14.8 ms mean
    # before their handler against the baseline's 4.0, beside 1480 psi kept and 787 copies.
    # Measured (k18b, two processes per GPU): relay-shed-2p-mps met 587.5 where relay-2p-mps
    # met 734.4 in the same call: shedding stays off.
    "relay-shed": {"ranker_args": ("--shed-lag-ms", "2")},
    # psi moved to and from host DRAM in pieces of 8 MiB (RELAYGR_RANKER_COPY_PIECE_MB; one copy
    # each by default): beside relay-nospare, whether a ranking batch's copies wait behind whole
    # psi copies. On an H200 (L4096, h2d) the pieces doubled the device loop's time issuing
    # copies and did not shorten the batches against psi.
    "relay-nospare-pieces": {
        "trigger_args": ("--spare-busy-max", "0"),
        "ranker_args": ("--copy-piece-mb", "8"),
    },
    # psi copied to and from DRAM in pieces of 16 MiB (a whole psi is one copy by default): at
    # 16384 tokens on an H200 (k22a, k22b) a psi's copy took the copy engine 9.75 ms, and calls
    # against psi then took up to 9-11 ms of device time (20-29 ms behind two or three copies)
    # where a ranker without a host tier never took over 4.2: a batch's scores, copied out on the
    # compute stream, waited for the copy in progress. A piece of 16 MiB takes ~0.3 ms, but
    # bench.copy_contention (k23b) found a small copy waiting for the whole psi copy, in pieces or
    # not: not run since (relay-scores-aside, relay-kernel-copies are the way out).
    "relay-pieces16": {"ranker_args": ("--copy-piece-mb", "16")},
    # Both: every psi leaving HBM copied, in pieces. In k22a copying everything served 8.8% of the
    # returning users' calls from DRAM at 42 req/s (full rankings of returning users 2.5% against
    # 11.3% without a host tier) while the new users' calls, served by pre-inference, lost (full
    # rankings 20% against 10-11%): whether the pieces keep the gain and drop the loss.
    "relay-demote-pressure-pieces16": {"ranker_args": ("--demotion", "pressure", "--copy-piece-mb", "16")},
    # A replayed batch's scores copied aside on the device and to the host on a stream of their
    # own (RELAYGR_RANKER_BATCH_COPIES scores_aside): the other way out of k22's stall than
    # pieces. At 16384 tokens on an H200 it met 42.19 req/s against the relay's 35.86 and
    # no-expander's 46.41 (k23a-c, one lease, one GPU, three calls); the stalls left coincide with
    # reloads: a batch's inputs wait behind them (k23b copy-contention, 8.4-8.6 ms).
    "relay-scores-aside": {"ranker_args": ("--batch-copies", "scores_aside")},
    # Inputs and scores moved by kernels through device views of the page-locked buffers, no copy
    # engine (RELAYGR_RANKER_BATCH_COPIES kernel): beside any psi copy, 0.05-0.2 ms (k23b).
    # The default since k24 (the relay): at 16384 tokens on an H200 it met 42.19 req/s, as did
    # the relay with engine copies and no-expander in the same lease (k24a-c, one GPU, three
    # calls), with no call against psi over 5.1 ms of device time at 46.41 req/s (engine: 23
    # such calls, up to 19.4 ms). Kept so that the files' names stay runnable.
    "relay-kernel-copies": {"ranker_args": ("--batch-copies", "kernel")},
    # The relay with batches' copies on the ranking stream, the default before k24: the A/B of
    # the default.
    "relay-engine-copies": {"ranker_args": ("--batch-copies", "engine")},
    # psi stored in host DRAM as float8 e4m3 with per-group scales (RELAYGR_RANKER_HOST_PSI_FORMAT
    # fp8): half the bytes to copy each way and to hold; scores off by bench.psi_fp8's eps.
    "relay-host-fp8": {"ranker_args": ("--host-psi-format", "fp8")},
    # Every psi leaving HBM copied to host DRAM as fp8 (relay-demote-pressure with
    # relay-host-fp8): at L4096 on an H200 (k27c) the demotion gate copied 653 of ~4000
    # candidates a point (its yield 0.29 reloads a copy x ~2.4 ms saved against 0.72 ms of host
    # a copy: on the edge), 4% of calls were reloads; relaygr.sim put this at +26% goodput.
    # Measured on an H100 (k28a, L4096): 160 req/s against the relay's 225 in the same call:
    # reloads rose to 26-32% of calls, but quantizing ~230 psi a second on the device slowed
    # every batch and the expander's answers (goodput-nvidia-h100-80gb-hbm3-x1.md).
    "relay-host-fp8-pressure": {"ranker_args": ("--host-psi-format", "fp8", "--demotion", "pressure")},
    # Calls scheduled by the client's own gRPC deadline alone (RELAYGR_RANKER_LATENCY_TARGET_MS 0;
    # the stacks' rankers get half the SLO): beside relay-nospare, what the target buys. With
    # the benchmarks' 10 s deadline every call against psi passes over every full ranking.
    "relay-nospare-far": {
        "trigger_args": ("--spare-busy-max", "0"),
        "ranker_args": ("--latency-target-ms", "0"),
    },
    # The earlier name of relay-nospare with a 25 ms target (files h2b, h2f): now relay-nospare
    # at a 50 ms SLO.
    "relay-nospare-target25": {
        "trigger_args": ("--spare-busy-max", "0"),
        "ranker_args": ("--latency-target-ms", "25"),
    },
}
# The rankers' GIL switch interval at 0.05 ms, baseline and relay-nospare (the files of h3b;
# now the default) and at 0.5, the default before: every torch call of the device thread
# releases the interpreter and must take it back from the event loop. With a second thread
# running Python, issuing one timing event cost 1.3 ms of wall time at 0.5 ms and 0.49 ms at 0.1
# (0.15 alone), a full ranking's graph launch 12.1 and 3.6 ms (0.5 alone): bench.host_costs on
# an H200 (host-costs-nvidia-h200*.json). In service (h3b) 0.05 left the baseline's limit as it
# was (237.5 req/s, launch 1.1 ms a batch both); relay-nospare's launch took 1.37 ms a batch at
# 0.05 against 1.67 at 0.5 (h3a, another lease).
for _name in ("baseline", "relay-nospare"):
    for _suffix, _ms in (("gil005", "0.05"), ("gil05", "0.5")):
        CONFIGS[f"{_name}-{_suffix}"] = {
            **CONFIGS[_name],
            "ranker_args": (*CONFIGS[_name].get("ranker_args", ()), "--gil-switch-ms", _ms),
        }
# relay-nospare with the kernel's timer slack (50 us) instead of the rankers' 1 us: how late a
# thread's timed wait for the interpreter may end, on top of the switch interval.
CONFIGS["relay-nospare-slack50"] = {
    **CONFIGS["relay-nospare"],
    "ranker_args": ("--timer-slack-us", "0"),
}
# Rankers that know no SLO (--slo-ms 0): earliest deadline first whatever the load, work that
# will miss its SLO anyway included (the scheduler before 2026-11-29). Beside baseline and relay,
# what holding doomed work back buys.
for _name in ("baseline", "relay"):
    CONFIGS[f"{_name}-edf"] = {
        **CONFIGS[_name],
        "ranker_args": (*CONFIGS[_name].get("ranker_args", ()), "--slo-ms", "0"),
    }
# Two ranker processes per GPU (StackConfig.rankers_per_device), each with half the device's HBM
# budget; the router places users on them as on two GPUs. The host work of one GPU's calls runs
# under two interpreters: one process at ~240 calls/s on an H200 left calls waiting up to 59 ms
# before its handler ran them (h4b). The two processes' kernels share the GPU by time slices.
for _name in ("baseline", "relay", "relay-nospare", "relay-shed"):
    CONFIGS[f"{_name}-2p"] = {**CONFIGS[_name], "rankers_per_device": 2}
    # The same under an NVIDIA MPS daemon of the stack's own (relaygr/mps.py): the two processes'
    # kernels may run side by side. CUDA only.
    CONFIGS[f"{_name}-2p-mps"] = {**CONFIGS[_name], "rankers_per_device": 2, "mps": True}
# Four per GPU under MPS. On the mix (H200, k18b-d) each of two processes ran ~0.93 cores at the
# limit (event loop ~0.39, device thread ~0.47: one interpreter's worth) with the GPU half busy
# (nvidia-smi 0.5): the host bound both configurations there, and the relay's device savings
# bought nothing. Four interpreters a GPU move that bound, baseline and relay alike.
for _name in ("baseline", "relay"):
    CONFIGS[f"{_name}-4p-mps"] = {**CONFIGS[_name], "rankers_per_device": 4, "mps": True}
# The allocator's settings the ranker's configurations may run with (PYTORCH_CUDA_ALLOC_CONF), also
# what bench.psi_alloc replays the relay's psi churn under.
ALLOCATOR_CONFS = {
    "expandable": "expandable_segments:True",
    "alloc-gc": "garbage_collection_threshold:0.9",
    "alloc-nosplit": "max_split_size_mb:64",
}
# The plain and two-process configurations with PyTorch's expandable segments in the rankers: one
# segment that grows and shrinks instead of many that fragment. On the mix (H200, k17b) psi
# blocks of many sizes left two processes on one GPU reserving 67-69 GB each for 60.4-60.7 GB
# allocated, and the allocator retried (freeing its cache, a device sync) with 20-29 ms stalls
# of the event loop. Baseline and relay alike, so that each is compared with its own layout's.
for _name in ("baseline", "relay", "baseline-2p-mps", "relay-2p-mps"):
    CONFIGS[f"{_name}-expandable"] = {
        **CONFIGS[_name],
        "env": {**CONFIGS[_name].get("env", {}), "PYTORCH_CUDA_ALLOC_CONF": ALLOCATOR_CONFS["expandable"]},
    }
# The allocator freeing cached blocks it has not reused lately once 90% of the device is taken,
# before a block that fits nowhere makes it free all of them at once: on an H100's mix (k29b) one
# such retry (184 blocks freed) stalled a launch 37 ms and decided the relay's P99 at 312.5 req/s.
# -alloc-nosplit: blocks of 64 MiB and over never split, so a large psi's block serves only psi
# of about its size, and a retry frees just enough of them before it frees everything.
for _name in ("baseline", "relay"):
    for _setting in ("alloc-gc", "alloc-nosplit"):
        CONFIGS[f"{_name}-{_setting}"] = {
            **CONFIGS[_name],
            "env": {**CONFIGS[_name].get("env", {}), "PYTORCH_CUDA_ALLOC_CONF": ALLOCATOR_CONFS[_setting]},
        }
# psi blocks in size classes 1.125 apart (the ranker's --psi-size-classes; services/ranker/psi.py):
# a freed block fits later psi of its class, against the allocator's fragments (k29b's retry).
CONFIGS["relay-psi-classes"] = {
    **CONFIGS["relay"],
    "ranker_args": (*CONFIGS["relay"].get("ranker_args", ()), "--psi-size-classes", "1.125"),
}
# Full rankings of two sequences up to 2048 tokens in all batched into captured graphs
# (RELAYGR_RANKER_GRAPH_FULL_BATCH_TOKENS; off by default): on an H200's length mix (k26b)
# every full ranking ran alone, a third of them queued over 5 ms on a ranker bound by its host.
# Measured (k27a, one H200): baseline-full-batch 421.9 req/s, the baseline 421.9 in the same
# call (20-32% of calls paired); the capacity model had predicted +26%. relay-full-batch is not
# measured yet. Baseline and relay alike, each compared with its own.
for _name in ("baseline", "relay"):
    CONFIGS[f"{_name}-full-batch"] = {
        **CONFIGS[_name],
        "ranker_args": (*CONFIGS[_name].get("ranker_args", ()), "--graph-full-batch-tokens", "2048"),
    }
# The baseline with launch-ahead off, beside `baseline` in one sitting.
CONFIGS["baseline-serial"] = {
    **CONFIGS["baseline"],
    "ranker_args": (*CONFIGS["baseline"]["ranker_args"], "--launch-ahead", "false"),
}

# Each layer's norms fused with what is around them, two Triton kernels (kernels/fused_norms.py;
# the ranker's --layer-kernels, fused by default since k29), or torch's four (-torch-norms: the
# rankers before it), to compare in one sitting. The -fused-norms names are those of k29c's runs.
for _name in ("baseline", "relay"):
    for _kernels in ("fused", "torch"):
        CONFIGS[f"{_name}-{_kernels}-norms"] = {
            **CONFIGS[_name],
            "ranker_args": (*CONFIGS[_name].get("ranker_args", ()), "--layer-kernels", _kernels),
        }


def ranker_slo_ms(name: str, slo_ms: float) -> float:
    """The SLO configuration `name`'s rankers hold calls doomed past (ranker --slo-ms): its own
    where it sets one (0: none), else the stack's SLO (what the launcher passes)."""
    args = tuple(CONFIGS.get(name, {}).get("ranker_args", ()))
    if "--slo-ms" in args:
        return float(args[args.index("--slo-ms") + 1])
    return slo_ms


def ranker_latency_target_ms(name: str, slo_ms: float) -> float:
    """The latency target configuration `name`'s rankers schedule calls by: its own
    --latency-target-ms where it sets one, else half the SLO (what the launcher passes)."""
    args = tuple(CONFIGS.get(name, {}).get("ranker_args", ()))
    if "--latency-target-ms" in args:
        return float(args[args.index("--latency-target-ms") + 1])
    return slo_ms / 2


def stack_overrides(name: str, arena_gb: float | None = None) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Configuration `name`'s StackConfig settings, and its own trigger flags (to go after the
    caller's). A configuration that fixes its arena (`arena_gb`) wins over the run's `arena_gb`
    (None: the launcher's default)."""
    overrides = dict(CONFIGS[name])
    trigger_extra = tuple(overrides.pop("trigger_args", ()))
    gb = overrides.pop("arena_gb", arena_gb)
    if gb is not None:
        overrides["arena_bytes"] = int(float(gb) * 2**30) // 4096 * 4096
    return overrides, trigger_extra


@dataclasses.dataclass
class Point:
    sweep: str  # "length" or "rate"
    value: float  # prefix length or offered rate
    summary: dict[str, Any]
    rankers: dict[str, float]
    eps_max: float
    # The slowest served calls (1.5%, at least one), each with where its time went
    # (RequestRecord.breakdown): the calls that set the point's P99.
    slowest: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Every measured call the same way, in send order: arrivals, bursts and what each cost.
    calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.summary["meets_slo"])

    def record(self) -> dict[str, Any]:
        s = self.summary
        return {
            "sweep": self.sweep,
            "value": self.value,
            "meets_slo": self.ok,
            "p50_ms": s["p50_ms"],
            "p99_ms": s["p99_ms"],
            "p999_ms": s["p999_ms"],
            "eps_max": self.eps_max,
            **{k: v for k, v in s.items() if k not in ("p50_ms", "p99_ms", "p999_ms")},
            **self.rankers,
        }


async def ranker_stats(targets: list[str]) -> list[pb.StatsReply]:
    out = []
    for target in targets:
        async with grpc.aio.insecure_channel(target) as channel:
            out.append(await pb_grpc.RankerStub(channel).Stats(pb.StatsRequest(), timeout=5))
    return out


async def eps_against_full(router: Any, result: ReplayResult, materializer: Materializer) -> float:
    """max |served score - full-inference score| over the replay's scored sample."""
    worst = 0.0
    for record in result.sampled():
        planned = record.planned
        request = materializer.rank_request(planned)
        # A prefix version nobody pre-inferred forces full inference of the very same tokens.
        request.prefix_version = request.prefix.prefix_version = planned.prefix_version + 1_000_000_000
        request.request_id = f"{request.request_id}-full"
        reply = await router.Rank(request, timeout=120)
        if record.scores is not None and len(reply.scores) == len(record.scores):
            worst = max(worst, max(abs(a - b) for a, b in zip(reply.scores, record.scores, strict=True)))
    return worst


_DEVICE_SECONDS = 'relaygr_ranker_device_seconds_total{work="%s"}'


GRAPH_FAMILIES = ("cached", "full", "full_keep", "preinfer")


COPY_WORKS = ("reload", "demote")
# The ranker's yield gates (services/ranker/service.py's `gate` label), and the figures a point
# carries of each: what it weighed at the point's end (gauges: NaN while not yet measured).
GATES = ("demotion", "keep")
GATE_FIELDS = tuple(
    f"{gate}_gate_{what}" for gate in GATES for what in ("returns_per_action", "host_ms_per_action")
)

# The stage ledgers a ranker exports (services/ranker/copy_stages.py): (name in the results, the
# ledger's seconds and timed-count metrics, its work label, its stages).
_STAGE_LEDGERS: tuple[tuple[str, str, str, str, tuple[str, ...]], ...] = (
    *(
        (
            work,
            "relaygr_ranker_copy_stage_seconds_total",
            "relaygr_ranker_copies_timed_total",
            work,
            COPY_STAGES,
        )
        for work in COPY_WORKS
    ),
    (
        "reload_path",
        "relaygr_ranker_reload_path_seconds_total",
        "relaygr_ranker_reload_paths_timed_total",
        "call",
        RELOAD_PATH_STAGES,
    ),
)


def copy_stage_counters(samples: dict[str, float]) -> dict[str, float]:
    """psi copies' seconds by stage (`copy_<work>_<stage>_s`) and copies timed
    (`copies_timed_<work>`) in one ranker's scraped samples (services/ranker/copy_stages.py);
    a ranking call's reload path likewise, as work "reload_path"."""
    out: dict[str, float] = {}
    for name, seconds_metric, timed_metric, work, stages in _STAGE_LEDGERS:
        out[f"copies_timed_{name}"] = samples.get(f'{timed_metric}{{work="{work}"}}', 0.0)
        for stage in stages:
            out[f"copy_{name}_{stage}_s"] = samples.get(
                f'{seconds_metric}{{stage="{stage}",work="{work}"}}', 0.0
            )
    return out


def demote_loop_cpu_ms_mean(after: dict[str, float], before: dict[str, float]) -> float:
    """The event loop's CPU ms per copy of psi to host DRAM over an interval (its own steps:
    services/ranker/task_cpu.py), from two device_counters readings; 0 where none was metered."""
    runs = after.get("demotions_metered", 0.0) - before.get("demotions_metered", 0.0)
    seconds = after.get("demote_loop_cpu_s", 0.0) - before.get("demote_loop_cpu_s", 0.0)
    return seconds / runs * 1e3 if runs > 0 else 0.0


def copy_stage_means(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """`<work>_<stage>_ms_mean` over an interval, from two device_counters readings: the mean ms
    a psi copy of that kind spent in that stage (services/ranker/copy_stages.py), and
    `reload_path_<stage>_ms_mean` for a ranking call's reload; 0 where none was timed."""
    out: dict[str, float] = {}
    for name, _seconds, _timed, _work, stages in _STAGE_LEDGERS:
        n = after.get(f"copies_timed_{name}", 0.0) - before.get(f"copies_timed_{name}", 0.0)
        for stage in stages:
            key = f"copy_{name}_{stage}_s"
            seconds = after.get(key, 0.0) - before.get(key, 0.0)
            out[f"{name}_{stage}_ms_mean"] = seconds / n * 1e3 if n > 0 else 0.0
    return out


def ranker_step_costs(stack: Stack) -> dict[str, Any]:
    """The first ranker's pre-inference step costs as it measured them at start-up (its log):
    `eager` and, where first chunks replay CUDA graphs, `graph` ({per_step_ms, per_token_us,
    per_pair_ns}), with the graphs' `graph_tokens`, `graph_batch` and `graph_reads_psi` (later
    chunks replay graphs too; absent before 2026-11-30's k20), `batch_copies` (how batches'
    copies ran, after any fallback; absent before k24, when every ranker ran "engine" unless a
    config said otherwise) and `full_batch_tokens` (full rankings of several sequences given
    graphs; absent before k27); {} before they are logged. What the capacity model (relaygr.sim)
    plans and costs pre-inference steps and batches' copies by."""
    if not stack.rankers:
        return {}
    out: dict[str, Any] = {}
    for record in stack.rankers[0].records():
        event = record.get("event")
        if event not in ("preinfer_steps_calibrated", "preinfer_graph_steps_calibrated"):
            continue
        costs = {k: record.get(k) for k in ("per_step_ms", "per_token_us", "per_pair_ns")}
        if event == "preinfer_steps_calibrated":
            out["eager"] = costs
        else:
            out["graph"] = costs
            out.update(
                {
                    k: record[k]
                    for k in (
                        "graph_tokens",
                        "graph_batch",
                        "graph_reads_psi",
                        "batch_copies",
                        "full_batch_tokens",
                    )
                    if k in record
                }
            )
    return out


def trigger_settings(stack: Stack) -> dict[str, Any]:
    """The settings the stack's trigger admits by, as its start-up line gave them (`admission`);
    {} without a trigger or before that line existed. What the capacity model (relaygr.sim)
    models the run's trigger by."""
    if stack.trigger is None:
        return {}
    for record in stack.trigger.records():
        if record.get("event") == "trigger_ready":
            return dict(record.get("admission") or {})
    return {}


async def device_counters(stack: Stack) -> dict[str, float]:
    """The rankers' device-time counters (services/ranker/device_time.py), summed over rankers."""
    totals: dict[str, float] = collections.defaultdict(float)
    for port in stack.ranker_metrics_ports:
        samples = await asyncio.to_thread(scrape_metrics, port)
        totals["rank"] += samples.get(_DEVICE_SECONDS % "rank", 0.0)
        totals["preinfer"] += samples.get(_DEVICE_SECONDS % "preinfer", 0.0)
        totals["copy"] += sum(samples.get(_DEVICE_SECONDS % w, 0.0) for w in ("copy", "reload", "demote"))
        totals["busy"] += samples.get("relaygr_ranker_device_busy_seconds_total", 0.0)
        totals["unused_psi"] += samples.get("relaygr_ranker_unused_psi_device_seconds_total", 0.0)
        # Device idle between ranking batches, and the part of it with a call waiting (host-bound).
        totals["gap"] += samples.get("relaygr_ranker_device_gap_seconds_total", 0.0)
        totals["starved"] += samples.get("relaygr_ranker_device_starved_seconds_total", 0.0)
        totals["starved_gaps"] += samples.get("relaygr_ranker_device_starved_gaps_over_1ms_total", 0.0)
        totals["fill_wait"] += samples.get("relaygr_ranker_device_fill_wait_seconds_total", 0.0)
        # The device loop's own time by section, wall and thread CPU (services/ranker/loop_time.py).
        for section in LOOP_SECTIONS:
            for clock in ("wall", "cpu"):
                name = f'relaygr_ranker_engine_loop_seconds_total{{clock="{clock}",section="{section}"}}'
                totals[f"loop_{section}_{clock}_s"] += samples.get(name, 0.0)
        # psi copies' time by stage, and how many were timed (services/ranker/copy_stages.py).
        for key, value in copy_stage_counters(samples).items():
            totals[key] += value
        totals["alloc_retries"] += samples.get("relaygr_ranker_allocator_retries_total", 0.0)
        # The event loop's own CPU copying psi to host DRAM (services/ranker/task_cpu.py).
        totals["demote_loop_cpu_s"] += samples.get("relaygr_ranker_demotion_loop_cpu_seconds_total", 0.0)
        totals["demotions_metered"] += samples.get("relaygr_ranker_demotions_metered_total", 0.0)
        totals["device_mallocs"] += samples.get("relaygr_ranker_device_mallocs_total", 0.0)
        totals["device_frees"] += samples.get("relaygr_ranker_device_frees_total", 0.0)
        # A gauge: the host's CPU ms per request as the ranker last reported it (summed here,
        # averaged over the rankers by the point; NaN before any report).
        totals["host_ms_per_request"] += samples.get("relaygr_ranker_host_ms_per_request", math.nan)
        # Gauges too: what each gate weighs at the reading, its returns per action and the host
        # ms it prices an action at (services/ranker/yield_gate.py; NaN while not yet measured).
        for field in GATE_FIELDS:
            gate, what = field.split("_gate_")
            totals[field] += samples.get(f'relaygr_ranker_gate_{what}{{gate="{gate}"}}', math.nan)
        # And the device time a keep costs per prefix token, as the ranking batches tell it.
        totals["keep_device_us_per_token"] += samples.get("relaygr_ranker_keep_device_us_per_token", math.nan)
        # Collector pauses (every thread of the ranker stops): total seconds, and pauses > 20 ms.
        for generation in ("0", "1", "2"):
            label = f'generation="{generation}"'
            totals["gc_pause_s"] += samples.get(f"relaygr_gc_pause_seconds_sum{{{label}}}", 0.0)
            totals["gc_pauses_over_20ms"] += _observed_over(
                samples, "relaygr_gc_pause_seconds", "0.02", label
            )
        totals["preinfers_expired"] += samples.get("relaygr_ranker_preinfers_expired_total", 0.0)
        totals["late_signals"] += samples.get("relaygr_ranker_late_signals_total", 0.0)
        # The signal path's trips (trigger -> the ranker's PreInfer), and those over 50 ms: a
        # pre-inference signalled late starts late whatever the ranker does.
        totals["signal_trips"] += samples.get("relaygr_ranker_signal_trip_ms_count", 0.0)
        totals["signal_trips_over_50ms"] += _observed_over(samples, "relaygr_ranker_signal_trip_ms", "50.0")
        for result in ("found", "absent", "absent_local", "no_hbm_room"):  # HBM misses asked of the host tier
            totals[f"host_lookup_{result}"] += samples.get(
                f'relaygr_ranker_host_lookups_total{{result="{result}"}}', 0.0
            )
        # Candidates for host DRAM the demotion gate did not copy (services/ranker/demotion_gate.py).
        totals["demotions_skipped"] += samples.get('relaygr_ranker_demotions_total{result="skipped"}', 0.0)
        # Sections of the device loop's host work that ran past its watch (services/ranker/loop_watch.py).
        totals["device_loop_slow"] += sum(
            v for k, v in samples.items() if k.startswith("relaygr_ranker_device_loop_slow_total")
        )
        # Candidates not copied because no reload would take them back (CostModel.may_reload).
        totals["demotions_never_reloaded"] += samples.get(
            'relaygr_ranker_demotions_total{result="never_reloaded"}', 0.0
        )
        # Full rankings the keep gate let go without keeping psi (services/ranker/keep_gate.py).
        totals["ranking_psi_declined"] += samples.get("relaygr_ranker_ranking_psi_declined_total", 0.0)
        totals["ranking_psi_probed"] += samples.get("relaygr_ranker_ranking_psi_probed_total", 0.0)
        # What the relay shed while the event loop was behind (services/ranker/loop_lag.py).
        totals["ranking_psi_shed"] += samples.get("relaygr_ranker_ranking_psi_shed_total", 0.0)
        totals["demotions_shed"] += samples.get('relaygr_ranker_demotions_total{result="shed"}', 0.0)
        # Allocations the device refused that the psi budget allowed (each lowers the budget).
        totals["device_memory_short"] += sum(
            v for k, v in samples.items() if k.startswith("relaygr_ranker_device_memory_short_total")
        )
        # Take-overs of started pre-inferences, by the pass that completed them (takeover.py).
        for name in ("partial", "full"):
            totals[f"takeover_passes_{name}"] += samples.get(
                f'relaygr_ranker_takeover_passes_total{{pass="{name}"}}', 0.0
            )
        for reason in ("cheaper", "copy_engine_under_load", "recompute_cheaper"):
            name = f'relaygr_ranker_reload_decisions_total{{decision="{reason}"}}'
            totals[f"reload_decision_{reason}"] += samples.get(name, 0.0)
        for kind in STEP_KINDS:  # pre-inference steps by graph replay or eager (device_time.py)
            label = f'{{kind="{kind}"}}'
            for what, metric in (("steps", "steps"), ("seconds", "step_seconds"),
                                 ("prefixes", "step_prefixes"), ("over_10ms", "steps_over_10ms"),
                                 ("held_calls", "held_calls"), ("held_s", "held_call_seconds")):  # fmt: skip
                totals[f"preinfer_{kind}_{what}"] += samples.get(
                    f"relaygr_ranker_preinfer_{metric}_total{label}", 0.0
                )
        for key, metric in (("preinfer_started", "preinfers_started"), ("preinfer_start_wait_s", "preinfer_start_wait_seconds"),
                            ("preinfer_started_over_50ms", "preinfers_started_over_50ms"),
                            ("preinfer_started_joined", "preinfers_started_joined"),
                            ("preinfer_done", "preinfers_done"), ("preinfer_build_s", "preinfer_build_seconds"),
                            ("preinfer_done_s", "preinfer_done_seconds"),
                            ("preinfer_done_after_call", "preinfers_done_after_call"),
                            ("preinfer_builds_over_50ms", "preinfer_builds_over_50ms")):  # fmt: skip
            totals[key] += samples.get(f"relaygr_ranker_{metric}_total", 0.0)
        for family in GRAPH_FAMILIES:  # CUDA graphs: batches replayed and run eagerly, by family
            for what in ("replays", "eager_batches"):
                name = f'relaygr_ranker_graph_{what}_total{{family="{family}"}}'
                totals[f"graph_{what}_{family}"] += samples.get(name, 0.0)
    return dict(totals)


async def expander_counters(stack: Stack) -> dict[str, float]:
    """The expander's arena bytes in use and entries evicted for room so far; {} without one."""
    if stack.expander is None:
        return {}
    port = stack.expander.wait_event("expander_ready").get("metrics_port")
    if not port:
        return {}
    samples = await asyncio.to_thread(scrape_metrics, int(port))
    return {
        "used_bytes": samples.get('relaygr_expander_bytes{kind="used"}', 0.0),
        "evictions": samples.get("relaygr_expander_evictions_total", 0.0),
    }


async def scrape_signal_path(port: int, service: str) -> dict[str, float]:
    """The trigger's or the router's /metrics; {} (said once per call) when it does not answer:
    such a service is behind, and the next broker renewal restarts it (Stack.renew_broker). A
    frozen trigger's scrape timing out had ended a whole benchmark run (build machine, SIGSTOP)."""
    try:
        return await asyncio.to_thread(scrape_metrics, port, timeout_s=2.0)
    except OSError as exc:
        print(
            f"relaygr: the {service}'s metrics (port {port}) did not answer: {exc!r}",
            file=sys.stderr,
            flush=True,
        )
        return {}


_TRIGGER_COUNTER = re.compile(r'relaygr_trigger_(decisions|admitted)_total\{(?:reason|ground)="(\w+)"\}')


async def trigger_counters(stack: Stack) -> dict[str, float]:
    """The trigger's decisions so far by reason (`trigger_<reason>`) and its admissions by ground
    (`trigger_admitted_risk`, `trigger_admitted_reuse`, `trigger_admitted_spare`); {} for a stack
    without a trigger."""
    if stack.trigger is None:
        return {}
    port = int(stack.trigger.wait_event("trigger_ready")["metrics_port"])
    out: dict[str, float] = {}
    samples = await scrape_signal_path(port, "trigger")
    for key, value in samples.items():
        match = _TRIGGER_COUNTER.fullmatch(key)
        if match:
            family, label = match.groups()
            out[f"trigger_{label}" if family == "decisions" else f"trigger_admitted_{label}"] = value
    # A retrieval event's time until the trigger decided on it (the signal path's first leg).
    lag = "relaygr_trigger_event_lag_ms"
    out["trigger_event_lags"] = samples.get(f"{lag}_count", 0.0)
    out["trigger_event_lag_ms_sum"] = samples.get(f"{lag}_sum", 0.0)
    out["trigger_event_lags_over_20ms"] = _observed_over(samples, lag, "20.0")
    return out


def _observed_over(samples: dict[str, float], histogram: str, le: str, labels: str = "") -> float:
    """Observations of a Prometheus histogram above its bucket `le`, from scraped samples."""
    count = samples.get(f"{histogram}_count{{{labels}}}" if labels else f"{histogram}_count", 0.0)
    bucket = f'{histogram}_bucket{{{labels + "," if labels else ""}le="{le}"}}'
    return count - samples.get(bucket, 0.0)


def _metrics_port(proc: ServiceProcess | None, ready_event: str) -> int | None:
    """The metrics port a service announced in its ready line (None without the service)."""
    port = proc.wait_event(ready_event).get("metrics_port") if proc is not None else None
    return int(port) if port else None


async def stall_counters(stack: Stack) -> dict[str, float]:
    """Per service kind (ranker, summed over rankers; router; trigger; expander): how many times
    its stall watch (shared.metrics.HostStalls) woke more than 20 ms late so far, and how many
    times its event loop ran a timer more than 20 ms late."""
    ports: list[tuple[str, int | None]] = [("ranker", p) for p in stack.ranker_metrics_ports]
    ports += [("router", _metrics_port(stack.router, "router_ready")),
              ("trigger", _metrics_port(stack.trigger, "trigger_ready")),
              ("expander", _metrics_port(stack.expander, "expander_ready"))]  # fmt: skip
    out: dict[str, float] = collections.defaultdict(float)
    for kind, port in ports:
        if port is not None:
            if kind in ("trigger", "router"):
                samples = await scrape_signal_path(port, kind)
            else:
                samples = await asyncio.to_thread(scrape_metrics, port)
            out[f"host_stalls_over_20ms_{kind}"] += _observed_over(
                samples, "relaygr_host_stall_seconds", "0.02"
            )
            out[f"loop_stalls_over_20ms_{kind}"] += _observed_over(
                samples, "relaygr_event_loop_lag_seconds", "0.02"
            )
    return dict(out)


async def signal_path_total(stack: Stack) -> float:
    """Events the trigger has decided on plus signals the router has handled, so far: while the
    load generator is quiet, a total that still moves is a backlog draining on the signal path."""
    total = sum(
        v
        for k, v in (await trigger_counters(stack)).items()
        if not k.startswith(("trigger_admitted_", "trigger_event_lag"))
    )
    port = _metrics_port(stack.router, "router_ready")
    if port is not None:
        samples = await scrape_signal_path(port, "router")
        total += sum(v for k, v in samples.items() if k.startswith("relaygr_router_signals_total{"))
    return total


async def drain(stack: Stack, timeout_s: float = 60.0, quiet_s: float = 1.0) -> float:
    """Waits, with no load offered, until the stack holds no work from the point before: every
    ranker's ranking queue and pre-inference backlog empty, and the signal path (trigger
    decisions, router signals) still for `quiet_s`. Returns the seconds waited (`timeout_s` when
    it never settled). Without it a point after an overload inherits the overload's backlog (an
    H100 search at L4096 went on serving 8-23% from psi at rates where it had served 77-96%)."""
    started = time.perf_counter()
    last, still_since = await signal_path_total(stack), time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        await asyncio.sleep(0.2)
        stats = await ranker_stats(stack.ranker_targets)
        total = await signal_path_total(stack)
        now = time.perf_counter()
        if total != last:
            last, still_since = total, now
        busy = any(s.rank_queue_depth or s.preinfer_backlog for s in stats)
        if not busy and now - still_since >= quiet_s:
            return now - started
    return timeout_s


def _admissions(rankers: dict[str, Any], summary: dict[str, Any] | None = None) -> str:
    """The trigger's admissions over a point, by ground, the calls at risk it left alone because
    pre-inferring them would add device work, those refused for the instance's load, and its
    event lag (with the client's publish acks from `summary`, the point's ReplayResult summary),
    for the progress line ('' without any)."""
    admitted, adds_work = rankers.get("trigger_admitted", 0.0), rankers.get("trigger_adds_work", 0.0)
    line = ""
    if admitted:
        risk, reuse = rankers.get("trigger_admitted_risk", 0.0), rankers.get("trigger_admitted_reuse", 0.0)
        spare = rankers.get("trigger_admitted_spare", 0.0)
        line = f"  admitted {admitted:g} (risk {risk:g}, reuse {reuse:g}, spare {spare:g})"
    if adds_work:
        line += f"  at risk, left (adds work) {adds_work:g}"
    # Refused for the instance's load: its backlog bound, or a pre-inference that would start late.
    refused = {k: rankers.get(f"trigger_{k}", 0.0) for k in ("load_bound", "too_late")}
    if any(refused.values()):
        line += "  refused " + ", ".join(f"{k} {v:g}" for k, v in refused.items())
    lags = rankers.get("trigger_event_lags", 0.0)
    if lags:  # the signal path's first leg: retrieval event -> the trigger's decision
        line += (
            f"  event lag {rankers.get('trigger_event_lag_ms_sum', 0.0) / lags:.1f} ms mean"
            f" ({rankers.get('trigger_event_lags_over_20ms', 0.0):g} over 20 ms"
        )
        acks = summary or {}
        acked = acks.get("publish_ack_ms_p99")
        if acked is not None and acked == acked:  # of which the client's producer -> broker ack
            line += f"; acked p50 {acks.get('publish_ack_ms_p50', 0.0):.1f} p99 {acked:.1f}"
        line += ")"
    if rankers.get("signal_trip_p90_ms"):
        line += f"  signal trip p90 {rankers['signal_trip_p90_ms']:.1f} ms"
    # The device time of one pre-inference (what the trigger prices it at), beside a full
    # ranking's compute on the same line: at L8192 on an H200 it was the dearer one (h6c).
    built = rankers.get("psi_produced", 0.0) - rankers.get("reloads", 0.0)
    if built > 0 and rankers.get("device_preinfer_s"):
        line += f"  pre-inference {rankers['device_preinfer_s'] / built * 1e3:.1f} ms/psi"
    # Its steps by how they ran: an eager one pays the host's per-step cost and, batched, holds
    # ranking calls behind it (device_time.py).
    steps = {kind: rankers.get(f"preinfer_{kind}_steps", 0.0) for kind in STEP_KINDS}
    if any(steps.values()):
        line += "  steps " + ", ".join(
            f"{kind} {n:g} ({rankers.get(f'preinfer_{kind}_seconds', 0.0) / n * 1e3:.1f} ms, "
            f"{rankers.get(f'preinfer_{kind}_prefixes', 0.0) / n:.1f} prefixes, "
            f"{rankers.get(f'preinfer_{kind}_over_10ms', 0.0):g} over 10 ms, "
            f"{rankers.get(f'preinfer_{kind}_held_calls', 0.0):g} calls held "
            f"{rankers.get(f'preinfer_{kind}_held_s', 0.0) * 1e3:.0f} ms)"
            for kind, n in steps.items()
            if n > 0
        )
    started = rankers.get("preinfer_started", 0.0)
    if started:  # how long pre-inferences queued before their first step, and for whom
        line += (
            f"  started after {rankers.get('preinfer_start_wait_s', 0.0) / started * 1e3:.1f} ms mean"
            f" ({rankers.get('preinfer_started_over_50ms', 0.0):g} over 50 ms,"
            f" {rankers.get('preinfer_started_joined', 0.0):g} with their call waiting)"
        )
    done = rankers.get("preinfer_done", 0.0)
    if done:  # how long they took to build once started, and how many came after their call
        line += (
            f"  built in {rankers.get('preinfer_build_s', 0.0) / done * 1e3:.1f} ms mean"
            f" ({rankers.get('preinfer_builds_over_50ms', 0.0):g} over 50 ms,"
            f" {rankers.get('preinfer_done_after_call', 0.0):g} of {done:g} after their call)"
        )
    return line


def stack_pids(stack: Stack) -> dict[str, int]:
    """Our processes by name (`client`: this one, which replays the load): rankers, router,
    trigger, expander and the embedded broker, those the stack started."""
    pids = {"client": os.getpid()}
    for i, ranker in enumerate(stack.rankers):
        pids[f"ranker_{i}"] = ranker.proc.pid
    for name in ("router", "trigger", "expander"):
        process = getattr(stack, name)
        if process is not None:
            pids[name] = process.proc.pid
    if stack.broker is not None:
        pids["broker"] = stack.broker.process.pid
    return pids


def host_cpu_times() -> dict[str, float]:
    """The host's CPU time so far, in clock ticks summed over its CPUs (Linux /proc/stat): total,
    idle (iowait included) and steal (time a virtual machine's CPUs were runnable but the
    hypervisor ran something else). {} where /proc/stat is not there."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return {}
    fields += [0.0] * (8 - len(fields))
    # user nice system idle iowait irq softirq steal (guest time is already counted in user)
    return {"total": sum(fields[:8]), "idle": fields[3] + fields[4], "steal": fields[7]}


def host_cpu_fractions(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Over an interval of host_cpu_times: the share of the host's CPU time that was busy and
    the share stolen by the hypervisor (a stall no code of ours can see); {} without both."""
    if not before or not after or after["total"] <= before["total"]:
        return {}
    total = after["total"] - before["total"]
    idle, steal = after["idle"] - before["idle"], after["steal"] - before["steal"]
    return {"host_cpu_busy": (total - idle - steal) / total, "host_cpu_steal": steal / total}


async def run_point(stack: Stack, workload_config: WorkloadConfig, slo_ms: float, sweep: str, value: float,
                    eps_sample: int, load: LoadGenerator | None = None,
                    client_lag_bound_ms: float | None = None) -> Point:  # fmt: skip
    """Replays one workload through the running stack. Besides the replay's summary, records the
    rankers' counters over the point: psi produced / wasted, reloads, resident bytes, and device
    time (busy_fraction: busy seconds per ranker over the replay; device_*_s: seconds of ranking,
    pre-inference, copies, and pre-inference of psi that expired unused, until 1 s after it).

    `load`: replay from its worker processes (relaygr/load.py) instead of this one.
    `client_lag_bound_ms`: the summary's `client_bound` is true when the load generator sent
    its calls later than this behind schedule at P99 (the point measured the client)."""
    workload = generate(workload_config)
    materializer = Materializer.for_workload(workload)
    before = await ranker_stats(stack.ranker_targets)
    # The load's workers publish through producers of their own.
    producer = None if load is not None else make_producer(KafkaSettings(bootstrap=stack.bootstrap),
                                                           max_request_size=64 << 20)  # fmt: skip
    if producer is not None:
        await producer.start()
    resident: list[int] = []
    dram_used: list[float] = []
    stop = asyncio.Event()
    dram_before = await expander_counters(stack)

    async def sample_resident() -> None:
        while not stop.is_set():
            stats = await ranker_stats(stack.ranker_targets)
            resident.append(sum(s.hbm_resident_bytes for s in stats))
            dram = await expander_counters(stack)
            if dram:
                dram_used.append(dram["used_bytes"])
            await asyncio.sleep(0.5)

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{stack.router_port}",
                                        options=[("grpc.max_send_message_length", 64 << 20)])  # fmt: skip
    router = pb_grpc.RankerStub(channel)
    sampler = asyncio.ensure_future(sample_resident())
    trigger_before = await trigger_counters(stack)
    stalls_before = await stall_counters(stack)
    device_before, started = await device_counters(stack), time.perf_counter()
    cpu_before = host_cpu_times()
    if load is not None:
        load.start()
    pids = stack_pids(stack) | (load.pids if load is not None else {})
    threads_before = cpu_usage.snapshot(pids)
    # The GPUs' own busy share (nvidia-smi: any process's kernels, overlaps counted once).
    gpu_sampler = GpuUtilization() if stack.config.device == "cuda" else None
    if gpu_sampler is not None:
        gpu_sampler.start()
    try:
        if producer is None:
            assert load is not None
            result = await load.replay(workload, bootstrap=stack.bootstrap, router_target=f"127.0.0.1:{stack.router_port}",
                                       retrieval_topic=RETRIEVAL_TOPIC, slo_ms=slo_ms)  # fmt: skip
        else:
            result = await replay(workload, producer=producer, retrieval_topic=RETRIEVAL_TOPIC, router_stub=router,
                                  materializer=materializer, slo_ms=slo_ms)  # fmt: skip
    finally:
        gpu_means = gpu_sampler.stop() if gpu_sampler is not None else {}
        stop.set()
        await sampler
        if producer is not None:
            await producer.stop()
    replay_s = time.perf_counter() - started
    used_gpus = {physical_index(stack.config.device_index(i)) for i in range(stack.config.rankers)}
    gpu_utils = [gpu_means[i] for i in sorted(used_gpus) if i in gpu_means]
    host_cpu = host_cpu_fractions(cpu_before, host_cpu_times())
    threads_after = cpu_usage.snapshot(pids)
    process_cpu = cpu_usage.usage(threads_before, threads_after, replay_s, pids)
    busiest = cpu_usage.busiest_threads(threads_before, threads_after, replay_s, top=1)
    device_end = await device_counters(stack)
    busy_s = device_end["busy"] - device_before["busy"]
    starved_s = device_end["starved"] - device_before["starved"]
    devices = max(1.0, len(stack.ranker_metrics_ports) / stack.config.rankers_per_device)
    stalls = {k: v - stalls_before.get(k, 0.0) for k, v in (await stall_counters(stack)).items()}
    await asyncio.sleep(1.0)  # let leases of the last requests end before reading the counters
    after = await ranker_stats(stack.ranker_targets)
    device = await device_counters(stack)
    trigger = await trigger_counters(stack)
    eps = await eps_against_full(router, result, materializer) if eps_sample else 0.0
    await channel.close()
    dram_after = await expander_counters(stack)
    produced = sum(a.psi_produced - b.psi_produced for a, b in zip(after, before, strict=True))
    prefetched = {
        k: sum(
            getattr(a, f"prefetches_{k}") - getattr(b, f"prefetches_{k}")
            for a, b in zip(after, before, strict=True)
        )
        for k in ("issued", "used", "wasted", "failed")
    }
    ok_calls = sum(1 for r in result.records if r.ok)
    expired = sum(a.psi_expired - b.psi_expired for a, b in zip(after, before, strict=True))
    rankers = {
        "psi_produced": produced,
        "wasted_preinfer_rate": expired / produced if produced else 0.0,
        "reloads": sum(a.reloads - b.reloads for a, b in zip(after, before, strict=True)),
        # Full rankings that kept their prefix's psi (the users' next calls read it).
        "psi_from_rankings": sum(
            a.psi_from_rankings - b.psi_from_rankings for a, b in zip(after, before, strict=True)
        ),
        # The tiers (issue 14): psi copied to host DRAM, dropped from HBM for room, dropped uncopied.
        "demotions": sum(a.demotions - b.demotions for a, b in zip(after, before, strict=True)),
        "hbm_evictions": sum(a.hbm_evictions - b.hbm_evictions for a, b in zip(after, before, strict=True)),
        "hbm_evicted_undemoted": sum(
            a.hbm_evicted_undemoted - b.hbm_evicted_undemoted for a, b in zip(after, before, strict=True)
        ),
        "hbm_released": sum(a.hbm_released - b.hbm_released for a, b in zip(after, before, strict=True)),
        # Prefetches (reloads from host DRAM ahead of the call) and what became of them; `prefetch`:
        # the share of served calls that read a prefetched psi.
        **{f"prefetches_{k}": v for k, v in prefetched.items()},
        "prefetch": prefetched["used"] / ok_calls if ok_calls else 0.0,
        "demotion_lag_p99_ms": max((a.demotion_lag_p99_ms for a in after), default=0.0),
        # The DRAM tier (the expander's arena): entries evicted for room over the point, and the
        # bytes it held at most (sampled every 0.5 s); 0 without an expander.
        "dram_evictions": dram_after.get("evictions", 0.0) - dram_before.get("evictions", 0.0),
        "dram_used_bytes_max": max(dram_used, default=dram_after.get("used_bytes", 0.0)),
        "resident_bytes_max": max(resident, default=0),
        "resident_bytes_mean": sum(resident) / len(resident) if resident else 0.0,
        "lead_time_p50_ms": max((a.lead_time_p50_ms for a in after), default=0.0),
        # Trigger's signal -> the ranker (p90, recent signals): what too_late predicts with.
        "signal_trip_p90_ms": max((a.signal_trip_p90_ms for a in after), default=0.0),
        "preinfers_refused": sum(
            a.preinfers_refused - b.preinfers_refused for a, b in zip(after, before, strict=True)
        ),
        # Per device: the rankers sharing one (rankers_per_device) add their busy time up.
        "busy_fraction": busy_s / (replay_s * devices) if replay_s > 0 else 0.0,
        # The driver's count of the same (nvidia-smi utilization.gpu, mean over the stack's GPUs):
        # the union of every process's kernels; NaN where not sampled (the CPU).
        "gpu_util": sum(gpu_utils) / len(gpu_utils) if gpu_utils else math.nan,
        **{
            f"device_{k}_s": device[k] - device_before[k]
            for k in ("rank", "preinfer", "copy", "unused_psi", "gap", "starved", "fill_wait")
        },
        # The share of the point's time the device sat idle between batches while a call waited
        # (the host the slower side), and how many such gaps lasted over 1 ms.
        # Per ranker process: its own device work's gaps with its calls waiting (where processes
        # share a device, one's gap may be the other's work).
        "starved_fraction": starved_s / (replay_s * len(stack.ranker_metrics_ports)) if replay_s > 0 else 0.0,
        "starved_gaps_over_1ms": device["starved_gaps"] - device_before["starved_gaps"],
        # The caching allocator freed every cached block and retried: each a device-wide stall.
        "alloc_retries": device["alloc_retries"] - device_before["alloc_retries"],
        # Its reservations from the device and returns to it (cudaMalloc / cudaFree; a free
        # synchronises the device): in steady state psi should come from its cache.
        "device_mallocs": device["device_mallocs"] - device_before["device_mallocs"],
        "device_frees": device["device_frees"] - device_before["device_frees"],
        # What a request cost the rankers' host at the point's end, as they report it to the
        # trigger (StatsReply.host_ms_per_request), mean over rankers; NaN where none reported.
        "host_ms_per_request": device["host_ms_per_request"] / max(1, len(stack.ranker_metrics_ports)),
        # What the demotion and keep gates weighed at the point's end (mean over rankers; NaN
        # where not yet measured): with `demotions_skipped`, whether a gate was open and why.
        **{
            k: device[k] / max(1, len(stack.ranker_metrics_ports))
            for k in (*GATE_FIELDS, "keep_device_us_per_token")
        },
        # Candidates for host DRAM the demotion gate left uncopied (services/ranker/demotion_gate.py).
        "demotions_skipped": device["demotions_skipped"] - device_before["demotions_skipped"],
        # The device loop's host sections past RELAYGR_RANKER_LOOP_SLOW_MS (their lines: device_loop_slow).
        "device_loop_slow": device["device_loop_slow"] - device_before["device_loop_slow"],
        # Candidates whose reload could never pay (services/ranker/cost_model.py, may_reload): not copied.
        "demotions_never_reloaded": device["demotions_never_reloaded"]
        - device_before["demotions_never_reloaded"],
        # Full rankings that kept no psi because keeping it did not pay (services/ranker/keep_gate.py).
        "ranking_psi_declined": device["ranking_psi_declined"] - device_before["ranking_psi_declined"],
        # ... and left unkept to measure a keep's device time (the probe, keep_gate.py).
        "ranking_psi_probed": device["ranking_psi_probed"] - device_before["ranking_psi_probed"],
        # Keeps and copies to DRAM shed while the event loop was behind (services/ranker/loop_lag.py).
        **{k: device[k] - device_before[k] for k in ("ranking_psi_shed", "demotions_shed")},
        # Allocations the device refused that the psi budget allowed (services/ranker/relay_cache.py).
        "device_memory_short": device["device_memory_short"] - device_before["device_memory_short"],
        # Take-overs of started pre-inferences completed by the eager partial pass, by the full graph.
        **{k: device[k] - device_before[k] for k in ("takeover_passes_partial", "takeover_passes_full")},
        # CUDA graphs over the point (and its lead-in), by family: batches replayed, run eagerly.
        **{k: device[k] - device_before[k] for k in device if k.startswith("graph_")},
        # Pre-inference steps over the point (and its lead-in), by graph replay or eager: steps,
        # device seconds, prefixes built from, steps over 10 ms, ranking calls held behind them
        # and their waits within them.
        **{k: device[k] - device_before[k] for k in device if k.startswith("preinfer_")},
        # The device loop's own time over the point, by section: wall and thread-CPU seconds.
        **{k: device[k] - device_before[k] for k in device if k.startswith("loop_")},
        # Where a psi copy's time went over the point: mean ms per copy by stage.
        **copy_stage_means(device, device_before),
        # The event loop's CPU per copy to host DRAM (its own steps; what the demotion gate adds
        # to the device loop's issue when it prices a copy).
        "demote_loop_cpu_ms_mean": demote_loop_cpu_ms_mean(device, device_before),
        # HBM misses asked of the host tier, and how the reload-or-recompute choice went.
        **{
            k: device[k] - device_before[k]
            for k in device
            if k.startswith(
                (
                    "host_lookup_",
                    "reload_decision_",
                    "gc_pause",
                    "preinfers_expired",
                    "late_signals",
                    "signal_trips",
                )
            )
        },
        # What the trigger decided over the point, and why (admitted by risk or by reuse).
        **{k: v - trigger_before.get(k, 0.0) for k, v in trigger.items()},
        # The host's CPUs over the replay (every process on it, not only ours; Linux only).
        **host_cpu,
        # Each of our processes over the replay: cores used, and its busiest thread's (a Python
        # service whose busiest thread nears 1.0 is the stack's bottleneck, idle CPUs or not).
        **process_cpu,
        # Each service's stall watch woke > 20 ms late this many times (all at once: the host).
        **stalls,
    }
    slowest = [r.breakdown() for r in result.slowest_ok(0.015)]
    summary = result.summary(slo_ms)
    # The share of measured calls that return to a (user, prefix version) planned earlier: what
    # reuse can buy at most. Sessions cut by the plan's ends lower it (a 10 s point of the
    # default session model: ~0.32 without a lead-in, ~0.53 with 10 s of lead-in).
    measured = workload.measured
    summary["returning_share"] = sum(1 for r in measured if r.returning) / max(1, len(measured))
    summary["client_processes"] = load.processes if load is not None else 1
    summary["client_bound"] = bool(
        client_lag_bound_ms is not None and summary["lag_ms_p99"] > client_lag_bound_ms
    )
    calls = sorted(
        (r.breakdown() for r in result.measured),
        key=lambda c: c["at_s"] if c["at_s"] == c["at_s"] else math.inf,
    )  # unsent (NaN) last
    point = Point(sweep, value, summary, rankers, eps, slowest, calls)
    s = point.summary
    print(f"  {sweep:6s} {value:8g}: p50 {s['p50_ms']:7.1f}  p99 {s['p99_ms']:7.1f}  p99.9 {s['p999_ms']:7.1f} ms  "
          f"ok {s['ok']}/{s['sent']}  hit {s.get('hbm_hit', 0):.2f}  reload {s.get('dram_reload', 0):.2f}  "
          f"full {s.get('full_recompute', 0):.2f}  prefetch {rankers['prefetch']:.2f}  "
          f"{_verdict(point)}  device busy {rankers['busy_fraction']:.2f}{_gpu_util(rankers)}, idle with "
          f"calls waiting {rankers['starved_fraction']:.3f}{_admissions(rankers, s)}{_kept_and_taken_over(rankers)}{_compute_by_path(s)}"
          f"{_reload_stages(rankers)}{_busiest_threads(busiest)}{_event_loops(rankers)}", flush=True)  # fmt: skip
    return point


def _kept_and_taken_over(rankers: dict[str, Any]) -> str:
    """Full rankings that kept psi, and those the keep gate let go without, and take-overs of
    started pre-inferences by pass, for the progress line."""
    kept, declined = rankers.get("psi_from_rankings", 0), rankers.get("ranking_psi_declined", 0)
    line = f"  psi kept {kept:.0f} (declined {declined:.0f})" if kept or declined else ""
    partial, full = rankers.get("takeover_passes_partial", 0), rankers.get("takeover_passes_full", 0)
    if partial or full:  # take-overs of started pre-inferences, by pass (takeover.py)
        line += f"  take-overs partial {partial:.0f}, full graph {full:.0f}"
    return line


def _gpu_util(rankers: dict[str, Any]) -> str:
    util = rankers.get("gpu_util", math.nan)
    return f" (nvidia-smi {util:.2f})" if util == util else ""


def _verdict(point: Point) -> str:
    s = point.summary
    if s.get("client_bound"):
        return f"CLIENT-BOUND (the load generator sent late: lag p99 {s['lag_ms_p99']:.1f} ms)"
    return "meets SLO" if point.ok else "MISSES SLO"


def _reload_stages(rankers: dict[str, Any]) -> str:
    """A reload's mean time by stage (ms), for the progress line, where reloads were timed."""
    parts = [f"{stage} {rankers.get(f'reload_{stage}_ms_mean', 0.0):.1f}" for stage in COPY_STAGES]
    line = f"  reload ms: {', '.join(parts)}" if rankers.get("reload_copy_ms_mean") else ""
    path = [f"{stage} {rankers.get(f'reload_path_{stage}_ms_mean', 0.0):.1f}" for stage in RELOAD_PATH_STAGES]
    return line + (f"; call's path {', '.join(path)}" if rankers.get("reload_path_copy_ms_mean") else "")


def _busiest_threads(busiest: dict[str, list[tuple[str, float]]]) -> str:
    """Each process's busiest thread (name/tid, cores) over the point, for the progress line."""
    parts = [f"{name} {top[0][0]} {top[0][1]:.2f}" for name, top in busiest.items() if top]
    return f"  busiest thread (cores): {', '.join(parts)}" if parts else ""


def _event_loops(rankers: dict[str, Any]) -> str:
    """Each ranker's event loop (its main thread, cores) and what the relay shed while it was
    behind (services/ranker/loop_lag.py), for the progress line."""
    loops = [f"{k.removeprefix('cpu_main_thread_')} {v:.2f}" for k, v in sorted(rankers.items())
             if k.startswith("cpu_main_thread_ranker_")]  # fmt: skip
    line = f"  event loop (cores): {', '.join(loops)}" if loops else ""
    keeps, copies = rankers.get("ranking_psi_shed", 0), rankers.get("demotions_shed", 0)
    line += f"; shed {keeps:g} keeps, {copies:g} copies" if keeps or copies else ""
    short = rankers.get("device_memory_short", 0)
    return line + (f"; device out of memory {short:g} times (psi budget lowered)" if short else "")


_PATH_LABELS = {"hbm_hit": "hit", "inflight_join": "join", "partial_prefix": "partial",
                "dram_reload": "reload", "full_recompute": "full"}  # fmt: skip


def _compute_by_path(summary: dict[str, Any]) -> str:
    """The batch compute P50 of each serving path (ms), for the progress line: which path the
    device thread spends its time on."""
    by = summary.get("by_served") or {}
    parts = [f"{_PATH_LABELS.get(k, k)} {v['compute_ms_p50']:.1f}" for k, v in by.items() if v.get("calls")]
    return f"  compute p50 by path: {', '.join(parts)} ms" if parts else ""


# ---------------------------------------------------------------------- reports


def device_name() -> str:
    """The accelerator results are named by (kernels.device picks it: CUDA, else NPU, else cpu)."""
    return accelerator("auto").name


def _commit() -> str:
    """The checked-out commit; RELAYGR_COMMIT where the tree travels without .git (device runs)."""
    if os.environ.get("RELAYGR_COMMIT"):
        return os.environ["RELAYGR_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _accelerators() -> int:
    backend = resolve_backend("auto")
    return 0 if backend == "cpu" else visible_devices(backend)


def machine() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "device": device_name(),
        "device_count": _accelerators(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "commit": _commit(),
        # Which of the host's GPUs this process saw (parallel runs on one host, one GPU each).
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        # This boot of this machine: leased machines here all call themselves "vm", so results
        # of one sitting are told from another lease's by it (bench.goodput --merge).
        "boot_id": boot_id(),
        # The host's CPU and its speed at one thread of Python: the rankers' limits on short
        # prefixes are host-bound, and leases of one machine kind differ there (H200, k25 and
        # k26, 2026-12-01: the same code and calls took 6-16% more ranker CPU on the second
        # lease, and each limit moved a grid step).
        "cpu_model": cpu_model(),
        "host_probe_ms": host_probe_ms(),
    }


def cpu_model() -> str:
    """The host CPU's model name, or "" where /proc/cpuinfo names none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _probe_work(n: int) -> int:
    # What a ranker's host does most: small dicts, attribute-free arithmetic, calls.
    total = 0
    table: dict[int, int] = {}
    for i in range(n):
        table[i & 1023] = i
        total += table.get((i * 7) & 1023, i)
    return total


def host_probe_ms(n: int = 100_000, runs: int = 5) -> float:
    """The best of `runs` timings of a fixed pure-Python loop on this thread, in ms: lower is a
    faster host. The best, not the mean: it is the host's speed, not its neighbours' noise (the
    points record steal and host busy). ~10-20 ms in all on current hosts."""
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        _probe_work(n)
        best = min(best, time.perf_counter() - started)
    return round(best * 1e3, 3)


def boot_id() -> str | None:
    """The kernel's id of this boot (Linux; None elsewhere)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of a Prometheus exposition text, keyed by `name` or `name{labels}` exactly as
    written (comments and blank lines skipped). ValueError on a line that is not a sample."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if not head:
            raise ValueError(f"not a Prometheus sample: {line!r}")
        out[head] = float(value)
    return out


def scrape_metrics(port: int, host: str = "127.0.0.1", timeout_s: float = 5.0) -> dict[str, float]:
    """The samples of a service's /metrics endpoint (blocking; OSError when unreachable)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as reply:
        return parse_metrics(reply.read().decode())
