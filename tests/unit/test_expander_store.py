"""Expander store: transitions, leases, LRU, pinning, TTL, refusals, and random operation sequences."""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from services.expander.allocator import InvariantError
from services.expander.store import _TRANSITIONS, LeaseError, Refusal, Store
from shared.expander.entries import Acquired, EntryKey, EntryState, Reservation
from shared.expander.presence import PresenceIndex

PAGE = 4096
TTL = 10.0
MAX_LEASE = 5.0


def key(user: int, version: int = 1, model: str = "m1", fingerprint: int = 0) -> EntryKey:
    return EntryKey(user, version, model, fingerprint)


def presence_index(slots: int = 8) -> PresenceIndex:
    """A small index (keys share slots), its fd closed: the mapping keeps the memory."""
    index, fd = PresenceIndex.create(slots)
    os.close(fd)
    return index


def make(pages: int = 16) -> Store:
    # Every operation is followed by the invariant check, the presence counters' included.
    return Store(pages * PAGE, ttl_s=TTL, max_lease_s=MAX_LEASE, check=True, presence=presence_index())


def reserve(s: Store, k: EntryKey, nbytes: int = PAGE, now: float = 0.0, lease_s: float = 2.0) -> Reservation:
    r = s.reserve(k, nbytes, {"user": k.user_id}, "writer", lease_s, now)
    assert isinstance(r, Reservation), r
    return r


def put(s: Store, k: EntryKey, nbytes: int = PAGE, now: float = 0.0) -> Reservation:
    r = reserve(s, k, nbytes, now)
    s.commit(r.lease_id, now)
    return r


def acquire(s: Store, k: EntryKey, now: float = 0.0, lease_s: float = 2.0) -> Acquired:
    a = s.acquire(k, "reader", lease_s, now)
    assert a is not None
    return a


def snapshot(s: Store, now: float, keys: list[EntryKey]) -> tuple[Any, ...]:
    return (s.lru_order(), asdict(s.stats()), [s.lookup(k, now) for k in keys])


# ----- transitions -----


def test_transition_table_is_exactly_the_documented_one() -> None:
    w, r = EntryState.WRITING, EntryState.READY
    documented = {
        (w, r),
        (w, EntryState.ABORTED),
        (w, EntryState.EXPIRED),
        (r, EntryState.EVICTED),
        (r, EntryState.EXPIRED),
    }
    assert documented == _TRANSITIONS


def test_illegal_transition_is_refused_loudly() -> None:
    s = make()
    put(s, key(1))
    entry = s._entries[key(1)]
    for bad in (EntryState.WRITING, EntryState.READY, EntryState.ABORTED):
        with pytest.raises(InvariantError):
            s._transition(entry, bad)


def test_reserve_commit_makes_an_entry_ready_with_meta() -> None:
    s = make()
    r = reserve(s, key(1), 100)
    assert (r.offset, r.nbytes, r.lease_s) == (0, 100, 2.0)
    info = s.lookup(key(1), 0.0)
    assert info is not None
    assert info.state is EntryState.WRITING
    assert s.acquire(key(1), "reader", 1.0, 0.0) is None  # not readable while WRITING
    committed = s.commit(r.lease_id, 1.0)
    assert committed.state is EntryState.READY
    a = acquire(s, key(1), 1.0)
    assert (a.offset, a.nbytes, a.meta) == (0, 100, {"user": 1})
    st_ = s.stats()
    assert (st_.entries, st_.ready, st_.writing, st_.commits, st_.hits, st_.misses) == (1, 1, 0, 1, 1, 1)
    assert (st_.used_bytes, st_.stored_bytes, st_.pinned, st_.read_leases) == (PAGE, 100, 1, 1)


def test_meta_is_copied_on_reserve() -> None:
    s = make()
    meta: dict[str, Any] = {"shape": [1, 2]}
    r = s.reserve(key(1), 10, meta, "w", 1.0, 0.0)
    assert isinstance(r, Reservation)
    meta["shape"].append(3)
    s.commit(r.lease_id, 0.0)
    assert acquire(s, key(1)).meta == {"shape": [1, 2]}


def test_abort_frees_the_block_and_counts() -> None:
    s = make()
    r = reserve(s, key(1), 3 * PAGE)
    s.abort(r.lease_id)
    assert s.lookup(key(1), 0.0) is None
    st_ = s.stats()
    assert (st_.aborts, st_.used_bytes, st_.entries) == (1, 0, 0)
    with pytest.raises(LeaseError) as err:
        s.commit(r.lease_id, 0.0)
    assert err.value.reason == "unknown_lease"


