"""The expander daemon as a real process: cross-process bytes, bad input, crashes, clean shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relaygr.processes import ServiceProcess
from shared.expander import EntryKey, EntryState, ExpanderClient, ExpanderRefused, ExpanderUnavailable

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ARENA = 64 << 20
MAX_LEASE = 30.0


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


class Daemon(ServiceProcess):
    """`python -m services.expander` in a subprocess (the launcher's process runner)."""

    def __init__(self, socket_path: Path, *extra: str) -> None:
        super().__init__("services.expander", "--socket-path", str(socket_path), "--arena-bytes", str(ARENA),
                         "--max-lease-ms", str(MAX_LEASE * 1e3), *extra)  # fmt: skip
        self.socket_path = socket_path

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM and the exit status (not forced: a daemon that ignores it fails the test)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)


def start_daemon(socket_path: Path, *extra: str) -> Daemon:
    daemon = Daemon(socket_path, *extra)
    try:
        ready = daemon.wait_event("expander_ready")
        assert ready["socket_path"] == str(socket_path)
        assert ready["arena_bytes"] == ARENA
    except BaseException:
        daemon.kill()
        raise
    return daemon


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    daemon = start_daemon(tmp_path_factory.mktemp("exp") / "run" / "x.sock")
    try:
        yield daemon
    finally:
        daemon.kill()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Any]:
    """Starts daemons for one test; every one is killed at teardown, whatever happened."""
    started: list[Daemon] = []

    def start(socket_path: Path | None = None, *extra: str) -> Daemon:
        daemon = start_daemon(socket_path or tmp_path / "d" / "x.sock", *extra)
        started.append(daemon)
        return daemon

    try:
        yield start
    finally:
        for daemon in started:
            daemon.kill()


# ----- two client processes share bytes through the arena -----

WRITER = """
import asyncio, hashlib, json, random, sys
from shared.expander import ExpanderClient, EntryKey
async def main():
    sock, user, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    data = random.Random(user).randbytes(n)
    client = await ExpanderClient.connect(sock, owner="writer")
    r = await client.reserve(EntryKey(user, 3, "m1", 0), n, {"layers": 8, "dtype": "bfloat16"})
    client.arena.view(r.offset, n)[:] = data
    await client.commit(r.lease_id)
    if len(sys.argv) > 4:  # leave a second reservation uncommitted, then die
        r2 = await client.reserve(EntryKey(user + 1, 3, "m1", 0), n)
        client.arena.view(r2.offset, n)[:] = data
        print(json.dumps({"offset": r.offset, "sha": hashlib.sha256(data).hexdigest()}), flush=True)
        import os; os._exit(0)
    await client.close()
    print(json.dumps({"offset": r.offset, "sha": hashlib.sha256(data).hexdigest()}))
asyncio.run(main())
"""

READER = """
import asyncio, hashlib, json, sys
from shared.expander import ExpanderClient, EntryKey
async def main():
    sock, user = sys.argv[1], int(sys.argv[2])
    client = await ExpanderClient.connect(sock, owner="reader")
    a = await client.acquire(EntryKey(user, 3, "m1", 0))
    if a is None:
        print(json.dumps(None)); return
    data = bytes(client.arena.view(a.offset, a.nbytes))
    await client.release(a.lease_id)
    await client.close()
    print(json.dumps({"offset": a.offset, "sha": hashlib.sha256(data).hexdigest(), "meta": a.meta}))
asyncio.run(main())
"""


def run_snippet(code: str, *args: object) -> Any:
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_bytes_written_by_one_process_are_read_by_another(shared_daemon: Daemon) -> None:
    sock = shared_daemon.socket_path
    wrote = run_snippet(WRITER, sock, 101, 3 << 20)
    read = run_snippet(READER, sock, 101)
    assert read == {
        "offset": wrote["offset"],
        "sha": wrote["sha"],
        "meta": {"layers": 8, "dtype": "bfloat16"},
    }
    assert run_snippet(READER, sock, 999) is None  # never written


