"""shared.lifecycle.Lifecycle: the order of the hooks, exit statuses, and what a failed task does."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from shared.lifecycle import Lifecycle


class Recorder:
    """A service whose hooks record their order; options make each misbehave."""

    def __init__(self, life: Lifecycle, *, fail_start: bool = False, slow_drain_s: float = 0.0) -> None:
        self.life = life
        self.calls: list[str] = []
        self.fail_start = fail_start
        self.slow_drain_s = slow_drain_s
        self.started = asyncio.Event()
        self.drain_cancelled = False

    async def start(self) -> None:
        self.calls.append("start")
        if self.fail_start:
            raise OSError("port in use")
        self.started.set()

    async def stop_intake(self) -> None:
        self.calls.append("stop_intake")

    async def drain(self) -> None:
        self.calls.append("drain")
        try:
            await asyncio.sleep(self.slow_drain_s)
        except asyncio.CancelledError:
            self.drain_cancelled = True
            raise

    async def close(self) -> None:
        self.calls.append("close")


async def test_request_stop_runs_every_hook_in_order_and_exits_0() -> None:
    life = Lifecycle("svc")
    svc = Recorder(life)
    runner = asyncio.create_task(life.run(svc, install_signals=False))
    await svc.started.wait()
    life.request_stop("test")
    assert await runner == 0
    assert svc.calls == ["start", "stop_intake", "drain", "close"]
    assert life.failure is None


async def test_failed_background_task_stops_the_service_with_status_1() -> None:
    life = Lifecycle("svc")
    svc = Recorder(life)

    async def expiry_loop() -> None:
        await svc.started.wait()
        raise RuntimeError("expiry broke")

    async def healthy_loop() -> None:
        await asyncio.Event().wait()

    runner = asyncio.create_task(life.run(svc, install_signals=False))
    await svc.started.wait()
    healthy = life.spawn(healthy_loop(), "healthy")
    life.spawn(expiry_loop(), "expire")
    assert await asyncio.wait_for(runner, 5) == 1
    assert life.failure is not None
    assert "expire" in life.failure
    assert "expiry broke" in life.failure
    assert svc.calls == ["start", "stop_intake", "drain", "close"]
    assert healthy.cancelled()  # the other tasks are cancelled on the way out


async def test_background_task_that_returns_while_serving_is_a_failure() -> None:
    life = Lifecycle("svc")
    svc = Recorder(life)

    async def returns_early() -> None:
        return None

    runner = asyncio.create_task(life.run(svc, install_signals=False))
    await svc.started.wait()
    life.spawn(returns_early(), "poller")
    assert await asyncio.wait_for(runner, 5) == 1
    assert life.failure is not None
    assert "returned" in life.failure


async def test_failed_start_closes_and_exits_1_without_draining() -> None:
    life = Lifecycle("svc")
    svc = Recorder(life, fail_start=True)
    assert await life.run(svc, install_signals=False) == 1
    assert svc.calls == ["start", "close"]
    assert life.failure is not None
    assert "port in use" in life.failure


async def test_drain_is_bounded_by_the_grace_period() -> None:
    life = Lifecycle("svc", grace_s=0.05)
    svc = Recorder(life, slow_drain_s=30.0)
    runner = asyncio.create_task(life.run(svc, install_signals=False))
    await svc.started.wait()
    life.request_stop("test")
    assert await asyncio.wait_for(runner, 5) == 0  # a slow drain is not a failure
    assert svc.drain_cancelled
    assert svc.calls[-1] == "close"


async def test_sigterm_stops_the_service() -> None:
    life = Lifecycle("svc")
    svc = Recorder(life)
    runner = asyncio.create_task(life.run(svc))
    await svc.started.wait()
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(runner, 5) == 0
    assert svc.calls == ["start", "stop_intake", "drain", "close"]


async def test_task_names_are_unique_while_running() -> None:
    life = Lifecycle("svc")
    blocker = asyncio.Event()
    life.spawn(blocker.wait(), "loop")
    with pytest.raises(ValueError, match="already running"):
        life.spawn(blocker.wait(), "loop")
    life.request_stop("test")
    blocker.set()
