"""Kafka security settings: TLS and SASL reach aiokafka's producer, consumer and admin client
unchanged (checked on the clients aiokafka builds, no broker needed), inconsistent settings fail
at start-up, and the SASL password appears in no repr, error or structured log."""

from __future__ import annotations

import dataclasses
import ssl
from pathlib import Path

import orjson
import pytest
import structlog
from aiokafka.admin import AIOKafkaAdminClient

from services.router.config import RouterConfig
from services.trigger.config import TriggerConfig
from shared.config import ConfigError, Secret, describe, load_config
from shared.kafka import (
    CommitPacer,
    KafkaSettings,
    admin_args,
    consumer_args,
    make_consumer,
    make_producer,
    producer_args,
)
from shared.logging import _dumps
from tests.certs import issue, make_ca

PASSWORD = "pa55-w0rd-that-must-not-leak"


def sasl_env(protocol: str, mechanism: str = "SCRAM-SHA-512") -> dict[str, str]:
    return {
        "RELAYGR_KAFKA_BOOTSTRAP": "kafka-1:9093,kafka-2:9093",
        "RELAYGR_KAFKA_SECURITY_PROTOCOL": protocol,
        "RELAYGR_KAFKA_SASL_MECHANISM": mechanism,
        "RELAYGR_KAFKA_SASL_USERNAME": "relaygr",
        "RELAYGR_KAFKA_SASL_PASSWORD": PASSWORD,
    }


def tls_env(tmp_path: Path) -> dict[str, str]:
    tls = issue(make_ca("kafka-test-ca"), "relaygr-client", tmp_path / "kafka")
    return {
        "RELAYGR_KAFKA_SSL_CAFILE": tls.tls_ca,
        "RELAYGR_KAFKA_SSL_CERTFILE": tls.tls_cert,
        "RELAYGR_KAFKA_SSL_KEYFILE": tls.tls_key,
    }


async def built_clients(settings: KafkaSettings) -> list[object]:
    """The AIOKafkaClient inside each client a service builds (constructed, never started)."""
    producer = make_producer(settings)
    consumer = make_consumer(settings, ["relaygr.retrieval"], "relaygr-trigger")
    admin = AIOKafkaAdminClient(**admin_args(settings))  # as ensure_topics builds it
    inner = [producer.client, consumer._client, admin._client]
    await producer.stop()  # never started: releases what the constructors allocated
    await consumer.stop()
    await admin.close()
    return inner


def test_plaintext_passes_no_security_arguments():
    args = KafkaSettings(bootstrap="k:9092").client_args()
    assert args == {
        "bootstrap_servers": "k:9092",
        "security_protocol": "PLAINTEXT",
        "request_timeout_ms": 40000,
    }


def test_the_request_timeout_reaches_every_client_and_bounds_the_consumers_rebalance():
    settings = KafkaSettings(bootstrap="k:9092", request_timeout_ms=5000)
    assert producer_args(settings)["request_timeout_ms"] == 5000
    assert admin_args(settings)["request_timeout_ms"] == 5000
    consumer = consumer_args(settings, "g")
    assert consumer["request_timeout_ms"] == 5000
    assert consumer["rebalance_timeout_ms"] == 3750  # under the request timeout: a held JoinGroup is answered


async def test_sasl_ssl_settings_reach_producer_consumer_and_admin(tmp_path):
    env = sasl_env("SASL_SSL") | tls_env(tmp_path)
    settings = load_config(TriggerConfig, ["--rankers", "127.0.0.1:1"], env=env)
    for args in (producer_args(settings), consumer_args(settings, "g"), admin_args(settings)):
        assert args["bootstrap_servers"] == "kafka-1:9093,kafka-2:9093"
        assert args["security_protocol"] == "SASL_SSL"
        assert args["sasl_mechanism"] == "SCRAM-SHA-512"
        assert args["sasl_plain_username"] == "relaygr"
        assert args["sasl_plain_password"] == PASSWORD
        assert isinstance(args["ssl_context"], ssl.SSLContext)
    for client in await built_clients(settings):
        assert client._bootstrap_servers == "kafka-1:9093,kafka-2:9093"
        assert client._security_protocol == "SASL_SSL"
        assert client._sasl_mechanism == "SCRAM-SHA-512"
        assert client._sasl_plain_username == "relaygr"
        assert client._sasl_plain_password == PASSWORD
        context = client._ssl_context
        assert context.verify_mode == ssl.CERT_REQUIRED
        assert context.check_hostname
        # The CA file was loaded (the only CA in the context: the system store is not added
        # when a CA file is given).
        issuers = [dict(x[0] for x in c["subject"]) for c in context.get_ca_certs()]
        assert issuers == [{"commonName": "kafka-test-ca"}]


async def test_ssl_without_sasl_and_sasl_without_ssl(tmp_path):
    tls_only = load_config(
        KafkaSettings, [], env={"RELAYGR_KAFKA_SECURITY_PROTOCOL": "SSL"} | tls_env(tmp_path)
    )
    args = tls_only.client_args()
    assert args["security_protocol"] == "SSL"
    assert isinstance(args["ssl_context"], ssl.SSLContext)
    assert not any(k.startswith("sasl") for k in args)
    plain = load_config(KafkaSettings, [], env=sasl_env("SASL_PLAINTEXT", mechanism="PLAIN"))
    args = plain.client_args()
    assert "ssl_context" not in args
    assert (args["sasl_mechanism"], args["sasl_plain_username"], args["sasl_plain_password"]) == (
        "PLAIN",
        "relaygr",
        PASSWORD,
    )
    for client in await built_clients(plain):
        assert client._security_protocol == "SASL_PLAINTEXT"
        assert client._sasl_mechanism == "PLAIN"
        assert client._sasl_plain_password == PASSWORD
        assert client._ssl_context is None


