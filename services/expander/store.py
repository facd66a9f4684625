"""The expander's entry table: a pure state machine over the arena allocator.

No I/O, no tensors, no clock: every time-dependent operation takes `now` (monotonic seconds), so
tests drive time by hand. Not thread-safe: the daemon calls it from its one event loop, which makes
every operation atomic with respect to every other.

Life of an entry (one per EntryKey):

    reserve ──> WRITING ──commit──> READY ──(LRU eviction, unpinned)──> EVICTED
                   │                  └────(idle past ttl_s, unpinned)──> EXPIRED
                   ├──abort──> ABORTED
                   └──(write lease past its deadline)──> EXPIRED

EVICTED, EXPIRED and ABORTED are removal outcomes: the block is freed, the entry forgotten, the
outcome counted. `_TRANSITIONS` lists every allowed move; `_transition` is the one place that
changes an entry's state and it refuses anything else.

Leases carry an owner (for logs) and a deadline. A write lease (from `reserve`) lets its holder fill
the block and `commit` or `abort` it before the deadline. A read lease (from `acquire`) pins a READY
entry: pinned entries are never evicted nor expired, so a reader can copy the bytes out safely.
Pins whose deadline passed are dropped by `expire` (the reader is presumed dead).

TTL: a READY entry expires ttl_s after it was last committed or acquired (`lookup` extends nothing),
once it is unpinned. An entry past its deadline is treated as absent by every operation even before
`expire` sweeps it, so results never depend on when the sweep last ran.
"""

from __future__ import annotations

import copy
import enum
import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Final

from services.expander.allocator import Allocator, InvariantError
from shared.expander.entries import (
    Acquired,
    EntryInfo,
    EntryKey,
    EntryState,
    Reservation,
    StoreStats,
)
from shared.expander.presence import COUNTER_MAX, PresenceIndex, slot_of

_REMOVED: Final = frozenset({EntryState.EVICTED, EntryState.EXPIRED, EntryState.ABORTED})
_TRANSITIONS: Final = frozenset(
    {
        (EntryState.WRITING, EntryState.READY),
        (EntryState.WRITING, EntryState.ABORTED),
        (EntryState.WRITING, EntryState.EXPIRED),
        (EntryState.READY, EntryState.EVICTED),
        (EntryState.READY, EntryState.EXPIRED),
    }
)


class StoreError(Exception):
    """Base of the errors the store raises on a caller's mistake; the store stays consistent."""


class LeaseError(StoreError):
    """A lease id cannot be used: `reason` is "unknown_lease" (never issued, already finished, or
    swept after its deadline), "lease_expired" (its deadline passed: the write was reclaimed), or
    "wrong_lease_kind" (commit/abort of a read lease, release of a write lease)."""

    def __init__(self, reason: str, lease_id: int) -> None:
        super().__init__(f"{reason}: lease {lease_id}")
        self.reason = reason
        self.lease_id = lease_id


# ----- results the daemon keeps to itself (those on the wire are in shared/expander/entries.py) -----


@dataclass(frozen=True)
class Refusal:
    reason: str  # "too_large" | "no_space" | "exists"


@dataclass(frozen=True)
class ExpireCounts:
    writes: int  # WRITING entries reclaimed (write lease past deadline)
    pins: int  # read leases dropped (past deadline)
    entries: int  # READY entries removed (past TTL, unpinned)


# ----- internal mutable records -----


class _LeaseKind(enum.Enum):
    WRITE = "write"
    READ = "read"


@dataclass
class _Lease:
    lease_id: int
    kind: _LeaseKind
    key: EntryKey
    owner: str
    deadline: float


@dataclass
class _Entry:
    key: EntryKey
    offset: int
    nbytes: int
    meta: dict[str, Any]
    state: EntryState
    write_lease: int | None
    ttl_deadline: float = 0.0  # meaningful once READY
    pins: set[int] = field(default_factory=set)


