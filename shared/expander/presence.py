"""Which keys the expander may hold, readable by its clients without a round trip.

A ranker looks in host DRAM for every call whose psi is not in HBM: half the calls at L4096 are
first calls, whose psi is nowhere, and each lookup was an RPC to the daemon on the call's critical
path (0.6 ms at p50, 6.9 ms at p99 in a loaded ranker on an H200). The daemon keeps a counting
filter in a second memfd, mapped read-only by every client with the arena: one uint16 counter per
slot, a key's slot from a hash of its fields, counting the daemon's READY entries (what `acquire`
can serve). A client reads its key's slot: 0 means the daemon holds no readable psi under that key
and the lookup is skipped; non-zero means it may (another key in the slot, or this one), and the
client asks as before. The filter is advisory, the RPC authoritative: a counter read a moment
before a commit lands reads as a miss, the same as a lookup sent a moment earlier. A counter that
reaches its maximum stays there (it could not tell how many of its keys left): that slot always
reads as "may hold".

Slots default to 2^20 (2 MiB): with the ~500-30,000 entries an arena of tens of GiB holds, a key
absent from the arena finds its slot taken 0.05-3% of the time.
"""

from __future__ import annotations

import hashlib
import mmap
import os

from shared.psi_key import PsiKey

__all__ = ["COUNTER_MAX", "DEFAULT_SLOTS", "PresenceIndex", "slot_of"]

DEFAULT_SLOTS = 1 << 20
COUNTER_MAX = 0xFFFF  # a counter that reaches it stays there
_SLOT_BYTES = 2


def slot_of(key: PsiKey, slots: int) -> int:
    """The key's slot: a hash of its fields that every process computes alike (Python's own hash
    of a str is salted per process)."""
    text = f"{key.user_id}\x1f{key.prefix_version}\x1f{key.model_version}\x1f{key.fingerprint}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % slots


class PresenceIndex:
    """The counters over a shared mapping: the daemon's writable one (`create`) or a client's
    read-only one (`from_fd`)."""

    def __init__(self, mm: mmap.mmap, slots: int, writable: bool) -> None:
        self._mm: mmap.mmap | None = mm
        self._counters = memoryview(mm).cast("H")
        self.slots = slots
        self._writable = writable

    @classmethod
    def create(
        cls, slots: int = DEFAULT_SLOTS, name: str = "relaygr-expander-presence"
    ) -> tuple[PresenceIndex, int]:
        """A new index in a memfd (all counters 0) and that fd, which the caller owns and sends."""
        if slots <= 0:
            raise ValueError(f"a presence index needs at least one slot, got {slots}")
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, slots * _SLOT_BYTES)
            return cls(mmap.mmap(fd, slots * _SLOT_BYTES, mmap.MAP_SHARED), slots, writable=True), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def from_fd(cls, fd: int, slots: int) -> PresenceIndex:
        """A client's read-only view of the daemon's index. The caller still owns fd. ValueError
        when the fd's size is not that of `slots` counters."""
        if slots <= 0 or os.fstat(fd).st_size != slots * _SLOT_BYTES:
            raise ValueError(f"presence index fd is not {slots} counters")
        return cls(mmap.mmap(fd, slots * _SLOT_BYTES, mmap.MAP_SHARED, mmap.PROT_READ), slots, writable=False)

    def may_hold(self, key: PsiKey) -> bool:
        """False only if the daemon holds no READY entry under key right now."""
        if self._mm is None:
            return True  # closed: nothing to go by, ask
        return self._counters[slot_of(key, self.slots)] != 0

    def add(self, key: PsiKey) -> None:
        """The daemon: an entry under key became READY."""
        self._bump(key, +1)

    def remove(self, key: PsiKey) -> None:
        """The daemon: a READY entry under key left (evicted, expired, dropped)."""
        self._bump(key, -1)

    def count(self, key: PsiKey) -> int:
        """The counter of key's slot (0 when closed)."""
        return self.counter(slot_of(key, self.slots))

    def counter(self, slot: int) -> int:
        """The counter of a slot (0 when closed)."""
        return 0 if self._mm is None else int(self._counters[slot])

    def close(self) -> None:
        """Unmaps; idempotent. may_hold() then answers True (ask the daemon)."""
        mm, self._mm = self._mm, None
        if mm is not None:
            self._counters.release()
            mm.close()

    def _bump(self, key: PsiKey, delta: int) -> None:
        if not self._writable:
            raise ValueError("a client's presence index is read-only")
        if self._mm is None:
            return
        slot = slot_of(key, self.slots)
        value = self._counters[slot]
        if value == COUNTER_MAX:
            return  # saturated: it can no longer tell when its keys are gone
        if delta < 0 and value == 0:
            raise ValueError(f"presence counter of {key} would go below 0")
        self._counters[slot] = value + delta
