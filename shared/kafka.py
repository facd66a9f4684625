"""Kafka clients for the services: one settings type, producer / consumer / topic factories.

Security settings (TLS files, SASL) are passed through to aiokafka unchanged, to the producer,
the consumer and the admin client alike (`client_args`); they are checked when the settings are
built, so a service with inconsistent ones fails at start-up with a clear message. The SASL
password is a `Secret`: masked in reprs, ConfigErrors and structured logs (even of the whole
settings object), revealed only to aiokafka. Session timing is configurable because a consumer
group join takes about session_timeout_ms / 2 on Tansu, and real Kafka refuses values under its
group.min.session.timeout.ms (6000 by default).

Record sizes (shared/wire.py states the limits): topics created here get max.message.bytes =
`max_record_bytes`; producers may send that plus a dead letter's headroom; consumers fetch that
much per partition. `record_limits` reads what the broker says of existing topics (describe_configs:
real Kafka reports every topic's max.message.bytes; Tansu reports only what a topic was created
with, and enforces nothing), so a service sizes its producer after the topics it writes to.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaConnectionError, TopicAlreadyExistsError
from aiokafka.helpers import create_ssl_context

from shared.config import ConfigError, Secret, non_negative, one_of, positive, setting
from shared.wire import DEAD_LETTER_HEADROOM_BYTES, DEFAULT_MAX_RECORD_BYTES

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
# The mechanisms that need only a user name and password (aiokafka's sasl_plain_* arguments).
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
MAX_MESSAGE_BYTES = "max.message.bytes"  # the topic config that bounds a record batch
_MIN_RECORD_BYTES = 64 << 10


def _record_bytes(value: int) -> str | None:
    return None if value >= _MIN_RECORD_BYTES else f"must be >= {_MIN_RECORD_BYTES}"


@dataclass(frozen=True)
class KafkaSettings:
    """Embedded in each service's config; env vars are shared by every service."""

    bootstrap: str = setting("127.0.0.1:9092", env="RELAYGR_KAFKA_BOOTSTRAP", help="Kafka bootstrap servers")
    security_protocol: str = setting("PLAINTEXT", env="RELAYGR_KAFKA_SECURITY_PROTOCOL",
                                     help="PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL",
                                     check=one_of(*SECURITY_PROTOCOLS))  # fmt: skip
    ssl_cafile: str = setting("", env="RELAYGR_KAFKA_SSL_CAFILE", help="CA bundle for TLS")
    ssl_certfile: str = setting("", env="RELAYGR_KAFKA_SSL_CERTFILE", help="client certificate for TLS")
    ssl_keyfile: str = setting("", env="RELAYGR_KAFKA_SSL_KEYFILE", help="client key for TLS")
    sasl_mechanism: str = setting("", env="RELAYGR_KAFKA_SASL_MECHANISM",
                                  help="PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512 (SASL_* protocols)",
                                  check=one_of("", *SASL_MECHANISMS))  # fmt: skip
    sasl_username: str = setting("", env="RELAYGR_KAFKA_SASL_USERNAME", help="SASL user")
    # setting() returns a dataclasses.field and a Secret is immutable: a shared default is safe.
    sasl_password: Secret = setting(Secret(""), env="RELAYGR_KAFKA_SASL_PASSWORD",
                                    help="SASL password (never logged; prefer the env var: flags show in ps)")  # fmt: skip
    session_timeout_ms: int = setting(2000, env="RELAYGR_KAFKA_SESSION_TIMEOUT_MS",
                                      help="consumer group session timeout (real Kafka: >= 6000)")  # fmt: skip
    heartbeat_interval_ms: int = setting(300, env="RELAYGR_KAFKA_HEARTBEAT_MS", help="consumer heartbeat")
    # Tansu does not answer a waiting fetch when data arrives: a consumer sees each record only
    # when fetch_max_wait_ms runs out (aiokafka's 500 ms default put ~250 ms on every hop).
    fetch_max_wait_ms: int = setting(5, env="RELAYGR_KAFKA_FETCH_MAX_WAIT_MS",
                                     help="longest a fetch waits for data (the signal path's per-hop latency on Tansu)")  # fmt: skip
    commit_interval_ms: int = setting(100, env="RELAYGR_KAFKA_COMMIT_INTERVAL_MS",
                                      help="consumers commit the offsets of finished records together at most "
                                      "this often (and when nothing new comes); 0: after every batch. A record "
                                      "finished but not yet committed is read again after a restart or a "
                                      "rebalance (at-least-once)", check=non_negative)  # fmt: skip
    # aiokafka's default. A request to a broker that died with it in flight is awaited this long:
    # the stacks on the embedded broker lower it (relaygr/launcher.py), whose restarts left a
    # consumer's SyncGroup unanswered in about one restart in ten. Consumers' rebalance timeout
    # is 3/4 of it, as aiokafka's defaults (40 s, 30 s): a broker may hold a JoinGroup that long.
    request_timeout_ms: int = setting(40000, env="RELAYGR_KAFKA_REQUEST_TIMEOUT_MS",
                                      help="longest a broker request is awaited (consumers' rebalance timeout: 3/4)",
                                      check=positive)  # fmt: skip
    max_record_bytes: int = setting(DEFAULT_MAX_RECORD_BYTES, env="RELAYGR_KAFKA_MAX_RECORD_BYTES",
                                    help="max.message.bytes of the topics the services create, and the record "
                                    "limit assumed where the broker reports none", check=_record_bytes)  # fmt: skip

    def __post_init__(self) -> None:
        """Checks the security settings as a whole (each field alone is checked by load_config)."""
        if isinstance(self.sasl_password, str):  # built in code with a plain string
            object.__setattr__(self, "sasl_password", Secret(self.sasl_password))
        if self.security_protocol not in SECURITY_PROTOCOLS:
            raise ConfigError(
                f"RELAYGR_KAFKA_SECURITY_PROTOCOL must be one of {', '.join(SECURITY_PROTOCOLS)}"
            )
        if self.uses_sasl:
            if self.sasl_mechanism not in SASL_MECHANISMS:
                raise ConfigError(
                    f"security protocol {self.security_protocol} needs RELAYGR_KAFKA_SASL_MECHANISM "
                    f"({' | '.join(SASL_MECHANISMS)})"
                )
            if not self.sasl_username or not self.sasl_password:
                raise ConfigError(
                    f"security protocol {self.security_protocol} needs RELAYGR_KAFKA_SASL_USERNAME and "
                    "RELAYGR_KAFKA_SASL_PASSWORD"
                )
        if self.uses_ssl:
            for path in (self.ssl_cafile, self.ssl_certfile, self.ssl_keyfile):
                if path and not Path(path).is_file():
                    raise ConfigError(f"Kafka TLS file {path!r} does not exist")
            if self.ssl_keyfile and not self.ssl_certfile:
                raise ConfigError("RELAYGR_KAFKA_SSL_KEYFILE needs RELAYGR_KAFKA_SSL_CERTFILE")

    @property
    def uses_ssl(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def uses_sasl(self) -> bool:
        return self.security_protocol in ("SASL_PLAINTEXT", "SASL_SSL")

    def client_args(self) -> dict[str, Any]:
        """The connection and security arguments every aiokafka client takes (producer, consumer,
        admin). Contains the revealed password: never log it."""
        args: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap,
            "security_protocol": self.security_protocol,
            "request_timeout_ms": self.request_timeout_ms,
        }
        if self.uses_ssl:
            # No CA file: the system's trust store (create_ssl_context loads the defaults).
            args["ssl_context"] = create_ssl_context(
                cafile=self.ssl_cafile or None,
                certfile=self.ssl_certfile or None,
                keyfile=self.ssl_keyfile or None,
            )
        if self.uses_sasl:
            args.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_username,
                sasl_plain_password=self.sasl_password.reveal(),
            )
        return args