def test_lease_errors_have_reasons() -> None:
    s = make()
    w = reserve(s, key(1))
    with pytest.raises(LeaseError, match="wrong_lease_kind"):
        s.release(w.lease_id)
    s.commit(w.lease_id, 0.0)
    with pytest.raises(LeaseError, match="unknown_lease"):
        s.commit(w.lease_id, 0.0)  # twice
    with pytest.raises(LeaseError, match="unknown_lease"):
        s.abort(w.lease_id)
    a = acquire(s, key(1))
    with pytest.raises(LeaseError, match="wrong_lease_kind"):
        s.commit(a.lease_id, 0.0)
    with pytest.raises(LeaseError, match="wrong_lease_kind"):
        s.abort(a.lease_id)
    s.release(a.lease_id)
    with pytest.raises(LeaseError, match="unknown_lease"):
        s.release(a.lease_id)
    with pytest.raises(LeaseError, match="unknown_lease"):
        s.release(12345)
    s.check_invariants()


def test_bad_arguments_raise_value_error() -> None:
    s = make()
    for lease_s in (0.0, -1.0, MAX_LEASE + 0.1):
        with pytest.raises(ValueError, match="lease_s"):
            s.reserve(key(1), PAGE, {}, "w", lease_s, 0.0)
        with pytest.raises(ValueError, match="lease_s"):
            s.acquire(key(1), "r", lease_s, 0.0)
    with pytest.raises(ValueError, match="nbytes"):
        s.reserve(key(1), 0, {}, "w", 1.0, 0.0)
    assert s.stats().entries == 0


def test_cancel_ends_either_kind_of_lease() -> None:
    s = make()
    w = reserve(s, key(1))
    assert s.cancel(w.lease_id)
    assert s.lookup(key(1), 0.0) is None
    assert s.stats().aborts == 1
    put(s, key(2))
    a = acquire(s, key(2))
    assert s.cancel(a.lease_id)
    info = s.lookup(key(2), 0.0)
    assert info is not None
    assert info.pins == 0
    assert not s.cancel(a.lease_id)
    assert not s.cancel(999)


# ----- refusals -----


def test_refusal_reasons() -> None:
    s = make(pages=4)
    assert s.reserve(key(1), 4 * PAGE + 1, {}, "w", 1.0, 0.0) == Refusal("too_large")
    w = reserve(s, key(1))
    assert s.reserve(key(1), PAGE, {}, "w", 1.0, 0.0) == Refusal("exists")  # WRITING
    s.commit(w.lease_id, 0.0)
    assert s.reserve(key(1), PAGE, {}, "w", 1.0, 0.0) == Refusal("exists")  # READY
    assert s.reserve(key(1, version=2), PAGE, {}, "w", 1.0, 0.0) != Refusal("exists")  # other version
    acquire(s, key(1))  # pinned: not evictable
    reserve(s, key(2), PAGE)  # WRITING: not evictable
    assert s.reserve(key(3), 2 * PAGE, {}, "w", 1.0, 0.0) == Refusal("no_space")
    st_ = s.stats()
    assert (st_.refused_too_large, st_.refused_exists, st_.refused_no_space) == (1, 2, 1)
    assert st_.evictions == 0


def test_no_space_evicts_nothing() -> None:
    s = make(pages=4)
    put(s, key(1), PAGE)
    put(s, key(2), PAGE)
    acquire(s, key(2))
    put(s, key(3), 2 * PAGE)
    acquire(s, key(3))
    # Even after evicting key 1 only one page is free: refuse without evicting it.
    assert s.reserve(key(9), 2 * PAGE, {}, "w", 1.0, 0.0) == Refusal("no_space")
    assert s.lookup(key(1), 0.0) is not None
    assert s.stats().evictions == 0


# ----- LRU and pinning -----


def test_eviction_takes_least_recently_used_first() -> None:
    s = make(pages=3)
    for u in (1, 2, 3):
        put(s, key(u), now=float(u))
    assert s.lru_order() == [key(1), key(2), key(3)]
    s.release(acquire(s, key(1), now=4.0).lease_id)  # 1 becomes most recently used
    assert s.lru_order() == [key(2), key(3), key(1)]
    put(s, key(4), now=5.0)
    assert s.lookup(key(2), 5.0) is None  # evicted
    assert s.lru_order() == [key(3), key(1), key(4)]
    assert s.stats().evictions == 1


def test_pinned_entries_are_never_evicted() -> None:
    s = make(pages=3)
    for u in (1, 2, 3):
        put(s, key(u))
    a = acquire(s, key(1))
    s._lru.move_to_end(key(2))  # make the pinned one the LRU head, then 3, then 2
    s._lru.move_to_end(key(1), last=False)
    put(s, key(4))
    assert s.lookup(key(1), 0.0) is not None
    assert s.lookup(key(3), 0.0) is None
    put(s, key(5))
    assert s.lookup(key(1), 0.0) is not None
    assert s.lookup(key(2), 0.0) is None
    s.release(a.lease_id)
    put(s, key(6))  # unpinned now: evictable again, and it is the LRU one
    assert s.lookup(key(1), 0.0) is None


