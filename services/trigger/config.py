"""Trigger configuration: every setting, its env var and CLI flag, validated at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import ConfigError, fraction, non_negative, one_of, port_number, positive, setting
from shared.kafka import KafkaSettings
from shared.modelspec import PRESETS
from shared.tls import TlsSettings


@dataclass(frozen=True)
class TriggerConfig(KafkaSettings, TlsSettings):
    rankers: tuple[str, ...] = setting((), env="RELAYGR_RANKERS",
                                       help="ranker instances host:port, comma-separated (the router's membership)")  # fmt: skip
    retrieval_topic: str = setting(
        "relaygr.retrieval", env="RELAYGR_RETRIEVAL_TOPIC", help="retrieval events topic"
    )
    signal_topic: str = setting(
        "relaygr.preinfer-signals", env="RELAYGR_SIGNAL_TOPIC", help="pre-infer signals topic"
    )
    dlq_topic: str = setting(
        "relaygr.dlq", env="RELAYGR_DLQ_TOPIC", help="dead-letter topic for malformed events"
    )
    topic_partitions: int = setting(8, env="RELAYGR_TOPIC_PARTITIONS", help="partitions of topics created at start",
                                    check=positive)  # fmt: skip
    group_id: str = setting("relaygr-trigger", env="RELAYGR_TRIGGER_GROUP", help="consumer group")
    policy: str = setting("sequence", env="RELAYGR_TRIGGER_POLICY",
                          help="sequence (the trigger) | all (pre-infer everything) | off (never)",
                          check=one_of("sequence", "all", "off"))  # fmt: skip
    slo_ms: float = setting(50.0, env="RELAYGR_SLO_MS", help="ranking P99 SLO", check=positive)
    risk_fraction: float = setting(0.5, env="RELAYGR_RISK_FRACTION",
                                   help="at risk when predicted full ranking > this x SLO x (1 - the "
                                   "instance's offered load)", check=fraction)  # fmt: skip
    load_window_s: float = setting(2.0, env="RELAYGR_LOAD_WINDOW_S",
                                   help="time constant of each instance's offered-load estimate (the "
                                   "full ranking work routed to it, pre-inferred or not)", check=positive)  # fmt: skip
    footprint_fraction: float = setting(0.9, env="RELAYGR_FOOTPRINT_FRACTION",
                                        help="share of each ranker's HBM budget that admitted psi may fill",
                                        check=fraction)  # fmt: skip
    max_backlog: int = setting(8, env="RELAYGR_MAX_PREINFER_BACKLOG",
                               help="pre-inferences queued or running per ranker", check=positive)  # fmt: skip
    lease_slack_ms: float = setting(500.0, env="RELAYGR_LEASE_SLACK_MS",
                                    help="lease = ranking deadline + this", check=non_negative)  # fmt: skip
    load_factor: float = setting(0.25, env="RELAYGR_LOAD_FACTOR", help="bounded-load hashing slack (as the router)",
                                 check=non_negative)  # fmt: skip
    load_slack: float = setting(4.0, env="RELAYGR_LOAD_SLACK", help="bounded-load absolute slack (as the router)",
                                check=non_negative)  # fmt: skip
    stats_interval_s: float = setting(0.2, env="RELAYGR_STATS_INTERVAL_S", help="ranker Stats polling period",
                                      check=positive)  # fmt: skip
    preset: str = setting("tiny", env="RELAYGR_MODEL_PRESET", help="model preset (for the uncalibrated estimate)",
                          check=one_of(*PRESETS))  # fmt: skip
    assumed_tflops: float = setting(0.05, env="RELAYGR_ASSUMED_TFLOPS",
                                    help="device rate assumed until the rankers report measurements",
                                    check=positive)  # fmt: skip
    suffix_tokens_estimate: int = setting(320, env="RELAYGR_SUFFIX_TOKENS",
                                          help="recent + candidate tokens added to the prefix in the estimate",
                                          check=non_negative)  # fmt: skip
    report_interval_s: float = setting(10.0, env="RELAYGR_TRIGGER_REPORT_INTERVAL_S",
                                       help="period of the trigger_decisions log line (decision counts, latency "
                                       "model), logged only when something was decided", check=positive)  # fmt: skip
    record_attempts: int = setting(3, env="RELAYGR_TRIGGER_RECORD_ATTEMPTS",
                                   help="attempts to write a signal or dead letter the broker refused (then the "
                                   "signal is dead-lettered, the dead letter logged and skipped)", check=positive)  # fmt: skip
    retry_backoff_ms: float = setting(50.0, env="RELAYGR_TRIGGER_RETRY_BACKOFF_MS",
                                      help="first wait between attempts (doubles, at most 1 s)", check=positive)  # fmt: skip
    broker_retry_s: float = setting(30.0, env="RELAYGR_TRIGGER_BROKER_RETRY_S",
                                    help="how long writes are retried while the broker is unreachable",
                                    check=positive)  # fmt: skip
    drain_timeout_s: float = setting(10.0, env="RELAYGR_TRIGGER_DRAIN_TIMEOUT_S",
                                     help="at shutdown, longest wait for the batch in hand to be finished",
                                     check=positive)  # fmt: skip
    metrics_port: int = setting(0, env="RELAYGR_TRIGGER_METRICS_PORT", help="Prometheus port (0: pick)",
                                check=port_number)  # fmt: skip
    log_level: str = setting("info", env="RELAYGR_LOG_LEVEL", help="log level",
                             check=one_of("debug", "info", "warning", "error"))  # fmt: skip

    def validate(self) -> None:
        self.validate_tls()
        if not self.rankers and self.policy != "off":
            raise ConfigError("RELAYGR_RANKERS: at least one ranker is needed unless the policy is off")
