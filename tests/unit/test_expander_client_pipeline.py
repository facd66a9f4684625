"""The expander client pipelines its requests (shared/expander/client.py): several are on the wire at
once, each reply reaches the caller whose request it answers, a cancelled caller leaves the client
usable, and a broken stream fails every request on it. Against a scripted daemon on a Unix socket,
so the order and timing of replies is the test's to choose."""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from shared.expander import protocol as p
from shared.expander.client import ExpanderClient, ExpanderUnavailable
from shared.expander.entries import EntryInfo, EntryKey, EntryState
from shared.expander.mapping import ArenaMapping

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read(reader: asyncio.StreamReader) -> dict[str, Any]:
    body = await p.read_frame(reader)
    assert body is not None
    return p.decode_message(body)


def _lookup_reply(request: dict[str, Any]) -> dict[str, Any]:
    """Found, with nbytes = 1000 + user id: a reply that names its request."""
    key = p.key_from_wire(request["key"])
    info = EntryInfo(key, EntryState.READY, 0, 1000 + key.user_id, {}, 0)
    return p.ok_reply(request["id"], found=True, entry=p.entry_to_wire(info))


def _key(user: int) -> EntryKey:
    return EntryKey(user, 1, "m", 0)


@pytest.fixture
async def scripted(tmp_path: Path) -> AsyncIterator[Callable[[Script, float], Awaitable[ExpanderClient]]]:
    servers: list[asyncio.Server] = []
    clients: list[ExpanderClient] = []

    async def start(script: Script, call_timeout_s: float = 5.0) -> ExpanderClient:
        path = str(tmp_path / f"d{len(servers)}.sock")
        servers.append(await asyncio.start_unix_server(script, path))
        reader, writer = await asyncio.open_unix_connection(path)
        arena = ArenaMapping(mmap.mmap(-1, 4096), 4096, "g1")
        client = ExpanderClient(
            path, reader, writer, arena, owner="t", call_timeout_s=call_timeout_s, lease_s=1.0, ttl_s=1.0,
            max_lease_s=1.0,
        )  # fmt: skip
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()
    for server in servers:
        server.close()


async def test_requests_are_on_the_wire_together_and_each_gets_its_own_reply(scripted: Any) -> None:
    # The daemon answers nothing until it has read four requests: a client that waited for each
    # reply before sending the next would time out here.
    async def four_then_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests = [await _read(reader) for _ in range(4)]
        for request in requests:
            writer.write(p.encode_frame(_lookup_reply(request)))
        await writer.drain()
        await reader.read()

    client = await scripted(four_then_answer, 2.0)
    found = await asyncio.gather(*(client.lookup(_key(user)) for user in (7, 3, 9, 5)))
    assert [info.nbytes if info else None for info in found] == [1007, 1003, 1009, 1005]
    assert client.broken is None


async def test_a_caller_cancelled_on_the_wire_leaves_the_client_usable(scripted: Any) -> None:
    first_read = asyncio.Event()
    release = asyncio.Event()

    async def slow_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await _read(reader)
        first_read.set()
        await release.wait()
        writer.write(p.encode_frame(_lookup_reply(first)))  # read by the client and dropped
        second = await _read(reader)
        writer.write(p.encode_frame(_lookup_reply(second)))
        await writer.drain()
        await reader.read()

    client = await scripted(slow_first, 5.0)
    abandoned = asyncio.ensure_future(client.lookup(_key(1)))
    await first_read.wait()
    abandoned.cancel()
    with pytest.raises(asyncio.CancelledError):
        await abandoned
    release.set()
    info = await client.lookup(_key(2))
    assert info is not None
    assert info.nbytes == 1002
    assert client.broken is None


async def test_a_reply_for_another_request_breaks_the_client_and_fails_every_request(scripted: Any) -> None:
    async def wrong_id(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first, _second = await _read(reader), await _read(reader)
        writer.write(p.encode_frame(p.ok_reply(first["id"] + 100, found=False)))
        await writer.drain()
        await reader.read()

    client = await scripted(wrong_id, 5.0)
    results = await asyncio.gather(client.lookup(_key(1)), client.lookup(_key(2)), return_exceptions=True)
    assert all(isinstance(r, ExpanderUnavailable) for r in results), results
    assert client.broken is not None
    assert "reply id" in client.broken
    with pytest.raises(ExpanderUnavailable, match="client unusable"):
        await client.lookup(_key(3))


async def test_a_daemon_that_hangs_up_fails_the_requests_on_the_wire_at_once(scripted: Any) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read(reader)
        await _read(reader)
        writer.close()

    client = await scripted(hang_up, 30.0)
    started = asyncio.get_running_loop().time()
    results = await asyncio.gather(client.lookup(_key(1)), client.lookup(_key(2)), return_exceptions=True)
    assert all(isinstance(r, ExpanderUnavailable) for r in results), results
    assert asyncio.get_running_loop().time() - started < 10.0  # not the call timeout
    assert client.broken == "daemon closed the connection"


async def test_a_daemon_that_never_answers_times_out_and_breaks_the_client(scripted: Any) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    client = await scripted(silent, 0.3)
    with pytest.raises(ExpanderUnavailable, match="no reply"):
        await client.lookup(_key(1))
    with pytest.raises(ExpanderUnavailable, match="client unusable"):
        await client.lookup(_key(2))  # a late reply must never be taken for a later request's
