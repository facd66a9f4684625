"""The host-DRAM arena: one anonymous shared mapping per daemon, handed to rankers by fd.

`Arena` (the daemon's side): `memfd_create` (close-on-exec, sealed against resizing) + `ftruncate` +
`mmap(MAP_SHARED)`, every page touched once at start so copies never take a page fault later. A
memfd has no name in any filesystem: nothing is created in /dev/shm, a `kill -9` leaves nothing
behind (the pages go when the last fd or mapping goes), and Docker's small /dev/shm limit does not
apply to it.

The clients' side (receiving the fd, mapping it) is shared/expander/mapping.py.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import socket

from shared.expander.mapping import arena_header

PAGE_SIZE = mmap.PAGESIZE


class Arena:
    """Daemon-side owner of the memfd and its mapping. Blocks while prefaulting (about a quarter of
    a second per GiB). `close()` unmaps and closes the fd; mappings clients already hold stay valid
    until they unmap them."""

    def __init__(self, nbytes: int, *, prefault: bool = True, name: str = "relaygr-expander") -> None:
        if nbytes <= 0 or nbytes % PAGE_SIZE:
            raise ValueError(f"arena size must be a positive multiple of {PAGE_SIZE}, got {nbytes}")
        self.nbytes = nbytes
        self.generation = secrets.token_hex(8)  # new per daemon start: clients detect restarts
        self._mm: mmap.mmap | None = None
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            # Clients receive this fd: seal the size so none can shrink it under the other mappings
            # (a shrunk memfd turns every access past the new end into SIGBUS, daemon included).
            fcntl.fcntl(
                self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            )
            self._mm = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED)
            if prefault:
                # One write per page allocates it now, not at a ranker's first copy.
                pages_per_chunk = 1 << 16
                step = PAGE_SIZE * pages_per_chunk
                for start in range(0, nbytes, step):
                    end = min(start + step, nbytes)
                    self._mm[start:end:PAGE_SIZE] = bytes(len(range(start, end, PAGE_SIZE)))
        except BaseException:
            self.close()
            raise

    def header(self) -> bytes:
        """What the fd socket sends along with the fd."""
        return arena_header(self.nbytes, self.generation)

    def send_to(self, conn: socket.socket) -> None:
        """Sends the memfd and the header over a connected unix socket (blocking, SCM_RIGHTS)."""
        if self.fd < 0:
            raise ValueError("arena is closed")
        socket.send_fds(conn, [self.header()], [self.fd])

    def close(self) -> None:
        """Unmaps the daemon's mapping and closes the memfd; idempotent."""
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
