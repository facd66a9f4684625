"""Trigger configuration: every setting, its env var and CLI flag, validated at start-up.

Its own settings are RELAYGR_TRIGGER_*; the topics, the preset, the bounded-load parameters and the
longest lease are shared with other services (shared/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass

from services.trigger.admission import Policy
from shared import settings
from shared.config import ConfigError, fraction, non_negative, port_number, positive, setting, share
from shared.kafka import KafkaSettings
from shared.settings import LogLevel
from shared.tls import TlsSettings

# The settings the admission policy decides by (services/trigger/admission.py): the trigger logs
# them at start-up, and the capacity model (relaygr.sim) models a run's trigger by them.
ADMISSION_SETTINGS = (
    "slo_ms", "risk_fraction", "max_extra_work", "spare_busy_max", "spare_min_saving", "load_window_s",
    "prefetch", "reuse_window_s", "footprint_fraction", "max_backlog", "lease_slack_ms", "max_lease_ms",
    "stats_interval_s", "suffix_tokens_estimate", "host_cost", "spare_prices_waits", "spare_host_max",
)  # fmt: skip


@dataclass(frozen=True)
class TriggerConfig(KafkaSettings, TlsSettings):
    rankers: tuple[str, ...] = setting((), env="RELAYGR_RANKERS",
                                       help="ranker instances host:port, comma-separated (the router's membership)")  # fmt: skip
    retrieval_topic: str = settings.retrieval_topic()
    signal_topic: str = settings.signal_topic()
    dlq_topic: str = settings.dlq_topic()
    topic_partitions: int = settings.topic_partitions()
    group_id: str = setting("relaygr-trigger", env="RELAYGR_TRIGGER_GROUP_ID", help="consumer group",
                            renamed_from="RELAYGR_TRIGGER_GROUP")  # fmt: skip
    policy: Policy = setting(Policy.SEQUENCE_AWARE, env="RELAYGR_TRIGGER_POLICY",
                             help="sequence (the trigger) | all (pre-infer everything) | off (never)")  # fmt: skip
    slo_ms: float = setting(50.0, env="RELAYGR_TRIGGER_SLO_MS", help="ranking P99 SLO", check=positive,
                            renamed_from="RELAYGR_SLO_MS")  # fmt: skip
    risk_fraction: float = setting(0.5, env="RELAYGR_TRIGGER_RISK_FRACTION",
                                   renamed_from="RELAYGR_RISK_FRACTION",
                                   help="at risk when predicted full ranking > this x SLO x (1 - the "
                                   "instance's offered load)", check=fraction)  # fmt: skip
    max_extra_work: float = setting(0.15, env="RELAYGR_TRIGGER_MAX_EXTRA_WORK",
                                    help="a call at risk is pre-inferred only if pre-inference plus the call "
                                    "against psi cost the device at most 1 + this times its full ranking "
                                    "(measured costs); admission by reuse is not bound by it", check=non_negative)  # fmt: skip
    spare_busy_max: float = setting(0.8, env="RELAYGR_TRIGGER_SPARE_BUSY_MAX",
                                    help="pre-infer a user seen for the first time, whatever the work terms "
                                    "say, while the instance's device is busy less than this share of the "
                                    "time (its own report, pre-inference included): the prefix leaves the "
                                    "critical path for idle device time (0: never)", check=share)  # fmt: skip
    host_cost: bool = setting(True, env="RELAYGR_TRIGGER_HOST_COST",
                              help="price every request the work and reuse tests weigh (a pre-inference "
                              "signal, a call against psi, a full ranking) at its device time plus what a "
                              "request costs the ranker's host (StatsReply.host_ms_per_request; false: "
                              "device time only). Measured on an H200 in one run each (k12a, k12b): at 4096 "
                              "tokens the relay met 225 req/s without it and at least 250 with it (the "
                              "baseline 250); at 16384 tokens both admitted the same pre-inferences (by "
                              "the spare term) and met 42.2 and 38.0, one step of the search apart")  # fmt: skip
    spare_host_max: float = setting(0.6, env="RELAYGR_TRIGGER_SPARE_HOST_MAX",
                                    help="the spare term also needs the instance's host to have room: its "
                                    "requests' share of one core (its reported host ms per request x its "
                                    "ranking calls per second) under this (0: the device alone decides; "
                                    "admission.host_has_spare). On an H100's length mix (k28b, one call) "
                                    "0.6 met the same limit as 0 (390.6 req/s) with P99 14.5 / 14.1 / 19.8 ms "
                                    "against 18.1 / 18.6 / 43.4 at 250 / 312.5 / 390.6 req/s: 11-18 spare "
                                    "pre-inferences a point instead of 28-60, whose steps held 36-58 calls "
                                    "instead of 61-283", check=non_negative)  # fmt: skip
    spare_min_saving: float = setting(0.1, env="RELAYGR_TRIGGER_SPARE_MIN_SAVING",
                                      help="the spare term admits only where the call against psi is measured "
                                      "to save at least this share of the SLO against the full ranking (at "
                                      "4096 tokens on an H200: 1.5-2.5 ms of 50, too little to pay for the "
                                      "pre-inference's joins and extra work; at 8192, 6-7 ms)", check=share)  # fmt: skip
    spare_prices_waits: bool = setting(True, env="RELAYGR_TRIGGER_SPARE_PRICES_WAITS",
                                       help="the spare term admits only where what pre-inferring saves (the full "
                                       "ranking less the call against psi, and the waits the full ranking would "
                                       "impose on other calls less the call's) exceeds the waits its "
                                       "pre-inference imposes (the instance's call rate x the time squared / 2: "
                                       "nothing preempts a step). On the mix on an H200 (k14b, 300 req/s) spare "
                                       "pre-inferences saved ~8 ms each and held other calls ~19 ms each; "
                                       "false: saving and busy share only")  # fmt: skip
    load_window_s: float = setting(2.0, env="RELAYGR_TRIGGER_LOAD_WINDOW_S",
                                   renamed_from="RELAYGR_LOAD_WINDOW_S",
                                   help="time constant of each instance's offered-load estimate (the "
                                   "full ranking work routed to it, pre-inferred or not)", check=positive)  # fmt: skip
    prefetch: bool = setting(False, env="RELAYGR_TRIGGER_PREFETCH",
                             help="a returning user not admitted for pre-inference gets a prefetch-only "
                             "signal: the ranker re-leases its psi in HBM or reloads it from host DRAM "
                             "ahead of the call, never computes it; the signal names the prefix (user, version, "
                             "fingerprint), it does not carry it (off until measured on a GPU: one more call "
                             "per returning user on the ranker's event loop)")  # fmt: skip
    reuse_window_s: float = setting(600.0, env="RELAYGR_TRIGGER_REUSE_WINDOW_S",
                                    help="an event whose (user, prefix version) was seen within this many "
                                    "seconds is a return; from the share of returns, also admit where "
                                    "pre-inference saves device time over the calls expected on the psi "
                                    "(0: admit by risk only)", check=non_negative)  # fmt: skip
    footprint_fraction: float = setting(0.9, env="RELAYGR_TRIGGER_FOOTPRINT_FRACTION",
                                        renamed_from="RELAYGR_FOOTPRINT_FRACTION",
                                        help="share of each ranker's HBM budget that admitted psi may fill",
                                        check=fraction)  # fmt: skip
    max_backlog: int = setting(32, env="RELAYGR_TRIGGER_MAX_BACKLOG",
                               renamed_from="RELAYGR_MAX_PREINFER_BACKLOG",
                               help="pre-inferences queued or running per ranker, at most (an admission "
                               "must also be predicted to start before its ranking call: too_late)",
                               check=positive)  # fmt: skip
    lease_slack_ms: float = setting(500.0, env="RELAYGR_TRIGGER_LEASE_SLACK_MS",
                                    renamed_from="RELAYGR_LEASE_SLACK_MS",
                                    help="lease = ranking deadline + this", check=non_negative)  # fmt: skip
    # A pre-inference's psi bytes stay reserved in the ledger until its lease ends: an event whose
    # deadline is far off would otherwise hold them (and crowd out others) until then.
    max_lease_ms: float = settings.max_lease_ms()
    load_factor: float = settings.load_factor()
    load_slack: float = settings.load_slack()
    stats_interval_s: float = setting(0.2, env="RELAYGR_TRIGGER_STATS_INTERVAL_S", help="ranker Stats polling period",
                                      check=positive, renamed_from="RELAYGR_STATS_INTERVAL_S")  # fmt: skip
    preset: str = settings.model_preset()
    assumed_tflops: float = setting(0.05, env="RELAYGR_TRIGGER_ASSUMED_TFLOPS",
                                    renamed_from="RELAYGR_ASSUMED_TFLOPS",
                                    help="device rate assumed until the rankers report measurements",
                                    check=positive)  # fmt: skip
    suffix_tokens_estimate: int = setting(320, env="RELAYGR_TRIGGER_SUFFIX_TOKENS",
                                          renamed_from="RELAYGR_SUFFIX_TOKENS",
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
    log_level: LogLevel = settings.log_level("trigger")

    def validate(self) -> None:
        self.validate_tls()
        if self.lease_slack_ms >= self.max_lease_ms:
            raise ConfigError(
                "RELAYGR_TRIGGER_LEASE_SLACK_MS must be below RELAYGR_MAX_LEASE_MS (a lease is capped at the max)"
            )
        if not self.rankers and self.policy is not Policy.OFF:
            raise ConfigError("RELAYGR_RANKERS: at least one ranker is needed unless the policy is off")