def test_overrides_keep_the_security_settings():
    settings = load_config(KafkaSettings, [], env=sasl_env("SASL_PLAINTEXT"))
    args = producer_args(settings, max_request_size=1 << 20, acks=1)
    assert args["acks"] == 1
    assert args["max_request_size"] == 1 << 20
    assert args["sasl_plain_password"] == PASSWORD


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"RELAYGR_KAFKA_SECURITY_PROTOCOL": "TLS"}, "must be one of"),
        ({"RELAYGR_KAFKA_SASL_MECHANISM": "GSSAPI"}, "must be one of"),
        (
            sasl_env("SASL_PLAINTEXT") | {"RELAYGR_KAFKA_SASL_MECHANISM": ""},
            "needs RELAYGR_KAFKA_SASL_MECHANISM",
        ),
        (
            sasl_env("SASL_PLAINTEXT") | {"RELAYGR_KAFKA_SASL_PASSWORD": ""},
            "needs RELAYGR_KAFKA_SASL_USERNAME",
        ),
        (
            sasl_env("SASL_PLAINTEXT") | {"RELAYGR_KAFKA_SASL_USERNAME": ""},
            "needs RELAYGR_KAFKA_SASL_USERNAME",
        ),
        (
            {"RELAYGR_KAFKA_SECURITY_PROTOCOL": "SSL", "RELAYGR_KAFKA_SSL_CAFILE": "/no/such/ca.pem"},
            "does not exist",
        ),
    ],
)
def test_inconsistent_security_settings_fail_at_start_up(env, problem):
    with pytest.raises(ConfigError, match=problem) as err:
        load_config(RouterConfig, ["--rankers", "127.0.0.1:1"], env=env)
    assert PASSWORD not in str(err.value)


def test_a_key_file_needs_a_certificate(tmp_path):
    env = {"RELAYGR_KAFKA_SECURITY_PROTOCOL": "SSL"} | tls_env(tmp_path)
    del env["RELAYGR_KAFKA_SSL_CERTFILE"]
    with pytest.raises(ConfigError, match="needs RELAYGR_KAFKA_SSL_CERTFILE"):
        load_config(KafkaSettings, [], env=env)


def test_the_password_is_never_shown():
    config = load_config(TriggerConfig, ["--rankers", "127.0.0.1:1"], env=sasl_env("SASL_PLAINTEXT"))
    assert isinstance(config.sasl_password, Secret)
    assert config.sasl_password.reveal() == PASSWORD
    assert PASSWORD not in repr(config)
    assert PASSWORD not in str(config)
    assert PASSWORD not in f"{config.sasl_password}"
    # A structured log line carrying the whole config, rendered as every service renders them.
    render = structlog.processors.JSONRenderer(serializer=_dumps)
    line = render(None, "info", {"event": "config", "config": config, "password": config.sasl_password})
    assert PASSWORD not in line
    assert orjson.loads(line)["config"]["sasl_username"] == "relaygr"  # the rest is still there
    assert orjson.loads(line)["password"] == "Secret('***')"
    # dataclasses.asdict (a dump of the settings) keeps the Secret masked, too.
    assert PASSWORD not in render(None, "info", {"event": "asdict", "config": dataclasses.asdict(config)})
    assert PASSWORD not in repr(describe(TriggerConfig))
    # A bad value elsewhere: the error lists problems, never the password.
    with pytest.raises(ConfigError) as err:
        load_config(
            TriggerConfig, ["--rankers", "127.0.0.1:1", "--slo-ms", "-1"], env=sasl_env("SASL_PLAINTEXT")
        )
    assert PASSWORD not in str(err.value)


def test_a_password_given_in_code_is_wrapped():
    settings = KafkaSettings(
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="PLAIN",
        sasl_username="u",
        sasl_password=PASSWORD,  # type: ignore[arg-type]
    )
    assert isinstance(settings.sasl_password, Secret)
    assert PASSWORD not in repr(settings)
    assert settings.client_args()["sasl_plain_password"] == PASSWORD


def test_a_secret_is_not_pickled():
    import pickle

    with pytest.raises(TypeError):
        pickle.dumps(Secret(PASSWORD))


def test_the_commit_pacer_commits_finished_offsets_together_and_when_the_partition_is_quiet():
    pacer = CommitPacer(0.1)
    assert pacer.due(0.0) is None  # nothing finished
    pacer.finished({"p0": 5})
    assert pacer.due(0.0) == {"p0": 5}  # the first commit comes at once
    pacer.finished({"p0": 9, "p1": 3})
    assert pacer.due(0.05) is None  # records keep coming: within the interval they wait
    pacer.finished({"p0": 12})
    assert pacer.due(0.11) == {"p0": 12, "p1": 3}  # together, each partition's latest
    pacer.finished({"p1": 4})
    assert pacer.due(0.12, idle=True) == {"p1": 4}  # a fetch found nothing: no reason to wait
    assert pacer.due(0.5, idle=True) is None
    pacer.finished({"p2": 1})
    assert pacer.take() == {"p2": 1}  # at the end, whatever the clock
    assert pacer.take() == {}
    every_batch = CommitPacer(0.0)  # RELAYGR_KAFKA_COMMIT_INTERVAL_MS=0: after every batch
    for offset in (1, 2, 3):
        every_batch.finished({"p0": offset})
        assert every_batch.due(1.0) == {"p0": offset}
    with pytest.raises(ValueError, match="interval_s"):
        CommitPacer(-1.0)