def producer_args(settings: KafkaSettings, **overrides: Any) -> dict[str, Any]:
    """acks=all, no idempotence (Tansu rejects the idempotent producer; consumers dedupe by id);
    records up to the record limit, dead letters (the original plus headers) included."""
    size = settings.max_record_bytes + DEAD_LETTER_HEADROOM_BYTES
    return settings.client_args() | {"acks": "all", "linger_ms": 1, "max_request_size": size} | overrides


def consumer_args(settings: KafkaSettings, group_id: str, **overrides: Any) -> dict[str, Any]:
    """Manual commits, from the earliest offset of a new group."""
    return (
        settings.client_args()
        | {
            "group_id": group_id,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "session_timeout_ms": settings.session_timeout_ms,
            "rebalance_timeout_ms": settings.request_timeout_ms * 3 // 4,
            "heartbeat_interval_ms": settings.heartbeat_interval_ms,
            "fetch_max_wait_ms": settings.fetch_max_wait_ms,
            # One fetch holds a record at the limit (a larger one still comes, alone, but slower).
            "max_partition_fetch_bytes": settings.max_record_bytes + DEAD_LETTER_HEADROOM_BYTES,
        }
        | overrides
    )


def admin_args(settings: KafkaSettings) -> dict[str, Any]:
    return settings.client_args()