def test_eviction_frees_enough_contiguous_space() -> None:
    s = make(pages=4)
    for u in range(4):
        put(s, key(u))
    acquire(s, key(1))
    # Page 1 is pinned: evicting everything else leaves [0, 1) and [2, 4), never 3 contiguous pages.
    assert s.reserve(key(9), 3 * PAGE, {}, "w", 1.0, 0.0) == Refusal("no_space")
    # 2 pages: evicts in LRU order (0, then 2: still no 2 contiguous pages, then 3) until it fits.
    r = reserve(s, key(9), 2 * PAGE)
    assert r.offset == 2 * PAGE
    assert s.lookup(key(1), 0.0) is not None
    assert s.stats().evictions == 3


def test_lookup_has_no_side_effects() -> None:
    s = make(pages=8)
    for u in (1, 2, 3):
        put(s, key(u), now=float(u))
    a = acquire(s, key(2), now=3.5)
    w = reserve(s, key(4), now=3.6)
    keys = [key(u) for u in (1, 2, 3, 4, 5)]
    before = snapshot(s, 4.0, keys)
    for _ in range(3):
        for k in keys:
            s.lookup(k, 4.0)
    assert snapshot(s, 4.0, keys) == before
    assert s.lru_order() == [key(1), key(3), key(2)]
    # lookup extends nothing: key 1 (committed at 1.0) still expires at 11.0.
    assert s.lookup(key(1), 10.99) is not None
    assert s.lookup(key(1), 11.0) is None
    s.release(a.lease_id)
    s.abort(w.lease_id)


# ----- time: TTL and lease expiry -----


def test_ready_entries_expire_after_ttl_unless_pinned() -> None:
    s = make()
    put(s, key(1), now=0.0)
    put(s, key(2), now=0.0)
    a = acquire(s, key(2), now=5.0, lease_s=MAX_LEASE)  # pin until 10.0; TTL restarts: 15.0
    assert s.expire(9.9).entries == 0
    counts = s.expire(10.0)
    assert (counts.entries, counts.pins) == (1, 1)  # key 1 by TTL; key 2's pin by its deadline
    assert s.lookup(key(1), 10.0) is None
    assert s.lookup(key(2), 10.0) is not None
    with pytest.raises(LeaseError, match="unknown_lease"):
        s.release(a.lease_id)  # swept pins are gone
    assert s.expire(15.0).entries == 1
    st_ = s.stats()
    assert (st_.expirations, st_.pin_expirations, st_.entries) == (2, 1, 0)


def test_pinned_entry_outlives_its_ttl() -> None:
    s = Store(4 * PAGE, ttl_s=2.0, max_lease_s=MAX_LEASE, check=True)
    put(s, key(1), now=0.0)
    a = acquire(s, key(1), now=1.0, lease_s=MAX_LEASE)  # TTL -> 3.0, pin -> 6.0
    assert s.expire(5.0).entries == 0
    assert s.lookup(key(1), 5.0) is not None
    assert s.reserve(key(2), 4 * PAGE, {}, "w", 1.0, 5.0) == Refusal("no_space")  # it is pinned
    assert s.lookup(key(1), 5.0) is not None
    s.release(a.lease_id)  # unpinned and past its TTL: gone at the next sweep
    assert s.lookup(key(1), 5.0) is None
    assert s.expire(5.0).entries == 1


def test_dead_entries_read_as_absent_before_the_sweep() -> None:
    s = make()
    put(s, key(1), now=0.0)
    assert s.lookup(key(1), TTL) is None  # past TTL, not swept yet
    assert s.stats().entries == 1
    assert s.acquire(key(1), "r", 1.0, TTL) is None  # a miss, and the entry is reclaimed
    st_ = s.stats()
    assert (st_.entries, st_.expirations, st_.misses) == (0, 1, 1)
    put(s, key(2), now=0.0)
    r = reserve(s, key(2), now=TTL + 1)  # a dead entry does not block a new write
    assert r.lease_id > 0


def test_write_lease_expiry() -> None:
    s = make()
    r = reserve(s, key(1), now=0.0, lease_s=2.0)
    assert s.expire(1.9).writes == 0
    assert s.lookup(key(1), 1.9) is not None
    assert s.lookup(key(1), 2.0) is None
    assert s.expire(2.0).writes == 1
    with pytest.raises(LeaseError, match="unknown_lease"):
        s.commit(r.lease_id, 2.0)
    assert s.stats().write_expirations == 1
    assert s.stats().used_bytes == 0