async def test_a_dead_writers_reservation_is_released(shared_daemon: Daemon) -> None:
    sock = str(shared_daemon.socket_path)
    run_snippet(WRITER, sock, 201, 1 << 20, "die")  # commits user 201, dies holding 202's write lease
    async with await ExpanderClient.connect(sock) as client:
        for _ in range(100):  # the daemon sees the disconnect asynchronously
            if await client.lookup(EntryKey(202, 3, "m1", 0)) is None:
                break
            await asyncio.sleep(0.02)
        assert await client.lookup(EntryKey(202, 3, "m1", 0)) is None
        info = await client.lookup(EntryKey(201, 3, "m1", 0))
        assert info is not None
        assert info.state is EntryState.READY


async def test_client_operations_and_zero_copy_tensors(shared_daemon: Daemon) -> None:
    sock = str(shared_daemon.socket_path)
    async with await ExpanderClient.connect(sock, owner="t") as client:
        key = EntryKey(301, 1, "m1", 0)
        assert client.arena.nbytes == ARENA
        assert client.arena.base_address > 0
        await client.ping()
        r = await client.reserve(key, 10_000, {"x": [1, 2]})
        pending = await client.lookup(key)
        assert pending is not None
        assert pending.state is EntryState.WRITING
        t = client.arena.tensor(r.offset, r.nbytes)
        t.fill_(7)  # writes through the tensor land in the shared mapping
        assert bytes(client.arena.view(r.offset, 4)) == b"\x07" * 4
        del t
        with pytest.raises(ExpanderRefused) as refused:
            await client.reserve(key, 10)
        assert refused.value.reason == "exists"
        assert not client.may_hold(key)  # WRITING: nothing a reader could acquire yet
        await client.commit(r.lease_id)
        # The daemon's presence index, read from this process's mapping without a round trip.
        assert client.may_hold(key)
        assert not client.may_hold(EntryKey(399, 1, "m1", 0))
        with pytest.raises(ExpanderRefused) as refused:
            await client.commit(r.lease_id)
        assert refused.value.reason == "unknown_lease"
        with pytest.raises(ExpanderRefused) as refused:
            await client.reserve(EntryKey(302, 1, "m1", 0), ARENA + 1)
        assert refused.value.reason == "too_large"
        with pytest.raises(ExpanderRefused) as refused:
            await client.acquire(key, lease_s=MAX_LEASE * 2)
        assert refused.value.reason == "invalid"
        a = await client.acquire(key)
        assert a is not None
        assert a.meta == {"x": [1, 2]}
        assert (await client.lookup(key)).pins == 1  # type: ignore[union-attr]
        stats = await client.stats()
        assert stats.pinned >= 1
        assert stats.hits >= 1
        await client.release(a.lease_id)
        abandoned = await client.reserve(EntryKey(303, 1, "m1", 0), 5)
        await client.abort(abandoned.lease_id)
        assert await client.lookup(EntryKey(303, 1, "m1", 0)) is None
        # A live tensor defers the unmap instead of raising; the tensor stays readable.
        live = client.arena.tensor(r.offset, 16)
    assert client.arena.closed
    assert int(live.sum()) == 7 * 16
    del live


def test_metrics_endpoint(shared_daemon: Daemon) -> None:
    port = shared_daemon.wait_event("expander_ready")["metrics_port"]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "relaygr_expander_requests_total" in body
    samples = dict(line.rsplit(" ", 1) for line in body.splitlines() if line and not line.startswith("#"))
    assert float(samples['relaygr_expander_bytes{kind="capacity"}']) == ARENA


# ----- malformed input -----


def _raw_send(sock: socket.socket, body: bytes) -> None:
    sock.sendall(struct.pack(">I", len(body)) + body)