class Store:
    """Entry table + leases + LRU over an Allocator of `capacity` bytes.

    `ttl_s`: idle lifetime of an unpinned READY entry. `max_lease_s`: longest lease a caller may ask
    for. Operations taking lease_s raise ValueError unless 0 < lease_s <= max_lease_s, and reserve
    raises ValueError for nbytes <= 0 (the protocol layer validates before calling).
    """

    def __init__(
        self, capacity: int, *, ttl_s: float, max_lease_s: float, check: bool = False,
        presence: PresenceIndex | None = None,
    ) -> None:  # fmt: skip
        if ttl_s <= 0 or max_lease_s <= 0:
            raise ValueError("ttl_s and max_lease_s must be > 0")
        # The clients' index of the READY keys (shared/expander/presence.py), kept in _transition.
        self._presence = presence
        self._alloc = Allocator(capacity, check=check)
        self._ttl_s = ttl_s
        self._max_lease_s = max_lease_s
        self._check = check
        self._entries: dict[EntryKey, _Entry] = {}
        self._leases: dict[int, _Lease] = {}
        # READY entries only, least recently used first.
        self._lru: OrderedDict[EntryKey, None] = OrderedDict()
        self._lease_ids = itertools.count(1)
        self._stored_bytes = 0
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "reservations",
                "commits",
                "aborts",
                "evictions",
                "expirations",
                "write_expirations",
                "pin_expirations",
                "hits",
                "misses",
                "refused_too_large",
                "refused_no_space",
                "refused_exists",
            ),
            0,
        )

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    @property
    def max_lease_s(self) -> float:
        return self._max_lease_s

    # ----- queries -----

    def lookup(self, key: EntryKey, now: float) -> EntryInfo | None:
        """The entry under key if it is live (WRITING within its write lease, or READY not past its
        TTL or pinned), else None. No side effects: LRU order, pins, TTLs and counters unchanged."""
        entry = self._entries.get(key)
        if entry is None or self._is_dead(entry, now):
            return None
        live_pins = sum(1 for lid in entry.pins if self._leases[lid].deadline > now)
        return EntryInfo(entry.key, entry.state, entry.offset, entry.nbytes, entry.meta, live_pins)

    def lru_order(self) -> list[EntryKey]:
        """READY keys, least recently used first (a copy; for tests and debugging)."""
        return list(self._lru)

    def stats(self) -> StoreStats:
        """Counters since creation and current occupancy. O(entries)."""
        ready = len(self._lru)
        pinned = sum(1 for k in self._lru if self._entries[k].pins)
        return StoreStats(
            capacity=self._alloc.capacity,
            used_bytes=self._alloc.used_bytes,
            free_bytes=self._alloc.free_bytes,
            largest_free=self._alloc.largest_free,
            stored_bytes=self._stored_bytes,
            entries=len(self._entries),
            ready=ready,
            writing=len(self._entries) - ready,
            pinned=pinned,
            read_leases=sum(1 for lease in self._leases.values() if lease.kind is _LeaseKind.READ),
            **self._counts,
        )

    # ----- writes -----

    def reserve(
        self, key: EntryKey, nbytes: int, meta: dict[str, Any], owner: str, lease_s: float, now: float
    ) -> Reservation | Refusal:
        """Allocates a block for key in state WRITING under a write lease of lease_s seconds.

        Refusal reasons: "exists" (key is live, WRITING or READY), "too_large" (nbytes > capacity),
        "no_space" (it would not fit even after evicting every unpinned READY entry; nothing is
        evicted in that case). Otherwise evicts unpinned READY entries, least recently used first,
        until the block fits. `meta` is copied and handed back unchanged to readers.
        """
        self._check_lease_s(lease_s)
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        existing = self._entries.get(key)
        if existing is not None:
            if not self._is_dead(existing, now):
                return self._refuse("exists")
            self._transition(existing, EntryState.EXPIRED)
        if nbytes > self._alloc.capacity:
            return self._refuse("too_large")
        offset = self._alloc.allocate(nbytes)
        if offset is None:
            self.expire(now)  # reclaim dead writes, dead pins and TTL-expired entries first
            offset = self._alloc.allocate(nbytes)
        if offset is None:
            evictable = [k for k in self._lru if not self._entries[k].pins]
            if self._alloc.largest_free_if_freed(self._entries[k].offset for k in evictable) < nbytes:
                return self._refuse("no_space")
            for victim in evictable:
                self._transition(self._entries[victim], EntryState.EVICTED)
                offset = self._alloc.allocate(nbytes)
                if offset is not None:
                    break
            if offset is None:
                raise InvariantError("eviction of every evictable entry did not make the room it promised")
        lease = self._new_lease(_LeaseKind.WRITE, key, owner, now + lease_s)
        entry = _Entry(key, offset, nbytes, copy.deepcopy(meta), EntryState.WRITING, lease.lease_id)
        self._entries[key] = entry
        self._stored_bytes += nbytes
        self._counts["reservations"] += 1
        self._maybe_check()
        return Reservation(lease.lease_id, offset, nbytes, lease_s)

    def commit(self, lease_id: int, now: float) -> EntryInfo:
        """WRITING -> READY: the writer has finished copying. Starts the TTL and makes the entry the
        most recently used. Raises LeaseError ("unknown_lease", "wrong_lease_kind", or
        "lease_expired" when its deadline has passed: the block is reclaimed, nothing committed)."""
        lease = self._lease(lease_id, _LeaseKind.WRITE)
        entry = self._entries[lease.key]
        if lease.deadline <= now:
            self._transition(entry, EntryState.EXPIRED)
            raise LeaseError("lease_expired", lease_id)
        self._transition(entry, EntryState.READY)
        entry.ttl_deadline = now + self._ttl_s
        self._maybe_check()
        return EntryInfo(entry.key, entry.state, entry.offset, entry.nbytes, entry.meta, 0)

    def abort(self, lease_id: int) -> None:
        """WRITING -> ABORTED: frees the block. Raises LeaseError ("unknown_lease",
        "wrong_lease_kind"). Aborting after the deadline but before the sweep is still an abort."""
        lease = self._lease(lease_id, _LeaseKind.WRITE)
        self._transition(self._entries[lease.key], EntryState.ABORTED)
        self._maybe_check()

    # ----- reads -----

    def acquire(self, key: EntryKey, owner: str, lease_s: float, now: float) -> Acquired | None:
        """Pins the READY entry under key with a read lease of lease_s seconds, makes it the most
        recently used and restarts its TTL. None (a miss) when absent, WRITING or dead."""
        self._check_lease_s(lease_s)
        entry = self._entries.get(key)
        if entry is not None and self._is_dead(entry, now):
            self._transition(entry, EntryState.EXPIRED)
            entry = None
        if entry is None or entry.state is not EntryState.READY:
            self._counts["misses"] += 1
            self._maybe_check()
            return None
        lease = self._new_lease(_LeaseKind.READ, key, owner, now + lease_s)
        entry.pins.add(lease.lease_id)
        entry.ttl_deadline = max(entry.ttl_deadline, now + self._ttl_s)
        self._lru.move_to_end(key)
        self._counts["hits"] += 1
        self._maybe_check()
        return Acquired(lease.lease_id, entry.offset, entry.nbytes, entry.meta, lease_s)

    def release(self, lease_id: int) -> None:
        """Drops a read lease (unpins). Raises LeaseError ("unknown_lease", "wrong_lease_kind")."""
        lease = self._lease(lease_id, _LeaseKind.READ)
        self._drop_read_lease(lease)
        self._maybe_check()

    def cancel(self, lease_id: int) -> bool:
        """Ends a lease of either kind (abort a write, release a read); False if it is unknown.
        For the daemon's clean-up of a disconnected client's leases."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        if lease.kind is _LeaseKind.WRITE:
            self.abort(lease_id)
        else:
            self.release(lease_id)
        return True

    # ----- time -----

    def expire(self, now: float) -> ExpireCounts:
        """Reclaims WRITING entries whose write lease deadline has passed, drops read leases past
        their deadline, then removes unpinned READY entries past their TTL. O(entries + leases)."""
        writes = pins = 0
        for lease in [le for le in self._leases.values() if le.deadline <= now]:
            if lease.kind is _LeaseKind.WRITE:
                self._transition(self._entries[lease.key], EntryState.EXPIRED)
                writes += 1
            else:
                self._drop_read_lease(lease)
                self._counts["pin_expirations"] += 1
                pins += 1
        expired = [k for k in self._lru if not self._entries[k].pins and self._entries[k].ttl_deadline <= now]
        for key in expired:
            self._transition(self._entries[key], EntryState.EXPIRED)
        self._maybe_check()
        return ExpireCounts(writes=writes, pins=pins, entries=len(expired))

    # ----- invariants -----

    def check_invariants(self) -> None:
        """Raises InvariantError unless entries, leases, LRU and allocator agree with each other."""
        self._alloc.check_invariants()
        problems: list[str] = []
        ready = {k for k, e in self._entries.items() if e.state is EntryState.READY}
        if set(self._lru) != ready:
            problems.append("LRU keys != READY keys")
        if self._alloc.block_count != len(self._entries):
            problems.append(f"{self._alloc.block_count} blocks for {len(self._entries)} entries")
        if self._stored_bytes != sum(e.nbytes for e in self._entries.values()):
            problems.append("stored_bytes out of sync")
        if self._presence is not None:
            problems += self._presence_problems(ready)
        for key, e in self._entries.items():
            if e.key != key or e.state in _REMOVED:
                problems.append(f"{key}: bad record (state {e.state})")
            if self._alloc.block_size(e.offset) < e.nbytes:
                problems.append(f"{key}: block smaller than nbytes")
            if e.state is EntryState.WRITING:
                lease = self._leases.get(e.write_lease) if e.write_lease is not None else None
                if lease is None or lease.kind is not _LeaseKind.WRITE or lease.key != key or e.pins:
                    problems.append(f"{key}: WRITING without its write lease, or pinned")
            elif e.write_lease is not None:
                problems.append(f"{key}: READY still holds a write lease")
            for lid in e.pins:
                lease = self._leases.get(lid)
                if lease is None or lease.kind is not _LeaseKind.READ or lease.key != key:
                    problems.append(f"{key}: pin {lid} has no matching read lease")
        for lid, lease in self._leases.items():
            entry = self._entries.get(lease.key)
            if entry is None:
                problems.append(f"lease {lid} for missing entry {lease.key}")
            elif lease.kind is _LeaseKind.READ and lid not in entry.pins:
                problems.append(f"read lease {lid} not among its entry's pins")
            elif lease.kind is _LeaseKind.WRITE and entry.write_lease != lid:
                problems.append(f"write lease {lid} not its entry's write lease")
        if problems:
            raise InvariantError("store: " + "; ".join(problems))

    # ----- internals -----

    def _presence_problems(self, ready: set[EntryKey]) -> list[str]:
        """The presence index counts exactly the READY keys of each slot (a saturated counter
        excepted); every slot is checked where there are few (tests), the READY keys' otherwise."""
        presence = self._presence
        assert presence is not None
        want = Counter(slot_of(k, presence.slots) for k in ready)
        slots = range(presence.slots) if presence.slots <= 4096 else want.keys()
        wrong = [i for i in slots if presence.counter(i) not in (want.get(i, 0), COUNTER_MAX)]
        return [f"presence counters of slots {wrong[:5]} disagree with the READY keys"] if wrong else []

    def _transition(self, entry: _Entry, new: EntryState) -> None:
        """The only place an entry changes state. Removal states free the block and forget the entry
        (and its leases); the counters record the outcome."""
        if (entry.state, new) not in _TRANSITIONS:
            raise InvariantError(f"illegal transition {entry.state.name} -> {new.name} for {entry.key}")
        old, entry.state = entry.state, new
        if entry.write_lease is not None:  # leaving WRITING, whichever way
            del self._leases[entry.write_lease]
            entry.write_lease = None
        if new is EntryState.READY:
            self._lru[entry.key] = None
            self._lru.move_to_end(entry.key)
            self._counts["commits"] += 1
            if self._presence is not None:
                self._presence.add(entry.key)
            return
        # A removal outcome.
        for lid in entry.pins:
            del self._leases[lid]
        entry.pins.clear()
        if old is EntryState.READY:
            del self._lru[entry.key]
            if self._presence is not None:
                self._presence.remove(entry.key)
        del self._entries[entry.key]
        self._alloc.free(entry.offset)
        self._stored_bytes -= entry.nbytes
        if new is EntryState.EVICTED:
            self._counts["evictions"] += 1
        elif new is EntryState.ABORTED:
            self._counts["aborts"] += 1
        elif old is EntryState.READY:
            self._counts["expirations"] += 1
        else:
            self._counts["write_expirations"] += 1

    def _is_dead(self, entry: _Entry, now: float) -> bool:
        """Past its deadline, whether or not expire() has swept it yet."""
        if entry.state is EntryState.WRITING:
            assert entry.write_lease is not None
            return self._leases[entry.write_lease].deadline <= now
        if any(self._leases[lid].deadline > now for lid in entry.pins):
            return False
        return entry.ttl_deadline <= now

    def _lease(self, lease_id: int, kind: _LeaseKind) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseError("unknown_lease", lease_id)
        if lease.kind is not kind:
            raise LeaseError("wrong_lease_kind", lease_id)
        return lease

    def _new_lease(self, kind: _LeaseKind, key: EntryKey, owner: str, deadline: float) -> _Lease:
        lease = _Lease(next(self._lease_ids), kind, key, owner, deadline)
        self._leases[lease.lease_id] = lease
        return lease

    def _drop_read_lease(self, lease: _Lease) -> None:
        del self._leases[lease.lease_id]
        self._entries[lease.key].pins.discard(lease.lease_id)

    def _refuse(self, reason: str) -> Refusal:
        self._counts[f"refused_{reason}"] += 1
        return Refusal(reason)

    def _check_lease_s(self, lease_s: float) -> None:
        if not 0 < lease_s <= self._max_lease_s:
            raise ValueError(f"lease_s must be within (0, {self._max_lease_s}], got {lease_s}")

    def _maybe_check(self) -> None:
        if self._check:
            self.check_invariants()
