"""The expander daemon's lifecycle, in process: a stop drains its connections and exits 0; a dead
sweeper stops it with status 1 and leaves no socket behind."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.expander.config import ExpanderConfig
from services.expander.server import ExpanderDaemon
from shared.expander import EntryKey, ExpanderClient, ExpanderUnavailable

ARENA = 1 << 20


def leftover_sockets(d: ExpanderDaemon) -> list[str]:
    return [p for p in (d.config.socket_path, d.config.fd_socket_path) if os.path.lexists(p)]


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[tuple[ExpanderDaemon, asyncio.Task[int]]]:
    config = ExpanderConfig(socket_path=str(tmp_path / "run" / "x.sock"), arena_bytes=ARENA)
    daemon = ExpanderDaemon(config, serve_metrics_http=False)
    runner = asyncio.create_task(daemon.run(install_signals=False))
    await asyncio.wait_for(daemon.ready.wait(), 10)
    yield daemon, runner
    await daemon.shutdown()


async def test_a_stop_closes_open_connections_and_exits_0(daemon) -> None:
    d, runner = daemon
    client = await ExpanderClient.connect(d.config.socket_path)
    await client.reserve(EntryKey(1, 1, "m", 0), 4096)
    await d.shutdown()
    assert await runner == 0
    with pytest.raises(ExpanderUnavailable):
        await client.ping()  # drained: the daemon closed the connection
    await client.close()
    assert leftover_sockets(d) == []


async def test_a_failed_sweep_stops_the_daemon_with_status_1(daemon, monkeypatch) -> None:
    d, runner = daemon
    assert d._store is not None

    def broken(now: float) -> None:
        raise RuntimeError("store invariant broken")

    monkeypatch.setattr(d._store, "expire", broken)
    assert await asyncio.wait_for(runner, 10) == 1
    assert d.lifecycle.failure is not None
    assert "sweep" in d.lifecycle.failure
    assert "store invariant broken" in d.lifecycle.failure
    assert leftover_sockets(d) == []
