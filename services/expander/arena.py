"""The host-DRAM arena: one anonymous shared mapping per daemon, handed to rankers by fd.

`Arena` (the daemon's side): `memfd_create` (close-on-exec, sealed against resizing) + `ftruncate` +
`mmap(MAP_SHARED)`, every page allocated at start (fallocate) so that a copy never waits for the
kernel to find memory, and a host short of it fails at start with an error. A
memfd has no name in any filesystem: nothing is created in /dev/shm, a `kill -9` leaves nothing
behind (the pages go when the last fd or mapping goes), and Docker's small /dev/shm limit does not
apply to it.

The clients' side (receiving the fd, mapping it) is shared/expander/mapping.py.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import socket

from shared.expander.mapping import arena_header
from shared.expander.presence import DEFAULT_SLOTS, PresenceIndex

PAGE_SIZE = mmap.PAGESIZE


def _allocate_pages(fd: int, nbytes: int) -> bool:
    """Allocates every page of the memfd now, not at a ranker's first copy: fallocate (the
    kernel allocates the shmem pages, ~10x faster than faulting them in one write per page, and
    fails with an error where memory runs short instead of ending in the OOM killer); where the
    kernel refuses fallocate on a memfd, returns False: the caller writes one byte per page."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise MemoryError(f"cannot allocate a {nbytes}-byte arena: {exc.strerror}") from exc
        return False
    return True


def _touch_pages(mm: mmap.mmap, nbytes: int) -> None:
    """One write per page (the fallback of _allocate_pages)."""
    step = PAGE_SIZE * (1 << 16)
    for start in range(0, nbytes, step):
        end = min(start + step, nbytes)
        mm[start:end:PAGE_SIZE] = bytes(len(range(start, end, PAGE_SIZE)))


class Arena:
    """Daemon-side owner of the memfd and its mapping. Blocks while allocating its pages (~0.1 s
    per GiB with fallocate, ~0.8 s where it falls back to touching each page; a 2-core VM). `close()` unmaps and closes the fd; mappings clients already hold stay valid
    until they unmap them."""

    def __init__(
        self, nbytes: int, *, prefault: bool = True, name: str = "relaygr-expander",
        presence_slots: int = DEFAULT_SLOTS,
    ) -> None:  # fmt: skip
        if nbytes <= 0 or nbytes % PAGE_SIZE:
            raise ValueError(f"arena size must be a positive multiple of {PAGE_SIZE}, got {nbytes}")
        self.nbytes = nbytes
        self.generation = secrets.token_hex(8)  # new per daemon start: clients detect restarts
        self._mm: mmap.mmap | None = None
        # Which keys the store holds READY, for clients to read before asking (0 slots: none).
        self.presence: PresenceIndex | None = None
        self._presence_fd = -1
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            if presence_slots:
                self.presence, self._presence_fd = PresenceIndex.create(presence_slots)
            os.ftruncate(self.fd, nbytes)
            # Clients receive this fd: seal the size so none can shrink it under the other mappings
            # (a shrunk memfd turns every access past the new end into SIGBUS, daemon included).
            fcntl.fcntl(
                self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            )
            allocated = prefault and _allocate_pages(self.fd, nbytes)
            self._mm = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED)
            if prefault and not allocated:
                _touch_pages(self._mm, nbytes)
        except BaseException:
            self.close()
            raise

    def header(self) -> bytes:
        """What the fd socket sends along with the fd(s)."""
        return arena_header(self.nbytes, self.generation, self.presence.slots if self.presence else 0)

    def send_to(self, conn: socket.socket) -> None:
        """Sends the memfd (and the presence index's) and the header over a connected unix socket
        (blocking, SCM_RIGHTS)."""
        if self.fd < 0:
            raise ValueError("arena is closed")
        fds = [self.fd] if self._presence_fd < 0 else [self.fd, self._presence_fd]
        socket.send_fds(conn, [self.header()], fds)

    def close(self) -> None:
        """Unmaps the daemon's mappings and closes the memfds; idempotent."""
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self.presence is not None:
            self.presence.close()
        if self._presence_fd >= 0:
            os.close(self._presence_fd)
            self._presence_fd = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
