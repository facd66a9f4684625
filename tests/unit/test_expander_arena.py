"""The expander's arena: a sealed memfd whose pages are all allocated at start (fallocate, or one
write per page where the kernel refuses it), and a clear error where memory runs short."""

from __future__ import annotations

import errno
import os

import pytest

from services.expander import arena as arena_module
from services.expander.arena import PAGE_SIZE, Arena

SIZE = 64 * PAGE_SIZE * 16  # 4 MiB with 4 KiB pages


def allocated_bytes(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def test_every_page_is_allocated_at_start():
    a = Arena(SIZE)
    try:
        assert allocated_bytes(a.fd) >= SIZE
    finally:
        a.close()


def test_without_prefault_nothing_is_allocated_yet():
    a = Arena(SIZE, prefault=False)
    try:
        assert allocated_bytes(a.fd) < SIZE
    finally:
        a.close()


def test_pages_are_touched_where_fallocate_is_refused(monkeypatch):
    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(arena_module.os, "posix_fallocate", refuse)
    a = Arena(SIZE)
    try:
        assert allocated_bytes(a.fd) >= SIZE
    finally:
        a.close()


def test_a_host_short_of_memory_is_an_error_not_the_oom_killer(monkeypatch):
    def short(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(arena_module.os, "posix_fallocate", short)
    with pytest.raises(MemoryError, match="cannot allocate a 4194304-byte arena"):
        Arena(SIZE)
