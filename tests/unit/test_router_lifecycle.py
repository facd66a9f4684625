"""The router as a process (shared/lifecycle.py): SIGTERM drains the calls in flight and exits 0;
the failure of a background task stops intake, drains and exits 1 instead of the router running on
without it; the process's exit status says which. The subprocess cases run with torch, triton and
kernels/ unimportable: the router needs none of them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.router.config import RouterConfig
from services.router.residency import ResidencyMap
from services.router.service import RouterService
from shared.broker import free_port
from shared.config import load_config
from shared.protos import ranker_pb2 as pb
from shared.protos import ranker_pb2_grpc as pb_grpc
from tests.unit.test_router_service import serve_healthy
from tests.unit.test_service_boundaries import BLOCK, ROOT

BOUND_S = 20.0  # upper bound for "eventually": never a speed claim


async def eventually(predicate, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, f"not within {BOUND_S}s: {what}"
        await asyncio.sleep(0.02)


def router_config(*targets: str) -> RouterConfig:
    return load_config(RouterConfig, ["--rankers", ",".join(targets), "--consume-signals", "false"])


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


class HeldRanker(pb_grpc.RankerServicer):
    """Holds every Rank call until `release` is set; `arrived` is set when one is in."""

    def __init__(self) -> None:
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.server = grpc.aio.server()
        pb_grpc.add_RankerServicer_to_server(self, self.server)

    async def Rank(self, request, context):
        self.arrived.set()
        await self.release.wait()
        return pb.RankReply(scores=[1.0], instance_id="held")

    async def Stats(self, request, context):
        return pb.StatsReply(instance_id="held")


async def test_a_failed_background_task_stops_the_router_with_status_1(monkeypatch):
    def broken_expire(self: ResidencyMap, now: float) -> int:
        raise RuntimeError("expiry broke")

    monkeypatch.setattr(ResidencyMap, "expire", broken_expire)
    router = RouterService(router_config(f"127.0.0.1:{free_port()}"))
    status = await asyncio.wait_for(router.run(install_signals=False), BOUND_S)
    assert status == 1
    assert router.life.failure is not None
    assert "residency-expire" in router.life.failure
    assert "expiry broke" in router.life.failure
    assert router.port  # it served,
    assert refuses_connections(router.port)  # then let go of its port


@pytest.mark.parametrize("front_door", ["grpc", "relay"])
async def test_sigterm_lets_the_call_in_flight_finish_and_exits_0(monkeypatch, front_door):
    monkeypatch.setenv("RELAYGR_ROUTER_FRONT_DOOR", front_door)
    ranker = HeldRanker()
    ranker_port = await serve_healthy(ranker.server)
    router = RouterService(router_config(f"127.0.0.1:{ranker_port}"))
    running = asyncio.create_task(router.run())
    channel = None
    try:
        await asyncio.wait_for(router.ready.wait(), BOUND_S)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
        call = asyncio.ensure_future(
            pb_grpc.RankerStub(channel).Rank(pb.RankRequest(request_id="r", user_id=1), timeout=BOUND_S)
        )
        await asyncio.wait_for(ranker.arrived.wait(), BOUND_S)
        os.kill(os.getpid(), signal.SIGTERM)
        await eventually(lambda: router.life.stopping, "SIGTERM seen")
        ranker.release.set()
        assert (await call).instance_id == "held"  # drained, not cut off
        assert await asyncio.wait_for(running, BOUND_S) == 0
        assert router.life.failure is None
        assert refuses_connections(router.port)
    finally:
        if not running.done():
            router.life.request_stop("test cleanup")
            await running
        if channel is not None:
            await channel.close()
        await ranker.server.stop(0)


def start_router_process(*patch: str) -> subprocess.Popen[str]:
    """`python -m services.router` against an unreachable ranker, torch blocked, after `patch`
    (lines of Python run first)."""
    code = "\n".join(
        [
            BLOCK,
            *patch,
            "import runpy",
            f"sys.argv = ['services.router', '--rankers', '127.0.0.1:{free_port()}', '--consume-signals', 'false']",
            "runpy.run_module('services.router', run_name='__main__', alter_sys=True)",
        ]
    )
    env = {**os.environ, "RELAYGR_ROUTER_LOG_LEVEL": "info"}
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )


def read_event(proc: subprocess.Popen[str], event: str) -> dict[str, object]:
    """The first JSON log line with this event (the lines before it are read and dropped)."""
    assert proc.stderr is not None
    for line in proc.stderr:  # ends when the process closes stderr (exits)
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == event:
                return record
    raise AssertionError(f"the router exited (status {proc.wait()}) without logging {event}")


def test_router_process_without_torch_serves_and_exits_0_on_sigterm():
    proc = start_router_process()
    try:
        ready = read_event(proc, "router_ready")
        with grpc.insecure_channel(f"127.0.0.1:{ready['port']}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="relaygr.v1.Router"), timeout=10
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=BOUND_S) == 0
    finally:
        proc.kill()
        proc.wait()


def test_router_process_exits_1_when_a_background_task_fails():
    proc = start_router_process(
        "from services.router.residency import ResidencyMap",
        "def expire(self, now):",
        "    raise RuntimeError('expiry broke')",
        "ResidencyMap.expire = expire",
    )
    try:
        failed = read_event(proc, "service_failed")
        assert "residency-expire" in str(failed["reason"])
        assert proc.wait(timeout=BOUND_S) == 1
    finally:
        proc.kill()
        proc.wait()
