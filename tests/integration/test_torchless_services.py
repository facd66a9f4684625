"""The router, the trigger and the expander serve with torch unimportable, as they would from
`pip install relaygr[router]` (or [trigger], [expander]), which does not pull torch.

Each starts as a real process (`python -m services.<name>`) whose PYTHONPATH puts a sitecustomize
first that makes every `import torch` raise ImportError, then is checked to serve: the router's
gRPC health reports SERVING (its ranker is a bare gRPC health server in this process), the
trigger consumes a retrieval event from the embedded broker and dead-letters it (it is malformed),
and the expander answers a client's hello, stats and reserve over its sockets.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from relaygr.processes import REPO, ServiceProcess
from shared.broker import EmbeddedBroker
from shared.expander.client import ExpanderClient
from shared.expander.entries import EntryKey
from shared.kafka import KafkaSettings, make_producer

pytestmark = pytest.mark.integration

STARTUP_S = 60.0
BLOCKER = textwrap.dedent(
    """
    # Installed by tests/integration/test_torchless_services.py: torch cannot be imported here.
    import importlib.abc
    import sys


    class _NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} is unimportable in this test (a torch-less install)")
            return None


    sys.meta_path.insert(0, _NoTorch())
    """
)


@pytest.fixture(scope="module")
def torchless_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a child in which `import torch` raises ImportError."""
    site = tmp_path_factory.mktemp("no-torch")
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYGR_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    return env


@pytest.fixture(scope="module")
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker.start() as running:
        yield running


@pytest.fixture
async def fake_ranker() -> AsyncIterator[str]:
    """A gRPC server that answers health checks as a serving ranker: enough for the router's
    membership to count it, without a model (or torch) in the picture."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("relaygr.v1.Ranker", health_pb2.HealthCheckResponse.SERVING)
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def wait_event(process: ServiceProcess, event: str) -> dict[str, object]:
    """ServiceProcess.wait_event off the event loop (it blocks on the child's log)."""
    return await asyncio.to_thread(process.wait_event, event, STARTUP_S)


def test_the_blocker_makes_torch_unimportable(torchless_env):
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=torchless_env, capture_output=True,
                           text=True, timeout=60, check=False)  # fmt: skip
    assert probe.returncode != 0
    assert "unimportable in this test" in probe.stderr


async def test_router_serves_without_torch(torchless_env, broker, fake_ranker):
    router = ServiceProcess("services.router", "--rankers", fake_ranker, "--bootstrap", broker.bootstrap,
                            "--port", "0", "--front-door", "grpc", env=torchless_env)  # fmt: skip
    try:
        port = int((await wait_event(router, "router_ready"))["port"])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="relaygr.v1.Router"), timeout=10
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert router.proc.poll() is None
    finally:
        status = router.stop(10.0)
    assert status == 0, "the router did not stop cleanly on SIGTERM"


async def test_trigger_consumes_an_event_without_torch(torchless_env, broker, fake_ranker):
    topic = "it.torchless.retrieval"
    trigger = ServiceProcess("services.trigger", "--rankers", fake_ranker, "--bootstrap", broker.bootstrap,
                             "--retrieval-topic", topic, "--signal-topic", "it.torchless.signals",
                             "--dlq-topic", "it.torchless.dlq", "--topic-partitions", "1",
                             "--group-id", "it-torchless", env=torchless_env)  # fmt: skip
    try:
        await wait_event(trigger, "trigger_ready")  # it has created its topics by then
        settings = KafkaSettings(bootstrap=broker.bootstrap)
        producer = make_producer(settings)
        await producer.start()
        try:
            await producer.send_and_wait(topic, b"not a retrieval event", key=b"user-1")
        finally:
            await producer.stop()
        record = await wait_event(trigger, "event_dead_lettered")
        assert record["offset"] == 0
        assert trigger.proc.poll() is None
    finally:
        status = trigger.stop(10.0)
    assert status == 0, "the trigger did not stop cleanly on SIGTERM"


async def test_expander_serves_a_client_without_torch(torchless_env, tmp_path: Path):
    socket_path = str(tmp_path / "run" / "expander.sock")
    expander = ServiceProcess("services.expander", "--socket-path", socket_path, "--arena-bytes",
                              str(16 << 20), env=torchless_env)  # fmt: skip
    try:
        await wait_event(expander, "expander_ready")
        client = await ExpanderClient.connect(socket_path)
        try:
            reservation = await client.reserve(EntryKey(1, 1, "m", 0), 4096)
            assert reservation.nbytes == 4096
            stats = await client.stats()
            assert stats.capacity == 16 << 20
            assert stats.writing == 1
        finally:
            await client.close()
    finally:
        status = expander.stop(10.0)
    assert status == 0, "the expander did not stop cleanly on SIGTERM"
