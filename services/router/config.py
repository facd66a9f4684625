"""RouterConfig: the router's settings (flags over RELAYGR_ROUTER_* env vars over defaults).

Kafka settings (bootstrap, TLS, SASL, session timing) are inherited from KafkaSettings and read
from the RELAYGR_KAFKA_* variables every service shares. The settings another service must agree
with are defined once in shared/settings.py: the prefix limit (as the rankers: the router must not
accept signals they would reject, nor reject ones they would accept), the load bound (as the
trigger: placement agrees across router replicas and the trigger only when they all use the same
values), the default lease (as the rankers) and the topics.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared import settings
from shared.config import ConfigError, non_negative, port_number, positive, setting
from shared.kafka import KafkaSettings
from shared.settings import LogLevel
from shared.tls import TlsSettings
from shared.wire import RequestLimits


def _targets(value: tuple[str, ...]) -> str | None:
    if not value:
        return "required: at least one ranker target host:port (comma-separated)"
    bad = []
    for target in value:
        host, sep, port = target.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            bad.append(target)
    if bad:
        return f"not host:port: {', '.join(bad)}"
    if len(set(value)) != len(value):
        return "targets must be distinct"
    return None


def _positive_int(value: int) -> str | None:
    return None if value >= 1 else "must be >= 1"


_MAX_HEADER_BYTES = 16 << 20  # HTTP/2 cannot announce more sensibly; nor should a router hold it


def _header_bytes(value: int) -> str | None:
    return None if 1024 <= value <= _MAX_HEADER_BYTES else f"must be 1024-{_MAX_HEADER_BYTES} bytes"


class Placement(enum.StrEnum):
    AFFINITY = "affinity"  # residency, then bounded-load rendezvous hashing
    ROUND_ROBIN = "round_robin"  # the no-affinity ablation (ranking calls only)


class FrontDoor(enum.StrEnum):
    RELAY = "relay"  # the hand-written HTTP/2 frame relay
    GRPC = "grpc"  # the gRPC server serves everything


@dataclass(frozen=True)
class RouterConfig(KafkaSettings, TlsSettings):
    host: str = setting("127.0.0.1", env="RELAYGR_ROUTER_HOST", help="gRPC bind address")
    port: int = setting(
        0, env="RELAYGR_ROUTER_PORT", help="gRPC port (0: pick a free one)", check=port_number
    )
    rankers: tuple[str, ...] = setting(
        (), env="RELAYGR_RANKERS", help="ranker targets host:port, comma-separated (required)",
        check=_targets,
    )  # fmt: skip
    signal_topic: str = settings.signal_topic()
    dlq_topic: str = settings.dlq_topic()
    group_id: str = setting("relaygr-router", env="RELAYGR_ROUTER_GROUP_ID", help="Kafka consumer group")
    consume_signals: bool = setting(
        True, env="RELAYGR_ROUTER_CONSUME_SIGNALS", help="consume pre-infer signals from Kafka"
    )
    topic_partitions: int = settings.topic_partitions()
    signal_concurrency: int = setting(
        64, env="RELAYGR_ROUTER_SIGNAL_CONCURRENCY", help="signals forwarded at once (distinct users)",
        check=_positive_int,
    )  # fmt: skip
    signal_batch: int = setting(
        500, env="RELAYGR_ROUTER_SIGNAL_BATCH", help="most signals per consumed batch (one commit each)",
        check=_positive_int,
    )  # fmt: skip
    signal_retries: int = setting(
        3, env="RELAYGR_ROUTER_SIGNAL_RETRIES",
        help="tries to forward a signal while no instance takes it, before it is counted lost",
        check=_positive_int,
    )  # fmt: skip
    placement: Placement = setting(
        Placement.AFFINITY, env="RELAYGR_ROUTER_PLACEMENT",
        help="affinity (residency, then bounded-load rendezvous hashing) | round_robin (ranking calls "
        "ignore affinity: the no-affinity ablation; pre-infer signals still hash)",
    )  # fmt: skip
    load_factor: float = settings.load_factor()
    load_slack: float = settings.load_slack()
    check_interval_s: float = setting(
        0.2,
        env="RELAYGR_ROUTER_CHECK_INTERVAL_S",
        help="health / load poll period per ranker",
        check=positive,
    )
    check_timeout_ms: float = setting(
        250.0, env="RELAYGR_ROUTER_CHECK_TIMEOUT_MS", help="deadline of one health check / Stats poll",
        check=positive,
    )  # fmt: skip
    fail_after: int = setting(
        2, env="RELAYGR_ROUTER_FAIL_AFTER", help="consecutive failed checks before a ranker is dropped",
        check=_positive_int,
    )  # fmt: skip
    rank_attempt_timeout_ms: float = setting(
        2000.0, env="RELAYGR_ROUTER_RANK_ATTEMPT_TIMEOUT_MS",
        help="cap on one forwarding attempt, so a frozen instance costs a retry, not the caller's whole "
        "deadline (0: no cap)",
        check=non_negative,
    )  # fmt: skip
    overload_retries: int = setting(
        1, env="RELAYGR_ROUTER_OVERLOAD_RETRIES",
        help="other instances tried after an instance answers RESOURCE_EXHAUSTED (0: none)", check=non_negative,
    )  # fmt: skip
    rank_by_reference: bool = setting(
        True, env="RELAYGR_ROUTER_RANK_BY_REFERENCE",
        help="forward a ranking call to the instance holding its psi (residency map) with its prefix "
        "replaced by a reference: the prefix is neither sent nor decoded again on a hit; an instance "
        "that no longer has the psi answers prefix_required and gets the whole call",
    )  # fmt: skip
    front_door: FrontDoor = setting(
        FrontDoor.RELAY, env="RELAYGR_ROUTER_FRONT_DOOR",
        help="relay: an HTTP/2 frame relay serves Rank on the public port (with the RELAYGR_TLS_* "
        "mutual TLS when set) and passes every other call to the router's gRPC server on loopback "
        "(about half the CPU per routed call); grpc: the gRPC server serves everything",
    )  # fmt: skip
    default_timeout_ms: float = setting(
        10_000.0, env="RELAYGR_ROUTER_DEFAULT_TIMEOUT_MS", help="deadline of a call whose caller set none",
        check=positive,
    )  # fmt: skip
    preinfer_timeout_ms: float = setting(
        1_000.0, env="RELAYGR_ROUTER_PREINFER_TIMEOUT_MS", help="deadline of a PreInfer forwarded from a signal",
        check=positive,
    )  # fmt: skip
    default_lease_ms: float = settings.default_lease_ms(renamed_from="RELAYGR_ROUTER_DEFAULT_LEASE_MS")
    residency_max_entries: int = setting(
        1_000_000, env="RELAYGR_ROUTER_RESIDENCY_MAX_ENTRIES", help="users tracked in the residency map",
        check=_positive_int,
    )  # fmt: skip
    max_prefix_tokens: int = settings.max_prefix_tokens()
    metrics_port: int = setting(
        0, env="RELAYGR_ROUTER_METRICS_PORT", help="Prometheus port (0: pick)", check=port_number
    )
    log_level: LogLevel = settings.log_level("router")
    max_message_mb: float = setting(
        64.0, env="RELAYGR_ROUTER_MAX_MESSAGE_MB", help="gRPC message size limit", check=positive
    )
    # Front-door abuse limits (issue 12): what one call or one client connection may cost.
    max_header_list_bytes: int = setting(
        65_536, env="RELAYGR_ROUTER_MAX_HEADER_LIST_BYTES",
        help="largest request header list (metadata; HTTP/2's size: name + value + 32 per field); a call "
        "over it fails alone with RESOURCE_EXHAUSTED, its connection goes on (both front doors)",
        check=_header_bytes,
    )  # fmt: skip
    max_header_block_bytes: int = setting(
        262_144, env="RELAYGR_ROUTER_MAX_HEADER_BLOCK_BYTES",
        help="relay front door: a header block (HEADERS + CONTINUATIONs, compressed) over this closes its "
        "connection with ENHANCE_YOUR_CALM (the memory one connection may hold for headers); "
        ">= RELAYGR_ROUTER_MAX_HEADER_LIST_BYTES",
        check=_header_bytes,
    )  # fmt: skip
    reset_burst: int = setting(
        1000, env="RELAYGR_ROUTER_RESET_BURST",
        help="relay front door: streams one client connection may reset (RST_STREAM) or have refused "
        "in a burst before it is closed with ENHANCE_YOUR_CALM (rapid reset, CVE-2023-44487)",
        check=_positive_int,
    )  # fmt: skip
    reset_rate_per_s: float = setting(
        100.0, env="RELAYGR_ROUTER_RESET_RATE_PER_S",
        help="relay front door: the sustained rate of such streams allowed per connection", check=positive,
    )  # fmt: skip

    def validate(self) -> None:
        self.validate_tls()
        if self.max_header_block_bytes < self.max_header_list_bytes:
            raise ConfigError(
                "RELAYGR_ROUTER_MAX_HEADER_BLOCK_BYTES must be >= RELAYGR_ROUTER_MAX_HEADER_LIST_BYTES "
                "(else a header list within the limit could close its connection)"
            )
        if self.consume_signals and self.signal_topic == self.dlq_topic:
            raise ConfigError("RELAYGR_SIGNAL_TOPIC and RELAYGR_DLQ_TOPIC must differ")

    @property
    def relay_front_door(self) -> bool:
        """Whether an HTTP/2 relay (hand-written or h2's) owns the public port, the gRPC server
        then listening on loopback for it (see front_door)."""
        return self.front_door != FrontDoor.GRPC

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(max_prefix_tokens=self.max_prefix_tokens)