def _raw_reply(sock: socket.socket) -> dict[str, Any] | None:
    header = b""
    while len(header) < 4:
        chunk = sock.recv(4 - len(header))
        if not chunk:
            return None
        header += chunk
    (length,) = struct.unpack(">I", header)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    reply: dict[str, Any] = json.loads(body)
    return reply


KEY = {"user_id": 1, "prefix_version": 0, "model_version": "m", "fingerprint": 2**64 - 1}
BAD = [
    (b"not json", "bad_frame"),
    (b"[1, 2]", "bad_frame"),
    (b"", "bad_frame"),
    (b'{"op": "nope"}', "unknown_op"),
    (b'{"op": 5}', "invalid"),
    (b'{"op": [1]}', "invalid"),
    (b'{"op": {"a": 1}}', "invalid"),
    (b'{"op": "ping", "stuff": ' + b"[" * 2000 + b"]" * 2000 + b"}", "bad_frame"),
    (b'{"nop": "ping"}', "invalid"),
    (json.dumps({"op": "reserve", "key": KEY, "nbytes": -5, "lease_s": 1}).encode(), "invalid"),
    (json.dumps({"op": "reserve", "key": KEY, "nbytes": True, "lease_s": 1}).encode(), "invalid"),
    (json.dumps({"op": "reserve", "key": KEY, "nbytes": 4096, "lease_s": -1}).encode(), "invalid"),
    (json.dumps({"op": "reserve", "key": KEY, "nbytes": 4096, "lease_s": 1, "meta": []}).encode(), "invalid"),
    (json.dumps({"op": "reserve", "key": KEY, "nbytes": 2**70, "lease_s": 1}).encode(), "invalid"),
    (json.dumps({"op": "lookup", "key": {"user_id": 1}}).encode(), "invalid"),
    (json.dumps({"op": "lookup", "key": {**KEY, "fingerprint": -1}}).encode(), "invalid"),
    (json.dumps({"op": "lookup", "key": {**KEY, "fingerprint": 2**64}}).encode(), "invalid"),
    (json.dumps({"op": "lookup", "key": {**KEY, "fingerprint": "ab"}}).encode(), "invalid"),
    (
        json.dumps({"op": "lookup", "key": {k: v for k, v in KEY.items() if k != "fingerprint"}}).encode(),
        "invalid",
    ),
    (json.dumps({"op": "lookup", "key": KEY, "extra": 1}).encode(), "invalid"),
    (json.dumps({"op": "commit", "lease_id": "x"}).encode(), "invalid"),
    (json.dumps({"op": "acquire", "key": KEY, "lease_s": 1e9}).encode(), "invalid"),
    (json.dumps({"op": "release", "lease_id": 987654}).encode(), "lease"),
    (json.dumps({"op": "ping", "id": "abc"}).encode(), "invalid"),
]


def test_malformed_frames_get_error_replies_and_the_daemon_keeps_serving(shared_daemon: Daemon) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(shared_daemon.socket_path))
        for body, kind in BAD:
            _raw_send(sock, body)
            reply = _raw_reply(sock)
            assert reply is not None
            assert reply["ok"] is False, body
            assert reply["error"] == kind, (body, reply)
            assert reply["reason"]
        _raw_send(sock, b'{"op": "ping", "id": 42}')  # the same connection still works
        reply = _raw_reply(sock)
        assert reply is not None
        assert reply["ok"] is True
        assert reply["id"] == 42
        # An oversized frame: an error reply, then the daemon closes (the stream cannot resync).
        sock.sendall(struct.pack(">I", 1 << 20) + b"x" * 100)
        reply = _raw_reply(sock)
        assert reply is not None
        assert reply["error"] == "frame_too_large"
        assert _raw_reply(sock) is None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # a frame cut short, then gone
        sock.connect(str(shared_daemon.socket_path))
        sock.sendall(struct.pack(">I", 100) + b'{"op"')
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(shared_daemon.socket_path))
        _raw_send(sock, b'{"op": "stats"}')
        reply = _raw_reply(sock)
        assert reply is not None
        assert reply["ok"] is True
    assert shared_daemon.proc.poll() is None