def test_commit_after_the_deadline_is_refused_even_before_the_sweep() -> None:
    s = make()
    r = reserve(s, key(1), now=0.0, lease_s=2.0)
    with pytest.raises(LeaseError, match="lease_expired"):
        s.commit(r.lease_id, 2.5)
    assert s.lookup(key(1), 2.5) is None
    assert s.stats().write_expirations == 1
    reserve(s, key(1), now=2.5)  # the key is free again


def test_expired_writes_make_room_for_new_reservations() -> None:
    s = make(pages=2)
    reserve(s, key(1), 2 * PAGE, now=0.0, lease_s=1.0)
    assert s.reserve(key(2), PAGE, {}, "w", 1.0, 0.5) == Refusal("no_space")
    r = reserve(s, key(2), PAGE, now=1.0)  # reserve sweeps the dead write before refusing
    assert r.offset == 0


# ----- random sequences -----


class StoreMachine(RuleBasedStateMachine):
    """Random interleavings of every operation; the model tracks what must hold regardless."""

    def __init__(self) -> None:
        super().__init__()
        self.store = Store(8 * PAGE, ttl_s=TTL, max_lease_s=MAX_LEASE, check=True, presence=presence_index(4))
        self.now = 0.0
        self.writes: dict[int, tuple[EntryKey, float]] = {}  # lease -> key, deadline
        self.reads: dict[int, tuple[EntryKey, float]] = {}

    keys = st.builds(key, st.integers(0, 5), st.integers(0, 1))

    @rule(k=keys, pages=st.integers(1, 5), lease_s=st.floats(0.5, MAX_LEASE))
    def reserve(self, k: EntryKey, pages: int, lease_s: float) -> None:
        was_live = self.store.lookup(k, self.now) is not None
        pinned = {rk for rk, dl in self.reads.values() if dl > self.now}
        r = self.store.reserve(k, pages * PAGE - 7, {"k": k.user_id}, "w", lease_s, self.now)
        if isinstance(r, Refusal):
            assert (r.reason == "exists") == was_live
        else:
            assert not was_live
            self.writes[r.lease_id] = (k, self.now + lease_s)
        for pk in pinned:  # a pinned entry survives any reservation
            info = self.store.lookup(pk, self.now)
            assert info is not None
            assert info.state is EntryState.READY

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        if not self.writes:
            return
        lease_id = data.draw(st.sampled_from(sorted(self.writes)))
        k, deadline = self.writes.pop(lease_id)
        try:
            self.store.commit(lease_id, self.now)
        except LeaseError:
            assert deadline <= self.now
        else:
            assert deadline > self.now
            info = self.store.lookup(k, self.now)
            assert info is not None
            assert info.state is EntryState.READY
            assert self.store.lru_order()[-1] == k

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        if self.writes:
            lease_id = data.draw(st.sampled_from(sorted(self.writes)))
            del self.writes[lease_id]
            with contextlib.suppress(LeaseError):  # swept after its deadline
                self.store.abort(lease_id)

    @rule(k=keys, lease_s=st.floats(0.5, MAX_LEASE))
    def acquire(self, k: EntryKey, lease_s: float) -> None:
        info = self.store.lookup(k, self.now)
        a = self.store.acquire(k, "r", lease_s, self.now)
        assert (a is not None) == (info is not None and info.state is EntryState.READY)
        if a is not None:
            assert a.meta == {"k": k.user_id}
            self.reads[a.lease_id] = (k, self.now + lease_s)
            assert self.store.lru_order()[-1] == k

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.reads:
            lease_id = data.draw(st.sampled_from(sorted(self.reads)))
            del self.reads[lease_id]
            with contextlib.suppress(LeaseError):  # swept after its deadline
                self.store.release(lease_id)

    @rule(dt=st.floats(0.0, 6.0))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule()
    def expire(self) -> None:
        self.store.expire(self.now)
        for lease_id, (_, deadline) in list(self.writes.items()) + list(self.reads.items()):
            if deadline <= self.now:
                self.writes.pop(lease_id, None)
                self.reads.pop(lease_id, None)

    @rule(k=keys)
    def lookup_changes_nothing(self, k: EntryKey) -> None:
        before = (self.store.lru_order(), asdict(self.store.stats()))
        self.store.lookup(k, self.now)
        assert (self.store.lru_order(), asdict(self.store.stats())) == before

    @invariant()
    def consistent(self) -> None:
        self.store.check_invariants()
        stats = self.store.stats()
        assert stats.used_bytes + stats.free_bytes == stats.capacity
        for k, deadline in self.reads.values():  # live pins keep their entry READY
            if deadline > self.now:
                info = self.store.lookup(k, self.now)
                assert info is not None
                assert info.state is EntryState.READY
                assert info.pins >= 1


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
