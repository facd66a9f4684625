"""The client side of the expander's arena: the fd handshake and the mapping.

The daemon (services/expander/arena.py) keeps psi in one memfd. `receive_arena` connects to the
daemon's fd socket, receives that memfd with SCM_RIGHTS plus a small JSON header
(`arena_header`: arena size, daemon generation), maps it and closes the fd. The resulting
`ArenaMapping` gives memoryviews and zero-copy uint8 tensors over byte ranges; the caller copies
psi bytes in and out itself (tensors never cross the control socket). torch is imported only by
`ArenaMapping.tensor`, so processes that copy bytes (and the daemon) never load it.

A daemon that keeps a presence index (shared/expander/presence.py) sends its memfd second, its
slot count in the header: the mapping then carries it read-only (`ArenaMapping.presence`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
from typing import TYPE_CHECKING

import orjson

from shared.expander.presence import PresenceIndex

if TYPE_CHECKING:
    import torch

__all__ = ["ArenaHandshakeError", "ArenaMapping", "arena_header", "receive_arena"]

_HEADER_MAX = 4096


class ArenaHandshakeError(ConnectionError):
    """The fd socket did not deliver a usable arena (no fd, bad header, size mismatch)."""


def arena_header(nbytes: int, generation: str, presence_slots: int = 0) -> bytes:
    """What the daemon's fd socket sends along with the memfd (`receive_arena` parses it);
    `presence_slots` > 0: a presence index of that many slots comes as a second fd."""
    header: dict[str, object] = {"arena_bytes": nbytes, "generation": generation}
    if presence_slots:
        header["presence_slots"] = presence_slots
    return orjson.dumps(header)


class ArenaMapping:
    """A client's mapping of the arena. Offsets and sizes come from the daemon's replies.

    Not thread-safe for close() racing view()/tensor(); the byte ranges themselves may be read and
    written from any thread (the daemon's leases say who may touch which range).
    """

    def __init__(
        self, mm: mmap.mmap, nbytes: int, generation: str, presence: PresenceIndex | None = None
    ) -> None:
        self._mm: mmap.mmap | None = mm
        self._nbytes = nbytes
        self._generation = generation
        # The daemon's index of the keys it may hold (read-only), or None: a daemon without one.
        self.presence = presence
        # The ctypes object exports mm's buffer (which would block mm.close()): take the address and
        # drop it at once. The address stays valid for as long as the mapping exists.
        anchor = ctypes.c_char.from_buffer(mm)
        self._base_address = ctypes.addressof(anchor)
        del anchor

    @classmethod
    def from_fd(
        cls, fd: int, nbytes: int, generation: str, presence: PresenceIndex | None = None
    ) -> ArenaMapping:
        """Maps nbytes of fd shared and read-write. The caller still owns (and may close) fd."""
        return cls(mmap.mmap(fd, nbytes, mmap.MAP_SHARED), nbytes, generation, presence)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def generation(self) -> str:
        """The daemon start this arena belongs to."""
        return self._generation

    @property
    def base_address(self) -> int:
        """Virtual address of byte 0 in this process, e.g. for cudaHostRegister(base, nbytes, 0).
        Whoever registers it must unregister it before close()."""
        return self._base_address

    @property
    def closed(self) -> bool:
        return self._mm is None

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Writable memoryview of [offset, offset + nbytes). Raises ValueError when out of bounds or
        closed. While the view lives, close() cannot unmap (see close)."""
        mm = self._mapped()
        if offset < 0 or nbytes < 0 or offset + nbytes > self._nbytes:
            raise ValueError(f"range [{offset}, {offset + nbytes}) outside the arena of {self._nbytes} bytes")
        return memoryview(mm)[offset : offset + nbytes]

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """Zero-copy uint8 CPU tensor over [offset, offset + nbytes) (reinterpret with .view(dtype)).

        The tensor holds a memoryview, so the mapping cannot be unmapped under it: close() defers
        the unmap until the last such tensor is gone. Imports torch on first use only, so processes
        that just copy bytes (and the daemon) never load it."""
        import torch

        view = self.view(offset, nbytes)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(view, dtype=torch.uint8)

    def close(self) -> bool:
        """Stops handing out views and unmaps. Never raises for live views or tensors: if any still
        exist (BufferError from mmap), the mapping is dropped here and unmapped by Python when the
        last of them is released, so they stay valid meanwhile. Returns True if unmapped now, False
        if deferred. Idempotent."""
        mm, self._mm = self._mm, None
        if mm is None:
            return True
        if self.presence is not None:
            self.presence.close()
        try:
            mm.close()
        except BufferError:
            return False  # views keep `mm` alive; its deallocation unmaps it
        return True

    def _mapped(self) -> mmap.mmap:
        if self._mm is None:
            raise ValueError("arena mapping is closed")
        return self._mm

    def __enter__(self) -> ArenaMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def receive_arena(fd_socket_path: str, timeout_s: float) -> ArenaMapping:
    """Connects to the daemon's fd socket, receives the memfd and maps it. Blocks up to about
    timeout_s (run it in an executor from async code). Raises OSError if the socket cannot be
    reached (FileNotFoundError, ConnectionRefusedError, TimeoutError...) and ArenaHandshakeError
    if what arrives is not a usable arena."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(fd_socket_path)
        data, fds, flags, _addr = socket.recv_fds(sock, _HEADER_MAX, 4)
    try:
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            raise ArenaHandshakeError("fd handshake message truncated")
        try:
            header = orjson.loads(data)
            nbytes, generation = header["arena_bytes"], header["generation"]
            slots = header.get("presence_slots", 0)
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ArenaHandshakeError(f"bad fd handshake header: {exc}") from None
        if not isinstance(nbytes, int) or nbytes <= 0 or not isinstance(generation, str):
            raise ArenaHandshakeError(f"bad fd handshake header: {header!r}")
        if not isinstance(slots, int) or slots < 0:
            raise ArenaHandshakeError(f"bad presence index size in the fd handshake: {slots!r}")
        if len(fds) != (2 if slots else 1):
            raise ArenaHandshakeError(f"expected {2 if slots else 1} fd(s) from the daemon, got {len(fds)}")
        if os.fstat(fds[0]).st_size != nbytes:
            raise ArenaHandshakeError("received fd's size differs from the announced arena size")
        presence = None
        if slots:
            try:
                presence = PresenceIndex.from_fd(fds[1], slots)
            except ValueError as exc:
                raise ArenaHandshakeError(str(exc)) from None
        return ArenaMapping.from_fd(fds[0], nbytes, generation, presence)
    finally:
        for fd in fds:
            os.close(fd)  # the mapping keeps its own reference to the memory
