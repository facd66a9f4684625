"""The HBM relay cache: byte budget, leases, entry states and eviction. Bookkeeping only.

Holds psi handles as opaque objects (it never touches tensors), is driven from one asyncio loop
(not thread-safe by design), and takes time from an injected clock, so it is testable on the CPU
without a device.

Entry lifecycle (transitions asserted in `_move`):

    PRODUCING --produced--> RESIDENT --claimed by its ranking call--> CONSUMED --copied to host--> DEMOTED
        |                      |   ^                                    |                            |
        +--failed--> FREED     |   +------ re-leased by a new signal ---+----------------------------+
                               +--lease deadline passed--> EXPIRED      +--evicted / released--> FREED <--+

* PRODUCING and RESIDENT entries are leased: a lease has an owner (the pending ranking request)
  and a deadline. A leased entry is never evicted; when the budget is full, new admissions are
  refused (and counted) rather than evicting psi that a ranking call is about to use.
* `lookup` has no side effects: it never extends a lease, pins, or reorders anything.
* CONSUMED and DEMOTED entries are unleased and evictable (DEMOTED first: their psi is safe in
  host DRAM; then CONSUMED entries settled to go without a copy, `settle`; then least recently
  used). The caller chooses whether a DEMOTED entry stays as a hot copy (a returning user hits
  HBM without a reload) or is freed at once. An entry pinned by a running computation or copy is
  never freed. Under pressure `demotion_candidates` names the CONSUMED entries to copy ahead of
  their eviction; a settled one is no longer named (a read makes it a candidate again).
* EXPIRED and FREED are terminal: the entry leaves the table and its bytes are released.

Keys may come in groups (`group_of`: the ranker groups psi keys by (user, prefix version, model),
whatever their content fingerprint): `variants(key)` tells which other entries of the key's group
are held, so a caller can tell "nothing here" from "psi of other content under this name". Each
entry is still claimed, leased and freed by its own key only.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any


class EntryState(enum.Enum):
    PRODUCING = "producing"
    RESIDENT = "resident"
    CONSUMED = "consumed"
    DEMOTED = "demoted"
    EXPIRED = "expired"
    FREED = "freed"


_TRANSITIONS: dict[EntryState, frozenset[EntryState]] = {
    EntryState.PRODUCING: frozenset({EntryState.RESIDENT, EntryState.FREED}),
    EntryState.RESIDENT: frozenset({EntryState.CONSUMED, EntryState.EXPIRED}),
    EntryState.CONSUMED: frozenset({EntryState.DEMOTED, EntryState.FREED, EntryState.RESIDENT}),
    EntryState.DEMOTED: frozenset({EntryState.FREED, EntryState.RESIDENT}),
}
_TERMINAL = frozenset({EntryState.EXPIRED, EntryState.FREED})
_UNLEASED = frozenset({EntryState.CONSUMED, EntryState.DEMOTED})
_LEASED = frozenset({EntryState.PRODUCING, EntryState.RESIDENT})


class InvalidTransition(RuntimeError):
    """A caller asked for a state change the lifecycle does not allow (a bug, not a request error)."""


class Admission(enum.Enum):
    ADMITTED = "admitted"  # a new entry in PRODUCING: the caller must produce it
    ALREADY_RESIDENT = "already_resident"  # lease taken over by the new owner
    ALREADY_PRODUCING = "already_producing"  # lease taken over; production in flight
    REFUSED = "refused"


class Claim(enum.Enum):
    HIT = "hit"  # usable now: pinned for the caller, which must unpin()
    IN_FLIGHT = "in_flight"  # being produced: wait, then claim again
    MISS = "miss"


@dataclass(frozen=True)
class Lease:
    owner: str
    deadline: float


@dataclass(frozen=True)
class EntryView:
    """A read-only snapshot of an entry, as lookup() returns it."""

    key: Hashable
    state: EntryState
    nbytes: int
    lease: Lease | None
    pins: int
    source: str


@dataclass(frozen=True)
class AdmitResult:
    outcome: Admission
    reason: str = ""


@dataclass(frozen=True)
class ClaimResult:
    outcome: Claim
    handle: Any = None
    source: str = ""  # a HIT's: where its psi came from (_Entry.source)


@dataclass
class _Entry:
    key: Hashable
    nbytes: int
    state: EntryState
    source: str  # "compute" (pre-inference), "reload" or "ranking" (kept by a full ranking)
    lease: Lease | None
    pins: int = 0
    handle: Any = None
    last_used: float = 0.0
    settled: bool = False  # CONSUMED, to be evicted without a host copy (settle())


@dataclass
class CacheCounters:
    admitted: int = 0
    refused: int = 0
    produced: int = 0
    failed: int = 0
    hits: int = 0
    joins: int = 0
    misses: int = 0
    expired: int = 0  # pre-inferred, never consumed before the lease deadline: wasted
    demoted: int = 0
    evicted: int = 0
    released: int = 0  # consumed entries dropped without a host copy
    evicted_undemoted: int = 0  # of `evicted`: consumed entries with no host copy (lost to the tiers)
    budget_lowered: int = 0  # times the device refused memory the budget allowed (lower_budget)


@dataclass
class HbmCache:
    budget_bytes: int
    clock: Callable[[], float]
    counters: CacheCounters = field(default_factory=CacheCounters)
    group_of: Callable[[Hashable], Hashable] | None = None
    configured_bytes: int = field(init=False, default=0)  # budget_bytes as given (it may be lowered)
    _entries: dict[Hashable, _Entry] = field(default_factory=dict)
    _groups: dict[Hashable, set[Hashable]] = field(default_factory=dict)
    _used: int = 0
    # Unleased entries, least recently used first, one order per state (CONSUMED, DEMOTED):
    # eviction and demotion read them in order and stop when they have enough, instead of sorting
    # every entry (~0.3-0.8 ms per admission with ~500 resident psis, on the event loop the device
    # thread shares). One order for both states made eviction, which takes DEMOTED entries first,
    # walk past every CONSUMED one to reach hot copies read again (at the end): 0.67 ms an
    # admission in a replay of 2666 mix-sized psi, one in 8 of them demoted and read again.
    _lru: dict[EntryState, collections.OrderedDict[Hashable, _Entry]] = field(
        default_factory=lambda: {state: collections.OrderedDict() for state in _UNLEASED}
    )
    # RESIDENT entries (leased psi waiting for its call): the expiry pass, every 50 ms, reads
    # only these (a pass over every entry cost ~0.25 ms with 2666 mix-sized psi held).
    _resident: dict[Hashable, _Entry] = field(default_factory=dict)
    # CONSUMED entries settled to go without a host copy (settle()), in the order settled: out
    # of the demotion candidates' order, their bytes counted as covered. Kept in that order and
    # re-weighed on every call, ~130 of them on the length mix cost the event loop 0.3-0.6 ms a
    # call (2-core build machine), then, counted apart but still walked past, ~60 us.
    _settled: collections.OrderedDict[Hashable, _Entry] = field(default_factory=collections.OrderedDict)
    _settled_bytes: int = 0
    _bytes_by_state: collections.Counter[EntryState] = field(default_factory=collections.Counter)
    _count_by_state: collections.Counter[EntryState] = field(default_factory=collections.Counter)
    # Bytes of unleased entries that a call or a copy holds pinned: evictable bytes are the
    # unleased bytes less these, kept as a sum because the ranker's Stats and every admission
    # read them (a sum over ~1000 resident psis on the event loop otherwise).
    _pinned_unleased_bytes: int = 0

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError("budget_bytes must be > 0")
        self.configured_bytes = self.budget_bytes

    # ------------------------------------------------------------------ queries (no side effects)

    def lookup(self, key: Hashable) -> EntryView | None:
        e = self._entries.get(key)
        return None if e is None else EntryView(e.key, e.state, e.nbytes, e.lease, e.pins, e.source)

    def variants(self, key: Hashable) -> list[Hashable]:
        """Keys of the other entries held in key's group (any state), key itself excluded; empty
        without `group_of`. No side effects."""
        if self.group_of is None:
            return []
        return [k for k in self._groups.get(self.group_of(key), ()) if k != key]

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def leased_bytes(self) -> int:
        return sum(self._bytes_by_state[state] for state in _LEASED)

    @property
    def evictable_bytes(self) -> int:
        return self._evictable_bytes()

    @property
    def producing(self) -> int:
        return self._count_by_state[EntryState.PRODUCING]

    def __len__(self) -> int:
        return len(self._entries)

    def fits(self, nbytes: int) -> bool:
        """Whether nbytes could be admitted now (counting evictable entries). No side effects."""
        return nbytes <= self.budget_bytes - self._used + self._evictable_bytes()

    # ------------------------------------------------------------------ admission and production

    def admit(self, key: Hashable, nbytes: int, lease: Lease, source: str = "compute") -> AdmitResult:
        """Claims room for a psi (a pre-inference or a reload) under `lease`.

        An existing entry keeps its bytes and takes the new lease (a new ranking call is now the
        one waiting for it); its deadline never moves earlier.
        """
        e = self._entries.get(key)
        if e is not None:
            if e.state in _UNLEASED:
                self._move(e, EntryState.RESIDENT)
                e.lease = lease
                return AdmitResult(Admission.ALREADY_RESIDENT)
            assert e.lease is not None
            e.lease = Lease(lease.owner, max(lease.deadline, e.lease.deadline))
            outcome = (
                Admission.ALREADY_RESIDENT if e.state is EntryState.RESIDENT else Admission.ALREADY_PRODUCING
            )
            return AdmitResult(outcome)
        if nbytes > self.budget_bytes:
            self.counters.refused += 1
            # Over the budget it was configured with: never admissible; over a lowered one: no room.
            return AdmitResult(
                Admission.REFUSED, "too_large" if nbytes > self.configured_bytes else "hbm_budget"
            )
        if not self._make_room(nbytes):
            self.counters.refused += 1
            return AdmitResult(Admission.REFUSED, "hbm_budget")
        self._entries[key] = _Entry(key, nbytes, EntryState.PRODUCING, source, lease, last_used=self.clock())
        self._bytes_by_state[EntryState.PRODUCING] += nbytes
        self._count_by_state[EntryState.PRODUCING] += 1
        if self.group_of is not None:
            self._groups.setdefault(self.group_of(key), set()).add(key)
        self._used += nbytes
        self.counters.admitted += 1
        return AdmitResult(Admission.ADMITTED)

    def produced(self, key: Hashable, handle: Any) -> bool:
        """PRODUCING -> RESIDENT with its psi. False when the entry is gone (then drop the handle)."""
        e = self._entries.get(key)
        if e is None or e.state is not EntryState.PRODUCING:
            return False
        e.handle = handle
        self._move(e, EntryState.RESIDENT)
        self.counters.produced += 1
        return True

    def production_failed(self, key: Hashable) -> None:
        e = self._entries.get(key)
        if e is not None and e.state is EntryState.PRODUCING:
            self.counters.failed += 1
            self._move(e, EntryState.FREED)

    # ------------------------------------------------------------------ ranking

    def claim(self, key: Hashable) -> ClaimResult:
        """For a ranking call: a HIT pins the psi (call unpin() after the compute) and consumes it."""
        e = self._entries.get(key)
        if e is None:
            self.counters.misses += 1
            return ClaimResult(Claim.MISS)
        if e.state is EntryState.PRODUCING:
            return ClaimResult(Claim.IN_FLIGHT)
        if e.state is EntryState.RESIDENT:
            self._move(e, EntryState.CONSUMED)
            e.lease = None
        if e.settled:  # read again: a demotion candidate again
            self._unsettle(e)
            self._lru[EntryState.CONSUMED][key] = e
        self._pin(e, +1)
        e.last_used = self.clock()
        self._lru[e.state].move_to_end(key)  # unleased now (CONSUMED, or a hot copy hit again): the newest
        self.counters.hits += 1
        return ClaimResult(Claim.HIT, e.handle, e.source)

    def unpin(self, key: Hashable) -> None:
        e = self._entries.get(key)
        if e is None or e.pins <= 0:
            raise InvalidTransition(f"unpin of {key!r} without a pin")
        self._pin(e, -1)

    def pin_for_copy(self, key: Hashable) -> Any:
        """Pins a CONSUMED entry for its demotion copy; returns its handle, or None if not demotable."""
        e = self._entries.get(key)
        if e is None or e.state is not EntryState.CONSUMED:
            return None
        self._pin(e, +1)
        return e.handle

    def demotion_candidates(self, reserve_bytes: int, in_flight_bytes: int = 0) -> list[Hashable]:
        """CONSUMED entries to copy to host DRAM now so that admitting `reserve_bytes` more psi
        evicts only entries with a host copy: the least recently used first, as many as the
        bytes to free exceed what DEMOTED entries and the `in_flight_bytes` of copies under way
        already cover (a DEMOTED entry read by a call at the moment counts: it is evictable once
        the call is done). Empty while the budget has room. (Demotion under pressure: the host
        tier then holds what HBM no longer does, and the two tiers' capacities add up.)
        Settled entries (settle()) count as covered and are not picked."""
        needed = self._used + max(reserve_bytes, 0) - self.budget_bytes
        covered = in_flight_bytes + self._bytes_by_state[EntryState.DEMOTED] + self._settled_bytes
        picked: list[Hashable] = []
        if covered >= needed:
            return picked
        for e in self._lru[EntryState.CONSUMED].values():
            if e.pins == 0:
                picked.append(e.key)
                covered += e.nbytes
                if covered >= needed:
                    break
        return picked

    def settle(self, key: Hashable) -> bool:
        """An unpinned CONSUMED entry goes without a host copy when its room is needed (the
        demotion gate declined it): no longer a demotion candidate, its bytes count as covered,
        and eviction takes it before the other consumed psi, until a call reads it again
        (claim). False when the entry is not one to settle."""
        e = self._entries.get(key)
        if e is None or e.state is not EntryState.CONSUMED or e.pins or e.settled:
            return False
        del self._lru[EntryState.CONSUMED][key]
        self._settled[key] = e
        self._settled_bytes += e.nbytes
        e.settled = True
        return True

    def demoted(self, key: Hashable, ok: bool, keep: bool) -> None:
        """The demotion copy finished (ok) or failed; unpins. On success the entry is DEMOTED and,
        unless `keep` (stay as an evictable hot copy), freed once nothing else uses it. A failed
        demotion leaves the entry CONSUMED (evictable)."""
        e = self._entries.get(key)
        if e is None:
            return
        self.unpin(key)
        if ok and e.state is EntryState.CONSUMED:
            self.counters.demoted += 1
            self._move(e, EntryState.DEMOTED)
            if not keep and e.pins == 0:
                self._move(e, EntryState.FREED)

    def release(self, key: Hashable) -> None:
        """Drops an unleased, unpinned entry now."""
        e = self._entries.get(key)
        if e is not None and e.state in _UNLEASED and e.pins == 0:
            self.counters.released += 1
            self._move(e, EntryState.FREED)

    def lower_budget(self, budget_bytes: int) -> int:
        """The device refused memory that the budget allowed (other processes on the device, the
        allocator's fragments): the budget drops to `budget_bytes` (never raised here: what the
        device holds beside psi does not shrink on its own) and unpinned unleased entries are
        freed, in eviction order, until what is held fits or none is left; leased psi stays for
        its call. Returns the bytes freed."""
        budget_bytes = max(0, min(budget_bytes, self.budget_bytes))
        if budget_bytes < self.budget_bytes:
            self.counters.budget_lowered += 1
        self.budget_bytes = budget_bytes
        over = self._used - budget_bytes
        victims: list[_Entry] = []
        for e in self._evictable():
            if over <= 0:
                break
            victims.append(e)
            over -= e.nbytes
        return self._evict(victims)

    # ------------------------------------------------------------------ time

    def expire(self) -> list[Hashable]:
        """RESIDENT entries past their lease deadline become EXPIRED (wasted pre-inferences)."""
        now = self.clock()
        gone: list[Hashable] = []
        for e in list(self._resident.values()):
            if e.pins == 0 and e.lease is not None and e.lease.deadline < now:
                self.counters.expired += 1
                self._move(e, EntryState.EXPIRED)
                gone.append(e.key)
        return gone

    # ------------------------------------------------------------------ internals

    def _evictable(self) -> Iterator[_Entry]:
        """Unpinned unleased entries in eviction order: demoted psi first (a copy is safe in host
        DRAM), then consumed; least recently used first within each."""
        for order in (self._lru[EntryState.DEMOTED], self._settled, self._lru[EntryState.CONSUMED]):
            for e in order.values():
                if e.pins == 0:
                    yield e

    def _evictable_bytes(self) -> int:
        unleased = self._bytes_by_state[EntryState.DEMOTED] + self._bytes_by_state[EntryState.CONSUMED]
        return unleased - self._pinned_unleased_bytes

    def _pin(self, e: _Entry, delta: int) -> None:
        was_pinned = e.pins > 0
        e.pins += delta
        if e.state in _UNLEASED and was_pinned != (e.pins > 0):
            self._pinned_unleased_bytes += e.nbytes if e.pins > 0 else -e.nbytes

    def _make_room(self, nbytes: int) -> bool:
        """Evicts what admitting nbytes needs, in eviction order; nothing when even all of the
        evictable entries would not make room."""
        over = self._used + nbytes - self.budget_bytes
        if over <= 0:
            return True
        victims: list[_Entry] = []
        for e in self._evictable():
            victims.append(e)
            over -= e.nbytes
            if over <= 0:
                break
        if over > 0:
            return False
        self._evict(victims)
        return True

    def _evict(self, victims: list[_Entry]) -> int:
        """Frees `victims` (picked from _evictable, after the walk: _move edits the orders it
        walks), counted as evictions; returns their bytes."""
        for e in victims:
            self.counters.evicted += 1
            if e.state is EntryState.CONSUMED:
                self.counters.evicted_undemoted += 1
            self._move(e, EntryState.FREED)
        return sum(e.nbytes for e in victims)

    def _unsettle(self, e: _Entry) -> None:
        del self._settled[e.key]
        self._settled_bytes -= e.nbytes
        e.settled = False

    @staticmethod
    def _insert_by_use(order: collections.OrderedDict[Hashable, _Entry], e: _Entry) -> None:
        """Inserts e where its last use puts it. A demoted entry was last used before its copy
        (under pressure the least recently used consumed psi are copied): only the entries
        used since are moved behind it, walked from the newest."""
        newer: list[Hashable] = []
        for other in reversed(order.values()):
            if other.last_used <= e.last_used:
                break
            newer.append(other.key)
        order[e.key] = e
        for key in reversed(newer):
            order.move_to_end(key)

    def _move(self, e: _Entry, to: EntryState) -> None:
        if to not in _TRANSITIONS.get(e.state, frozenset()):
            raise InvalidTransition(f"{e.key!r}: {e.state.value} -> {to.value} is not allowed")
        if to in _TERMINAL and e.pins:
            raise InvalidTransition(f"{e.key!r}: cannot leave the cache while pinned")
        self._bytes_by_state[e.state] -= e.nbytes
        self._count_by_state[e.state] -= 1
        if e.pins and (e.state in _UNLEASED) != (to in _UNLEASED):
            self._pinned_unleased_bytes += e.nbytes if to in _UNLEASED else -e.nbytes
        if e.settled:
            self._unsettle(e)
        elif e.state in _UNLEASED:
            del self._lru[e.state][e.key]
        elif e.state is EntryState.RESIDENT:
            del self._resident[e.key]
        if to is EntryState.RESIDENT:
            self._resident[e.key] = e
        if to is EntryState.DEMOTED:
            self._insert_by_use(self._lru[to], e)
        elif to in _UNLEASED:
            self._lru[to][e.key] = e  # the newest: a claim, which moves it here, is a use
        e.state = to
        if to not in _TERMINAL:
            self._bytes_by_state[to] += e.nbytes
            self._count_by_state[to] += 1
        if to in _TERMINAL:
            del self._entries[e.key]
            if self.group_of is not None:
                group = self.group_of(e.key)
                members = self._groups[group]
                members.discard(e.key)
                if not members:
                    del self._groups[group]
            self._used -= e.nbytes
            e.handle = None