def make_producer(settings: KafkaSettings, **overrides: Any) -> AIOKafkaProducer:
    return AIOKafkaProducer(**producer_args(settings, **overrides))


def make_consumer(
    settings: KafkaSettings, topics: list[str], group_id: str, **overrides: Any
) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(*topics, **consumer_args(settings, group_id, **overrides))


async def ensure_topics(settings: KafkaSettings, topics: dict[str, int], timeout_s: float = 30.0) -> None:
    """Creates missing topics ({name: partitions}) with max.message.bytes = the record limit plus
    a dead letter's headroom; existing ones are left as they are. Retries while the broker is
    unreachable (it may be starting or restarting)."""
    configs = {MAX_MESSAGE_BYTES: str(settings.max_record_bytes + DEAD_LETTER_HEADROOM_BYTES)}
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        admin = AIOKafkaAdminClient(**admin_args(settings))
        try:
            await admin.start()
            existing = set(await admin.list_topics())
            new = [NewTopic(n, p, 1, topic_configs=configs) for n, p in topics.items() if n not in existing]
            if new:
                with contextlib.suppress(TopicAlreadyExistsError):  # another service won the race
                    await admin.create_topics(new)
            return
        except KafkaConnectionError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)
        finally:
            await admin.close()


async def record_limits(settings: KafkaSettings, topics: list[str]) -> dict[str, int | None]:
    """Each topic's max.message.bytes as the broker reports it (None: the broker reports none, or
    could not be asked; the caller then assumes `settings.max_record_bytes`). Never raises for a
    broker that does not answer DescribeConfigs."""
    admin = AIOKafkaAdminClient(**admin_args(settings))
    try:
        await admin.start()
        replies = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, t, configs={MAX_MESSAGE_BYTES: None}) for t in topics]
        )
        return parse_record_limits(replies, topics)
    except Exception:  # an old or partial broker: fall back to the setting
        return dict.fromkeys(topics)
    finally:
        await admin.close()


def parse_record_limits(replies: list[Any], topics: list[str]) -> dict[str, int | None]:
    """max.message.bytes per topic from DescribeConfigs responses (any version: each resource is
    (error_code, error_message, type, name, entries), each entry (name, value, ...))."""
    limits: dict[str, int | None] = dict.fromkeys(topics)
    for reply in replies:
        for resource in reply.resources:
            error_code, _message, _type, name, entries = resource[:5]
            if error_code or name not in limits:
                continue
            for entry in entries:
                if entry[0] == MAX_MESSAGE_BYTES and entry[1] is not None and str(entry[1]).isdigit():
                    limits[name] = int(entry[1])
    return limits


class CommitPacer:
    """The offsets of finished records, committed together at most every `interval_s`, whenever
    a fetch finds nothing new, and at the end (`take`). A commit after every batch cost the
    trigger an OffsetCommit round trip, encoded and decoded in Python, for every fetch (Tansu
    answers each at its 5 ms wait): ~11% of its event loop's busy time (py-spy, build machine,
    300 events/s). A record finished but not committed when the consumer leaves is read again
    by the next member (at-least-once, as before; at most `interval_s` of records).
    Pure: the clock is passed in."""

    def __init__(self, interval_s: float) -> None:
        if interval_s < 0:
            raise ValueError("interval_s must be >= 0")
        self.interval_s = interval_s
        self._pending: dict[Any, int] = {}
        self._last = float("-inf")

    def finished(self, offsets: Mapping[Any, int]) -> None:
        """Partition -> the offset after its last finished record (a later batch's wins)."""
        self._pending.update(offsets)

    def due(self, now: float, idle: bool = False) -> dict[Any, int] | None:
        """The offsets to commit now (taken), or None: nothing pending, or the last commit was
        under `interval_s` ago while records keep coming (`idle`: the last fetch found none)."""
        if not self._pending or not (idle or now - self._last >= self.interval_s):
            return None
        self._last = now
        return self.take()

    def take(self) -> dict[Any, int]:
        """Every pending offset (e.g. at the end), cleared."""
        pending, self._pending = self._pending, {}
        return pending