# ----- lifecycle -----


def test_sockets_are_owner_only_and_the_arena_is_a_memfd(shared_daemon: Daemon) -> None:
    sock = shared_daemon.socket_path
    assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700  # created by the daemon
    for path in (sock, Path(str(sock) + ".fd")):
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
    maps = Path(f"/proc/{shared_daemon.proc.pid}/maps").read_text()
    assert "/memfd:relaygr-expander" in maps
    assert "/dev/shm/" not in maps


def test_graceful_stop_removes_sockets_and_leaves_nothing_in_dev_shm(daemon_factory: Any) -> None:
    shm_before = _shm()
    daemon = daemon_factory()
    sock = daemon.socket_path
    assert sock.exists()
    assert daemon.stop() == 0
    daemon.wait_event("expander_stopped")
    assert not sock.exists()
    assert not Path(str(sock) + ".fd").exists()
    assert list(sock.parent.iterdir()) == []
    assert _shm() - shm_before == set()


async def test_kill_9_makes_calls_fail_promptly_and_a_new_daemon_takes_over(daemon_factory: Any) -> None:
    shm_before = _shm()
    first = daemon_factory()
    sock = str(first.socket_path)
    client = await ExpanderClient.connect(sock, call_timeout_s=5.0)
    held = await client.reserve(EntryKey(1, 1, "m1", 0), 4096)
    first.kill()  # SIGKILL: no clean-up at all
    with pytest.raises(ExpanderUnavailable):
        await client.commit(held.lease_id)
    with pytest.raises(ExpanderUnavailable):
        await client.ping()  # the client stays broken
    assert client.broken
    with pytest.raises(ExpanderUnavailable):
        await ExpanderClient.connect(sock, timeout_s=2.0)  # stale socket file: refused
    assert _shm() - shm_before == set()
    # A new daemon removes the stale sockets, has a new generation, and serves new clients.
    second = daemon_factory(first.socket_path)
    fresh = await ExpanderClient.connect(sock)
    assert fresh.generation != client.generation
    assert await fresh.lookup(EntryKey(1, 1, "m1", 0)) is None
    await fresh.close()
    await client.close()
    assert second.stop() == 0


async def test_a_frozen_daemon_makes_calls_time_out(daemon_factory: Any) -> None:
    daemon = daemon_factory()
    client = await ExpanderClient.connect(str(daemon.socket_path), call_timeout_s=0.5)
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(ExpanderUnavailable, match="no reply"):
            await client.ping()
        with pytest.raises(ExpanderUnavailable):
            await client.ping()  # broken: a late reply must never be taken for a later request's
        with pytest.raises(ExpanderUnavailable):
            await ExpanderClient.connect(str(daemon.socket_path), timeout_s=0.5)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    await client.close()
    async with await ExpanderClient.connect(str(daemon.socket_path)) as again:
        await again.ping()


async def test_restarted_daemon_is_detected_by_old_clients(daemon_factory: Any) -> None:
    first = daemon_factory()
    client = await ExpanderClient.connect(str(first.socket_path))
    assert first.stop() == 0
    daemon_factory(first.socket_path)
    with pytest.raises(ExpanderUnavailable):
        await client.ping()
    await client.close()


def test_a_second_daemon_on_a_live_socket_refuses_to_start(daemon_factory: Any) -> None:
    first = daemon_factory()
    second = Daemon(first.socket_path)
    try:
        assert second.proc.wait(30) == 1
        assert second.wait_event("expander_failed")["error"].startswith("another process is serving")
    finally:
        second.kill()
    assert first.proc.poll() is None
    assert first.socket_path.exists()


def test_bad_configuration_exits_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.expander", "--socket-path", str(tmp_path / "x"), "--arena-bytes", "1000"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "arena_bytes" in done.stderr
