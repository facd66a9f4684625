"""Ranker configuration: every setting, its env var and CLI flag, validated at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import ConfigError, non_negative, one_of, port_number, positive, setting
from shared.modelspec import PRESETS
from shared.tls import TlsSettings
from shared.wire import RequestLimits


@dataclass(frozen=True)
class RankerConfig(TlsSettings):
    host: str = setting("127.0.0.1", env="RELAYGR_RANKER_HOST", help="gRPC bind address")
    port: int = setting(
        0, env="RELAYGR_RANKER_PORT", help="gRPC port (0: pick a free one)", check=port_number
    )
    instance_id: str = setting("", env="RELAYGR_RANKER_ID", help="instance name (default host:port)")
    preset: str = setting("tiny", env="RELAYGR_MODEL_PRESET", help="model preset", check=one_of(*PRESETS))
    checkpoint: str = setting(
        "", env="RELAYGR_MODEL_CHECKPOINT", help="safetensors checkpoint (default: seeded)"
    )
    seed: int = setting(0, env="RELAYGR_MODEL_SEED", help="weights seed when no checkpoint is given")
    device: str = setting("auto", env="RELAYGR_DEVICE", help="auto | cpu | cuda | npu",
                          check=one_of("auto", "cpu", "cuda", "npu"))  # fmt: skip
    device_index: int = setting(0, env="RELAYGR_DEVICE_INDEX", help="accelerator index", check=non_negative)
    hbm_budget_mb: float = setting(512.0, env="RELAYGR_HBM_BUDGET_MB", help="psi bytes kept in accelerator memory",
                                   check=positive)  # fmt: skip
    default_lease_ms: float = setting(2000.0, env="RELAYGR_LEASE_MS",
                                      help="lease when a PreInfer names no deadline", check=positive)  # fmt: skip
    max_lease_ms: float = setting(
        30000.0, env="RELAYGR_MAX_LEASE_MS", help="longest lease granted", check=positive
    )
    max_batch: int = setting(8, env="RELAYGR_MAX_BATCH", help="ranking calls per batch", check=positive)
    max_batch_tokens: int = setting(65536, env="RELAYGR_MAX_BATCH_TOKENS", help="tokens per ranking batch",
                                    check=positive)  # fmt: skip
    max_wait_ms: float = setting(1.0, env="RELAYGR_MAX_WAIT_MS", help="longest wait for a batch to fill",
                                 check=non_negative)  # fmt: skip
    preinfer_max_batch: int = setting(4, env="RELAYGR_PREINFER_MAX_BATCH", help="prefixes per pre-inference",
                                      check=positive)  # fmt: skip
    preinfer_concurrent: bool = setting(True, env="RELAYGR_PREINFER_CONCURRENT",
                                        help="pre-infer in a second engine thread (CUDA: low-priority stream) "
                                        "instead of one layer at a time between ranking batches")  # fmt: skip
    max_inflight_ranks: int = setting(256, env="RELAYGR_MAX_INFLIGHT_RANKS",
                                      help="Rank calls admitted at once; more get RESOURCE_EXHAUSTED",
                                      check=positive)  # fmt: skip
    join_margin_ms: float = setting(2.0, env="RELAYGR_JOIN_MARGIN_MS",
                                    help="an in-flight psi is awaited only while this much deadline remains "
                                    "beyond a full ranking", check=non_negative)  # fmt: skip
    keep_demoted: bool = setting(True, env="RELAYGR_KEEP_DEMOTED",
                                 help="keep psi copied to host DRAM in HBM as an evictable hot copy "
                                 "(false: free it at once)")  # fmt: skip
    expander_socket: str = setting(
        "", env="RELAYGR_EXPANDER_SOCKET", help="host-DRAM expander socket ('': none)"
    )
    gil_switch_ms: float = setting(0.5, env="RELAYGR_GIL_SWITCH_MS",
                                   help="Python thread switch interval: how long the event loop may wait "
                                   "for the engine thread to yield the interpreter", check=positive)  # fmt: skip
    metrics_port: int = setting(0, env="RELAYGR_RANKER_METRICS_PORT", help="Prometheus port (0: pick)",
                                check=port_number)  # fmt: skip
    log_level: str = setting("info", env="RELAYGR_LOG_LEVEL", help="log level",
                             check=one_of("debug", "info", "warning", "error"))  # fmt: skip
    max_prefix_tokens: int = setting(65536, env="RELAYGR_MAX_PREFIX_TOKENS", help="longest accepted prefix",
                                     check=positive)  # fmt: skip
    max_candidates: int = setting(2048, env="RELAYGR_MAX_CANDIDATES", help="most candidates per call",
                                  check=positive)  # fmt: skip
    max_message_mb: float = setting(64.0, env="RELAYGR_MAX_MESSAGE_MB", help="gRPC message size limit",
                                    check=positive)  # fmt: skip

    def validate(self) -> None:
        self.validate_tls()
        if self.default_lease_ms > self.max_lease_ms:
            raise ConfigError("RELAYGR_LEASE_MS must not exceed RELAYGR_MAX_LEASE_MS")

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(max_prefix_tokens=self.max_prefix_tokens, max_candidates=self.max_candidates)
