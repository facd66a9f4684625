"""Ranker configuration: every setting, its env var and CLI flag, validated at start-up.

Its own settings are RELAYGR_RANKER_*; the model (RELAYGR_MODEL_*), the expander's socket path,
the leases and the prefix limit are shared with other services (shared/settings.py)."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from services.ranker.admission import AdmissionConfig
from services.ranker.call_cost import CostPrior
from services.ranker.takeover import TakeoverPolicy
from shared import settings
from shared.config import ConfigError, fraction, non_negative, port_number, positive, setting
from shared.fingerprint import CHUNK_TOKENS
from shared.settings import LogLevel
from shared.tls import TlsSettings
from shared.wire import RequestLimits


def _positive_ints(values: tuple[int, ...]) -> str | None:
    return None if all(v > 0 for v in values) else "every value must be >= 1"


def _usable_cpus(values: tuple[int, ...]) -> str | None:
    usable = os.sched_getaffinity(0)
    unknown = sorted(set(values) - usable)
    return (
        f"CPUs {unknown} are not available to this process (it may use {sorted(usable)})" if unknown else None
    )


def _class_ratio(value: float) -> str | None:
    return None if value == 0 or 1.0 < value <= 2.0 else "must be 0 (off) or a ratio in (1, 2]"


def _whole_chunks(value: int) -> str | None:
    return (
        None
        if value >= CHUNK_TOKENS and value % CHUNK_TOKENS == 0
        else f"must be a multiple of {CHUNK_TOKENS}"
    )


class Demotion(enum.StrEnum):
    """When consumed psi is copied to host DRAM (services/ranker/relay_cache.py)."""

    EARNED = "earned"  # under pressure, while reloads pay for the copies (demotion_gate.py)
    PRESSURE = "pressure"  # when HBM nears its budget, the least recently used first: tiers add up
    CONSUMED = "consumed"  # as soon as it is consumed: DRAM holds a copy of what HBM holds


class BatchCopies(enum.StrEnum):
    """How a replayed batch's inputs reach the device and its scores the host (graphs.py)."""

    ENGINE = "engine"  # copies on the ranking stream (a copy engine's queue, behind psi's copies)
    SCORES_ASIDE = "scores_aside"  # scores copied aside by a kernel, then out on their own stream
    KERNEL = "kernel"  # both moved by kernels through device views of page-locked memory


class LayerKernels(enum.StrEnum):
    """How each layer computes its norms with what is around them (kernels/fused_norms.py)."""

    TORCH = "torch"  # torch's kernels: a norm, then a multiply; an add, then a norm
    FUSED = "fused"  # one Triton kernel for each pair on CUDA (torch on other devices)


class HostPsiFormat(enum.StrEnum):
    """How psi is stored in host DRAM (services/ranker/transfer.py)."""

    NATIVE = "native"  # as computed (bf16 in the bench preset)
    FP8 = "fp8"  # float8 e4m3 with a scale per 16 tokens of one head: half the bytes


class Keep(enum.StrEnum):
    """Which full rankings keep their prefix's psi (services/ranker/relay_cache.py)."""

    EARNED = "earned"  # while later calls' reads of kept psi pay for keeping it (keep_gate.py)
    ALWAYS = "always"  # every one of at least ranking_psi_min_tokens


class Device(enum.StrEnum):
    AUTO = "auto"  # cuda, else npu, else cpu
    CPU = "cpu"
    CUDA = "cuda"
    NPU = "npu"


