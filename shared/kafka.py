"""Kafka clients for the services: one settings type, producer / consumer / topic factories.

Security settings (TLS files, SASL) are passed through to aiokafka unchanged; the password is
never logged (KafkaSettings' repr hides it). Session timing is configurable because a consumer
group join takes about session_timeout_ms / 2 on Tansu, and real Kafka refuses values under its
group.min.session.timeout.ms (6000 by default).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, TopicAlreadyExistsError
from aiokafka.helpers import create_ssl_context

from shared.config import setting


@dataclass(frozen=True)
class KafkaSettings:
    """Embedded in each service's config; env vars are shared by every service."""

    bootstrap: str = setting("127.0.0.1:9092", env="RELAYGR_KAFKA_BOOTSTRAP", help="Kafka bootstrap servers")
    security_protocol: str = setting("PLAINTEXT", env="RELAYGR_KAFKA_SECURITY_PROTOCOL",
                                     help="PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL")  # fmt: skip
    ssl_cafile: str = setting("", env="RELAYGR_KAFKA_SSL_CAFILE", help="CA bundle for TLS")
    ssl_certfile: str = setting("", env="RELAYGR_KAFKA_SSL_CERTFILE", help="client certificate for TLS")
    ssl_keyfile: str = setting("", env="RELAYGR_KAFKA_SSL_KEYFILE", help="client key for TLS")
    sasl_mechanism: str = setting(
        "", env="RELAYGR_KAFKA_SASL_MECHANISM", help="PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512"
    )
    sasl_username: str = setting("", env="RELAYGR_KAFKA_SASL_USERNAME", help="SASL user")
    sasl_password: str = field(
        default="",
        repr=False,
        metadata={
            "env": "RELAYGR_KAFKA_SASL_PASSWORD",
            "help": "SASL password (never logged)",
            "check": None,
        },
    )
    session_timeout_ms: int = setting(2000, env="RELAYGR_KAFKA_SESSION_TIMEOUT_MS",
                                      help="consumer group session timeout (real Kafka: >= 6000)")  # fmt: skip
    heartbeat_interval_ms: int = setting(300, env="RELAYGR_KAFKA_HEARTBEAT_MS", help="consumer heartbeat")
    # Tansu does not answer a waiting fetch when data arrives: a consumer sees each record only
    # when fetch_max_wait_ms runs out (aiokafka's 500 ms default put ~250 ms on every hop).
    fetch_max_wait_ms: int = setting(5, env="RELAYGR_KAFKA_FETCH_MAX_WAIT_MS",
                                     help="longest a fetch waits for data (the signal path's per-hop latency on Tansu)")  # fmt: skip

    def client_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap,
            "security_protocol": self.security_protocol,
        }
        if "SSL" in self.security_protocol:
            args["ssl_context"] = create_ssl_context(
                cafile=self.ssl_cafile or None,
                certfile=self.ssl_certfile or None,
                keyfile=self.ssl_keyfile or None,
            )
        if "SASL" in self.security_protocol:
            args.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_username,
                sasl_plain_password=self.sasl_password,
            )
        return args


def make_producer(settings: KafkaSettings, **overrides: Any) -> AIOKafkaProducer:
    """acks=all, no idempotence (Tansu rejects the idempotent producer; consumers dedupe by id)."""
    return AIOKafkaProducer(**(settings.client_args() | {"acks": "all", "linger_ms": 1} | overrides))


def make_consumer(
    settings: KafkaSettings, topics: list[str], group_id: str, **overrides: Any
) -> AIOKafkaConsumer:
    """Manual commits, from the earliest offset of a new group."""
    return AIOKafkaConsumer(
        *topics,
        **settings.client_args(),
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=settings.session_timeout_ms,
        heartbeat_interval_ms=settings.heartbeat_interval_ms,
        fetch_max_wait_ms=settings.fetch_max_wait_ms,
        **overrides,
    )


async def ensure_topics(settings: KafkaSettings, topics: dict[str, int], timeout_s: float = 30.0) -> None:
    """Creates missing topics ({name: partitions}); existing ones are left as they are. Retries
    while the broker is unreachable (it may be starting or restarting)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        admin = AIOKafkaAdminClient(**settings.client_args())
        try:
            await admin.start()
            existing = set(await admin.list_topics())
            new = [NewTopic(n, p, 1) for n, p in topics.items() if n not in existing]
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
