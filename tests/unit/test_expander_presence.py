"""The expander's presence index (shared/expander/presence.py): counters the daemon keeps per key
slot and its clients read without a round trip, handed over with the arena's fd."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from services.expander.arena import PAGE_SIZE, Arena
from shared.expander.mapping import ArenaHandshakeError, receive_arena
from shared.expander.presence import COUNTER_MAX, PresenceIndex, slot_of
from shared.psi_key import PsiKey

REPO = Path(__file__).resolve().parents[2]
KEY = PsiKey(42, 3, "bench-seed0-abc", 2**63 + 5)


def test_a_key_has_the_same_slot_in_every_process():
    # Python's own str hash is salted per process: a slot computed that way would differ between
    # the daemon and its rankers.
    code = (
        "from shared.expander.presence import slot_of; from shared.psi_key import PsiKey; "
        f"print(slot_of(PsiKey(42, 3, 'bench-seed0-abc', {2**63 + 5}), 1 << 20))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(other.stdout) == slot_of(KEY, 1 << 20)
    assert 0 <= slot_of(KEY, 7) < 7


def test_a_client_sees_the_daemons_counts_and_cannot_change_them():
    daemon, fd = PresenceIndex.create(64)
    try:
        client = PresenceIndex.from_fd(fd, 64)
    finally:
        os.close(fd)
    other = next(
        PsiKey(u, 1, "m", 0) for u in range(1000) if slot_of(PsiKey(u, 1, "m", 0), 64) != slot_of(KEY, 64)
    )
    assert not client.may_hold(KEY)
    daemon.add(KEY)
    assert client.may_hold(KEY)
    assert not client.may_hold(other)
    daemon.add(KEY)
    daemon.remove(KEY)
    assert client.may_hold(KEY)
    daemon.remove(KEY)
    assert not client.may_hold(KEY)
    with pytest.raises(ValueError, match="below 0"):
        daemon.remove(KEY)
    with pytest.raises(ValueError, match="read-only"):
        client.add(KEY)
    client.close()
    assert client.may_hold(KEY)  # closed: nothing to go by, ask the daemon
    daemon.close()


def test_a_saturated_counter_stays_saturated():
    daemon, fd = PresenceIndex.create(4)
    os.close(fd)
    for _ in range(COUNTER_MAX + 10):
        daemon.add(KEY)
    assert daemon.count(KEY) == COUNTER_MAX
    for _ in range(COUNTER_MAX + 10):
        daemon.remove(KEY)  # it can no longer tell when its keys are gone: never below
    assert daemon.may_hold(KEY)
    daemon.close()


def test_a_wrong_sized_index_fd_is_refused():
    daemon, fd = PresenceIndex.create(16)
    try:
        with pytest.raises(ValueError, match="not 8 counters"):
            PresenceIndex.from_fd(fd, 8)
    finally:
        os.close(fd)
        daemon.close()


def serve_once(path: str, send: Callable[[socket.socket], None]) -> None:
    """An fd socket at `path` that answers one connection with `send`."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                send(conn)

    threading.Thread(target=serve, daemon=True).start()


@pytest.mark.parametrize("slots", [0, 128])
def test_the_index_comes_with_the_arena_when_the_daemon_keeps_one(tmp_path, slots):
    arena = Arena(64 * PAGE_SIZE, prefault=False, presence_slots=slots)
    try:
        path = str(tmp_path / "fd.sock")
        serve_once(path, arena.send_to)
        mapping = receive_arena(path, timeout_s=5)
        try:
            if not slots:
                assert mapping.presence is None
                return
            assert mapping.presence is not None
            assert mapping.presence.slots == slots
            assert arena.presence is not None
            assert not mapping.presence.may_hold(KEY)
            arena.presence.add(KEY)
            assert mapping.presence.may_hold(KEY)  # the daemon's write, read through the client's map
        finally:
            mapping.close()
        assert mapping.presence is None or mapping.presence.may_hold(KEY)  # closed with the mapping
    finally:
        arena.close()


def test_a_header_announcing_an_index_without_its_fd_is_refused(tmp_path):
    arena = Arena(64 * PAGE_SIZE, prefault=False, presence_slots=0)
    path = str(tmp_path / "fd.sock")
    header = b'{"arena_bytes": %d, "generation": "g", "presence_slots": 16}' % arena.nbytes
    serve_once(path, lambda conn: socket.send_fds(conn, [header], [arena.fd]))
    try:
        with pytest.raises(ArenaHandshakeError, match="expected 2 fd"):
            receive_arena(path, timeout_s=5)
    finally:
        arena.close()