@dataclass(frozen=True)
class RankerConfig(TlsSettings):
    host: str = setting("127.0.0.1", env="RELAYGR_RANKER_HOST", help="gRPC bind address")
    port: int = setting(
        0, env="RELAYGR_RANKER_PORT", help="gRPC port (0: pick a free one)", check=port_number
    )
    instance_id: str = setting("", env="RELAYGR_RANKER_ID", help="instance name (default host:port)")
    preset: str = settings.model_preset()
    checkpoint: str = setting(
        "", env="RELAYGR_MODEL_CHECKPOINT", help="safetensors checkpoint (default: seeded)"
    )
    seed: int = setting(0, env="RELAYGR_MODEL_SEED", help="weights seed when no checkpoint is given")
    device: Device = setting(
        Device.AUTO,
        env="RELAYGR_RANKER_DEVICE",
        renamed_from="RELAYGR_DEVICE",
        help="accelerator kind (auto: cuda, npu, cpu)",
    )
    device_index: int = setting(
        0,
        env="RELAYGR_RANKER_DEVICE_INDEX",
        renamed_from="RELAYGR_DEVICE_INDEX",
        help="accelerator index",
        check=non_negative,
    )
    hbm_budget_mb: float = setting(512.0, env="RELAYGR_RANKER_HBM_BUDGET_MB",
                                   renamed_from="RELAYGR_HBM_BUDGET_MB", help="psi bytes kept in accelerator memory",
                                   check=positive)  # fmt: skip
    device_processes: int = setting(
        1, env="RELAYGR_RANKER_DEVICE_PROCESSES",
        help="ranker processes sharing this accelerator, each with its own --hbm-budget-mb: the start-up "
        "check judges their budgets together against the device's free memory",
        check=positive,
    )  # fmt: skip
    default_lease_ms: float = settings.default_lease_ms(renamed_from="RELAYGR_LEASE_MS")
    max_lease_ms: float = settings.max_lease_ms()
    max_batch: int = setting(
        8,
        env="RELAYGR_RANKER_MAX_BATCH",
        renamed_from="RELAYGR_MAX_BATCH",
        help="ranking calls per batch",
        check=positive,
    )
    max_batch_tokens: int = setting(65536, env="RELAYGR_RANKER_MAX_BATCH_TOKENS",
                                    renamed_from="RELAYGR_MAX_BATCH_TOKENS", help="tokens per ranking batch",
                                    check=positive)  # fmt: skip
    max_wait_ms: float = setting(1.0, env="RELAYGR_RANKER_MAX_WAIT_MS",
                                 renamed_from="RELAYGR_MAX_WAIT_MS", help="longest wait for a batch to fill",
                                 check=non_negative)  # fmt: skip
    preinfer_max_batch: int = setting(4, env="RELAYGR_RANKER_PREINFER_MAX_BATCH",
                                      renamed_from="RELAYGR_PREINFER_MAX_BATCH", help="prefixes per pre-inference",
                                      check=positive)  # fmt: skip
    preinfer_chunk_tokens: int = setting(4096, env="RELAYGR_RANKER_PREINFER_CHUNK_TOKENS",
                                         help="pre-inference builds psi in chunks of at most this many prefix "
                                         "tokens (a multiple of 256), between ranking steps; smaller chunks "
                                         "hold a ranking call back less. A first chunk that a CUDA graph holds "
                                         "may be as long as the graph (RELAYGR_RANKER_GRAPH_MAX_FULL_TOKENS) "
                                         "within the step budget (--max-rank-delay-ms): later chunks run "
                                         "eagerly", check=_whole_chunks)  # fmt: skip
    max_rank_delay_ms: float = setting(5.0, env="RELAYGR_RANKER_MAX_RANK_DELAY_MS",
                                       help="pre-inference chunks are sized (from the measured step costs) so "
                                       "that a step lasts at most its fixed cost plus this long: about the "
                                       "longest a ranking call waits behind pre-inference", check=positive)  # fmt: skip
    first_chunk_absorbs: bool = setting(False, env="RELAYGR_RANKER_FIRST_CHUNK_ABSORBS",
                                        help="a prefix's first chunk, where a CUDA graph holds it, may pass that "
                                        "step budget by less than an eager step's fixed cost where that leaves "
                                        "one step fewer and less device time (at 16384 tokens on an H200: two "
                                        "steps, ~17 ms a psi, instead of three, 21.6); off until measured")  # fmt: skip
    step_budget_by_kind: bool = setting(False, env="RELAYGR_RANKER_STEP_BUDGET_BY_KIND",
                                        help="that step budget counts the fixed cost of the kind of step "
                                        "that runs (a CUDA graph replay's, ~0.8 ms on an H200, where one "
                                        "builds the chunk) instead of always an eager step's (2.7-5.6 ms "
                                        "as measured at start-up): graph steps then last ~5.8 ms instead "
                                        "of ~10; off until measured")  # fmt: skip
    takeover_pass: TakeoverPolicy = setting(TakeoverPolicy.MEASURED, env="RELAYGR_RANKER_TAKEOVER_PASS",
                                            help="how a ranking call that takes over a started pre-inference "
                                            "completes it: the eager pass over the rest of the prefix (partial), "
                                            "or the full ranking's CUDA graph over the whole sequence, where one "
                                            "holds it, while partial passes measure dearer than full rankings of "
                                            "their calls (measured; services/ranker/takeover.py)")  # fmt: skip
    latency_target_ms: float = setting(25.0, env="RELAYGR_RANKER_LATENCY_TARGET_MS",
                                       help="the latency a ranking call is scheduled to finish within on "
                                       "this instance (about half the ranking SLO; 25: half of 50 ms): calls "
                                       "are ordered, and short ones let ahead of long ones, by the earlier of "
                                       "the call's own deadline and its arrival plus this; 0: by the calls' "
                                       "own (gRPC) deadlines alone, with which every call against psi passed "
                                       "over every full ranking (a client's far deadline always holds). On an "
                                       "H200 at L4096 relay-nospare with 25 met 250 req/s (P99 42.4 ms, h2f) "
                                       "where without it missed 225 (54.1 ms, h2e, same commit)",
                                       check=non_negative)  # fmt: skip
    slo_ms: float = setting(0.0, env="RELAYGR_RANKER_SLO_MS",
                            help="the ranking SLO this instance serves, from a call's arrival: work "
                            "predicted to finish past it (or past the call's own deadline) waits behind "
                            "work that can still meet its own, then runs (earliest deadline first "
                            "hands each call the lateness of those ahead of it); 0: no SLO (only a call "
                            "that cannot finish within its own deadline waits). The launcher passes "
                            "its SLO", check=non_negative)  # fmt: skip
    launch_ahead: bool = setting(True, env="RELAYGR_RANKER_LAUNCH_AHEAD",
                                 help="launch the next ranking batch before collecting the scores of the one "
                                 "on the device, so that the host's work between batches overlaps the "
                                 "device's (at most two batches in flight)")  # fmt: skip
    graph_psi_chunks: bool = setting(True, env="RELAYGR_RANKER_GRAPH_PSI_CHUNKS",
                                     help="CUDA only: pre-inference chunks after a prefix's first (they "
                                     "read the psi built so far) replay captured graphs of their own "
                                     "family instead of running eagerly (off: at 16384 tokens on an H200 "
                                     "two steps in three run eagerly, 3.5 ms of fixed cost each against "
                                     "0.8 for a replay; on, the relay's limit rose 33.75 -> 37.97 req/s "
                                     "in one call, k20b)")  # fmt: skip
    batch_copies: BatchCopies = setting(BatchCopies.KERNEL, env="RELAYGR_RANKER_BATCH_COPIES",
                                renamed_from="RELAYGR_RANKER_SCORES_ASIDE",
                                help="CUDA only: how a replayed batch's inputs reach the device and its "
                                "scores the host. A copy engine serves each direction in order, so a "
                                "batch's small copy queued behind a psi copy to or from host DRAM (~10 ms "
                                "at 16384 tokens on an H200) waits for all of it, and so does the ranking "
                                "stream (k22, k23). engine: copies on the ranking stream; scores_aside: "
                                "scores copied aside by a kernel and to the host on a stream of their own "
                                "(inputs still wait behind a reload); kernel: both, and a new psi's "
                                "timestamps, moved by kernels through device views of page-locked "
                                "memory, no copy engine (the default: at 16384 tokens on an H200, k24, "
                                "calls against psi never took over 5.1 ms of device time at 46.41 req/s, "
                                "against 19.4 ms with engine; where the device gives no such view it runs "
                                "as engine, with a warning)")  # fmt: skip
    layer_kernels: LayerKernels = setting(LayerKernels.FUSED, env="RELAYGR_RANKER_LAYER_KERNELS",
                                          help="how each layer computes LayerNorm(attn) * u, and its "
                                          "output x + W_o(...) with the next layer's norm of it: fused "
                                          "(two Triton kernels, seven passes over the layer's tokens, on "
                                          "CUDA; torch on other devices; the default: on an H100, k29a, "
                                          "full rankings of 4096 x 8 took 17.65 ms against 20.01 and calls "
                                          "against psi 2.97 against 3.56, 4-16% less on every shape) or "
                                          "torch (four kernels, ten passes)")  # fmt: skip
    psi_size_classes: float = setting(0.0, env="RELAYGR_RANKER_PSI_SIZE_CLASSES", check=_class_ratio,
                                      help="0 (off), or psi blocks allocated in size classes this ratio "
                                      "apart (e.g. 1.125; services/ranker/psi.py, PsiSizeClasses), the HBM "
                                      "budget counting each class's bytes: a freed block then fits later "
                                      "psi of its class, against the fragments that made the device's "
                                      "allocator free its whole cache and retry (an H100's mix, k29b: a 37 "
                                      "ms stall). Off until measured (bench.psi_alloc, then the harness's "
                                      "relay-psi-classes)")  # fmt: skip
    chunks_ahead: bool = setting(False, env="RELAYGR_RANKER_CHUNKS_AHEAD",
                                 help="launch pre-inference steps the way launch-ahead launches ranking "
                                 "batches: behind the step on the device, settled after the next one is "
                                 "launched (off: not yet measured on a GPU)")  # fmt: skip
    cuda_graphs: bool = setting(True, env="RELAYGR_RANKER_CUDA_GRAPHS", renamed_from="RELAYGR_CUDA_GRAPHS",
                                help="CUDA only: rank against psi by replaying captured CUDA graphs (one "
                                "per batch-shape bucket) instead of launching kernels one by one")  # fmt: skip
    graph_max_tokens: int = setting(4096, env="RELAYGR_RANKER_GRAPH_MAX_TOKENS",
                                    renamed_from="RELAYGR_GRAPH_MAX_TOKENS",
                                    help="largest ranking batch (new tokens) given a CUDA graph; larger "
                                    "batches run eagerly", check=positive)  # fmt: skip
    # 17408 = a 16384-token prefix and a 1024-token suffix. Not "GPU-bound anyway": at 8192 + 320
    # tokens an eager full ranking took 6-8 ms of host launch (p50) for 10 ms on an H200, the
    # device idle during it (h6a: gpu_util 0.42 when the baseline missed).
    graph_max_full_tokens: int = setting(17408, env="RELAYGR_RANKER_GRAPH_MAX_FULL_TOKENS",
                                         help="largest full ranking or pre-inference step (tokens in all) "
                                         "given a CUDA graph; larger ones run eagerly; 0: none. "
                                         "Pre-inference graphs share one K/V staging buffer of "
                                         "layers x 2 x tokens x hidden (570 MB at 17408 for the bench "
                                         "preset)", check=non_negative)  # fmt: skip
    # Off: on an H200's mix (k27a) the baseline met 421.9 req/s with pairs at 2048 as without;
    # the ranker paired 20-32% of its calls, saving 2-3% of its host time.
    graph_full_batch_tokens: int = setting(0, env="RELAYGR_RANKER_GRAPH_FULL_BATCH_TOKENS",
                                           help="CUDA only: full rankings of two sequences totalling at most "
                                           "this many tokens get graphs captured at start-up, so that the "
                                           "scheduler may batch them (it batches full rankings only into "
                                           "shapes a graph holds); 0: every full ranking runs alone. At "
                                           "most RELAYGR_RANKER_GRAPH_MAX_FULL_TOKENS; 27 graphs at 2048",
                                           check=non_negative)  # fmt: skip
    cpu_affinity: tuple[int, ...] = setting((), env="RELAYGR_RANKER_CPU_AFFINITY",
                                            renamed_from="RELAYGR_CPU_AFFINITY", check=_usable_cpus,
                                            help="CPUs this instance's threads run on (comma-separated; "
                                            "empty: all). One ranker per accelerator gets cores of its own, "
                                            "near the device: fewer wake-ups on a cold core in every call")  # fmt: skip
    graph_warm_tokens: tuple[int, ...] = setting((320,), env="RELAYGR_RANKER_GRAPH_WARM_TOKENS",
                                                 renamed_from="RELAYGR_GRAPH_WARM_TOKENS", check=_positive_ints,
                                                 help="new tokens per user (recent behaviours + candidates) "
                                                 "whose graphs are captured at start-up, for every batch "
                                                 "size (comma-separated; other shapes are captured when "
                                                 "first seen, off the critical path)")  # fmt: skip
    max_inflight_ranks: int = setting(256, env="RELAYGR_RANKER_MAX_INFLIGHT_RANKS",
                                      renamed_from="RELAYGR_MAX_INFLIGHT_RANKS",
                                      help="hard cap on Rank calls in flight (queued + running); more get "
                                      "RESOURCE_EXHAUSTED", check=positive)  # fmt: skip
    # Admission (services/ranker/admission.py): calls weighed by their predicted cost.
    admission_target_ms: float = setting(5000.0, env="RELAYGR_RANKER_ADMISSION_TARGET_MS",
                                         renamed_from="RELAYGR_ADMISSION_TARGET_MS",
                                         help="bound on the predicted engine time of the Rank calls in flight "
                                         "(queued work, from the measured per-batch / per-token costs): beyond "
                                         "it calls are refused at once with RESOURCE_EXHAUSTED, whatever their "
                                         "deadline (0: no adaptive admission, only the hard cap)",
                                         check=non_negative)  # fmt: skip
    admission_deadline_fraction: float = setting(0.5, env="RELAYGR_RANKER_ADMISSION_DEADLINE_FRACTION",
                                                 renamed_from="RELAYGR_ADMISSION_DEADLINE_FRACTION",
                                                 help="a Rank call is admitted only if the predicted work in "
                                                 "flight and its own end within this share of its remaining "
                                                 "deadline; else RESOURCE_EXHAUSTED at once",
                                                 check=fraction)  # fmt: skip
    # A burst of a few batches is normal traffic, not overload: below this the work bound would refuse
    # calls whose deadline leaves plenty of time (the deadline check still refuses those that lack it).
    admission_min_limit: int = setting(0, env="RELAYGR_RANKER_ADMISSION_MIN_LIMIT",
                                       renamed_from="RELAYGR_ADMISSION_MIN_LIMIT",
                                       help="the work bound does not refuse while fewer Rank calls than this "
                                       "are in flight (0: 4 x max_batch)", check=non_negative)  # fmt: skip
    admission_prior_batch_ms: float = setting(1.0, env="RELAYGR_RANKER_ADMISSION_PRIOR_BATCH_MS",
                                              renamed_from="RELAYGR_ADMISSION_PRIOR_BATCH_MS",
                                              help="cost of a ranking batch assumed before any is measured "
                                              "(worth 2 batches: it fades as batches are measured)",
                                              check=non_negative)  # fmt: skip
    admission_prior_token_us: float = setting(10.0, env="RELAYGR_RANKER_ADMISSION_PRIOR_TOKEN_US",
                                              renamed_from="RELAYGR_ADMISSION_PRIOR_TOKEN_US",
                                              help="cost per computed token assumed before any batch is measured",
                                              check=non_negative)  # fmt: skip
    admission_window_s: float = setting(2.0, env="RELAYGR_RANKER_ADMISSION_WINDOW_S",
                                        renamed_from="RELAYGR_ADMISSION_WINDOW_S",
                                        help="time constant of the reported Rank throughput, in busy seconds",
                                        check=positive)  # fmt: skip
    admission_shed_preinfer_ms: float = setting(1000.0, env="RELAYGR_RANKER_ADMISSION_SHED_PREINFER_MS",
                                                renamed_from="RELAYGR_ADMISSION_SHED_PREINFER_MS",
                                                help="PreInfer is refused (reason rank_overloaded) for this long "
                                                "after a Rank call was refused (0: never)",
                                                check=non_negative)  # fmt: skip
    join_margin_ms: float = setting(2.0, env="RELAYGR_RANKER_JOIN_MARGIN_MS",
                                    renamed_from="RELAYGR_JOIN_MARGIN_MS",
                                    help="an in-flight psi is awaited only while this much deadline remains "
                                    "beyond a full ranking", check=non_negative)  # fmt: skip
    keep_demoted: bool = setting(True, env="RELAYGR_RANKER_KEEP_DEMOTED", renamed_from="RELAYGR_KEEP_DEMOTED",
                                 help="keep psi copied to host DRAM in HBM as an evictable hot copy "
                                 "(false: free it at once)")  # fmt: skip
    ranking_psi_min_tokens: int = setting(512, env="RELAYGR_RANKER_RANKING_PSI_MIN_TOKENS",
                                          help="a full ranking of a prefix at least this long keeps the "
                                          "prefix's psi in the cache, written by the same pass, so that the "
                                          "user's next call reads it (0: never: plain full inference)",
                                          check=non_negative)  # fmt: skip
    ranking_psi_keep: Keep = setting(Keep.EARNED, env="RELAYGR_RANKER_RANKING_PSI_KEEP",
                                     help="which full rankings of at least ranking_psi_min_tokens keep psi: "
                                     "every one (always), or only while the calls that read kept psi save "
                                     "more device time than keeping it costs the host, measured, else a "
                                     "sample of users (earned)")  # fmt: skip
    ranking_psi_sample_every: int = setting(8, env="RELAYGR_RANKER_RANKING_PSI_SAMPLE_EVERY",
                                            help="ranking_psi_keep earned: while keeping psi does not pay, "
                                            "one user in this many still keeps it, so that its reads keep "
                                            "being measured (1: every one)", check=positive)  # fmt: skip
    demotion: Demotion = setting(Demotion.EARNED, env="RELAYGR_RANKER_DEMOTION",
                                 help="when consumed psi is copied to host DRAM: under HBM pressure, the "
                                 "least recently used first, so that DRAM holds what HBM no longer does "
                                 "and the tiers' capacities add up (pressure), and only while reloads "
                                 "pay for the copies' host time, else a sample (earned); or as soon as "
                                 "it is consumed (consumed: DRAM then duplicates HBM, and adds nothing "
                                 "unless larger)")  # fmt: skip
    demotion_sample_every: int = setting(8, env="RELAYGR_RANKER_DEMOTION_SAMPLE_EVERY",
                                         help="demotion earned: while copies do not pay, one candidate in "
                                         "this many is still copied, so that their yield keeps being "
                                         "measured (1: every one)", check=positive)  # fmt: skip
    demotion_reserve_fraction: float = setting(0.05, env="RELAYGR_RANKER_DEMOTION_RESERVE_FRACTION",
                                               help="under pressure: psi copied to host DRAM ahead of its "
                                               "eviction, as a fraction of the HBM budget (the room admissions "
                                               "take before the next copies finish)",
                                               check=fraction)  # fmt: skip
    shed_lag_ms: float = setting(0.0, env="RELAYGR_RANKER_SHED_LAG_MS",
                                 help="while the event loop runs this many ms behind (its 50 ms tick's "
                                 "oversleep, smoothed over 0.5 s), full rankings keep no psi and no psi "
                                 "is copied to host DRAM: work the baseline does not do, on the host that "
                                 "binds (services/ranker/loop_lag.py; 0: never shed, the default: at 2 ms "
                                 "it lost to not shedding on an H200's length mix, k18b)",
                                 check=non_negative)  # fmt: skip
    host_tier: bool = setting(False, env="RELAYGR_RANKER_HOST_TIER", renamed_from="RELAYGR_HOST_TIER",
                              help="keep psi evicted from HBM in host DRAM, through the expander at "
                              "RELAYGR_EXPANDER_SOCKET_PATH (which must be running)")  # fmt: skip
    expander_socket_path: str = settings.expander_socket_path()
    copy_piece_mb: float = setting(0.0, env="RELAYGR_RANKER_COPY_PIECE_MB",
                                   help="psi moves between HBM and host DRAM in copies of at most this many "
                                   "MiB (0: one copy each). Pieces do not shorten a ranking batch's own small "
                                   "copies' wait behind psi's on a copy engine (k23b on an H200: 8.1-8.7 ms "
                                   "behind a 512 MiB copy, 16 or 64 MiB pieces, queued at once or two at a "
                                   "time; RELAYGR_RANKER_BATCH_COPIES is the way out) and each costs the device "
                                   "loop a copy call (L4096, h2d: 8 MiB pieces doubled its time issuing copies)",
                                   check=non_negative)  # fmt: skip
    host_psi_format: HostPsiFormat = setting(HostPsiFormat.NATIVE, env="RELAYGR_RANKER_HOST_PSI_FORMAT",
                                             help="how psi is stored in host DRAM: native (as computed) or "
                                             "fp8 (float8 e4m3, a float32 scale per 16 tokens of one head: "
                                             "half the bytes to copy and to hold, quantized and dequantized on "
                                             "the copy stream; scores off by bench.psi_fp8's eps: on an H200 "
                                             "with the bench preset at 4096 and 16384 tokens 0.021-0.027, 5-7% "
                                             "of the scores' spread, 9 of each user's 10 best kept at worst, k25). "
                                             "Off until measured in a goodput search")  # fmt: skip
    gil_switch_ms: float = setting(0.05, env="RELAYGR_RANKER_GIL_SWITCH_MS",
                                   renamed_from="RELAYGR_GIL_SWITCH_MS",
                                   help="Python thread switch interval: how long a thread that wants the "
                                   "interpreter waits for the one holding it (every torch call of the device "
                                   "thread gives it up; on an H200 host with the event loop busy a graph "
                                   "launch took 12.1 ms at 0.5, 3.6 at 0.1, 0.5 alone: bench.host_costs)",
                                   check=positive)  # fmt: skip
    loop_slow_ms: float = setting(5.0, env="RELAYGR_RANKER_LOOP_SLOW_MS",
                                  help="a section of the device loop's host work (launch, plan, settle, "
                                  "copies) that runs longer than this is counted, and at most once a second "
                                  "logged with what every thread was running then (device_loop_slow; on an "
                                  "H200's length mix launches of ~1 ms took 6-8 ms for 400 ms, k25c; watched on a GPU or NPU "
                                  "only, where the loop issues work without waiting for it; 0: off)",
                                  check=non_negative)  # fmt: skip
    timer_slack_us: float = setting(1.0, env="RELAYGR_RANKER_TIMER_SLACK_US",
                                    help="the ranker's threads' timer slack (Linux): how late the kernel may "
                                    "end the timed wait of a thread that wants the interpreter, on top of the "
                                    "switch interval (the kernel's default is 50 us; 0 keeps it)",
                                    check=non_negative)  # fmt: skip
    metrics_port: int = setting(0, env="RELAYGR_RANKER_METRICS_PORT", help="Prometheus port (0: pick)",
                                check=port_number)  # fmt: skip
    log_level: LogLevel = settings.log_level("ranker")
    max_prefix_tokens: int = settings.max_prefix_tokens()
    max_candidates: int = setting(2048, env="RELAYGR_RANKER_MAX_CANDIDATES",
                                  renamed_from="RELAYGR_MAX_CANDIDATES", help="most candidates per call",
                                  check=positive)  # fmt: skip
    max_message_mb: float = setting(64.0, env="RELAYGR_RANKER_MAX_MESSAGE_MB",
                                    renamed_from="RELAYGR_MAX_MESSAGE_MB", help="gRPC message size limit",
                                    check=positive)  # fmt: skip

    def validate(self) -> None:
        self.validate_tls()
        if self.default_lease_ms > self.max_lease_ms:
            raise ConfigError("RELAYGR_DEFAULT_LEASE_MS must not exceed RELAYGR_MAX_LEASE_MS")
        if (self.admission_min_limit or 4 * self.max_batch) > self.max_inflight_ranks:
            raise ConfigError(
                "RELAYGR_RANKER_ADMISSION_MIN_LIMIT (0: 4 x RELAYGR_RANKER_MAX_BATCH) must not exceed "
                "RELAYGR_RANKER_MAX_INFLIGHT_RANKS"
            )
        if self.graph_full_batch_tokens > self.graph_max_full_tokens:
            raise ConfigError(
                "RELAYGR_RANKER_GRAPH_FULL_BATCH_TOKENS must not exceed RELAYGR_RANKER_GRAPH_MAX_FULL_TOKENS"
            )
        if self.admission_prior_batch_ms + self.admission_prior_token_us <= 0:
            raise ConfigError(
                "RELAYGR_RANKER_ADMISSION_PRIOR_BATCH_MS and RELAYGR_RANKER_ADMISSION_PRIOR_TOKEN_US must not both be 0"
            )

    @property
    def copy_piece_bytes(self) -> int:
        """copy_piece_mb in bytes (0: whole copies)."""
        return int(self.copy_piece_mb * 2**20)

    @property
    def expander_socket(self) -> str:
        """The expander socket the host tier connects to, '' without a host tier."""
        return self.expander_socket_path if self.host_tier else ""

    @property
    def admission(self) -> AdmissionConfig:
        return AdmissionConfig(
            target_s=self.admission_target_ms / 1e3,
            deadline_fraction=self.admission_deadline_fraction,
            min_limit=self.admission_min_limit or 4 * self.max_batch,
            max_limit=self.max_inflight_ranks,
            window_s=self.admission_window_s,
            shed_s=self.admission_shed_preinfer_ms / 1e3,
            prior=CostPrior(
                per_batch_s=self.admission_prior_batch_ms / 1e3,
                per_token_s=self.admission_prior_token_us / 1e6,
            ),
        )

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(max_prefix_tokens=self.max_prefix_tokens, max_candidates=self.max_candidates)
