"""The HBM relay cache's lifecycle, leases, budget and eviction (bookkeeping only, no tensors)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.ranker.hbm_cache import Admission, Claim, EntryState, HbmCache, InvalidTransition, Lease


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make(clock: Clock, budget: int = 100) -> HbmCache:
    return HbmCache(budget_bytes=budget, clock=clock)


def lease(owner: str = "r1", deadline: float = 10.0) -> Lease:
    return Lease(owner, deadline)


def test_happy_path_produce_consume_demote(clock):
    c = make(clock)
    assert c.admit("u", 40, lease()).outcome is Admission.ADMITTED
    assert c.lookup("u").state is EntryState.PRODUCING
    assert c.claim("u").outcome is Claim.IN_FLIGHT
    assert c.produced("u", "psi")
    assert c.lookup("u").state is EntryState.RESIDENT
    hit = c.claim("u")
    assert hit.outcome is Claim.HIT
    assert hit.handle == "psi"
    assert c.lookup("u").state is EntryState.CONSUMED
    assert c.lookup("u").lease is None
    c.unpin("u")
    assert c.pin_for_copy("u") == "psi"
    c.demoted("u", ok=True, keep=False)
    assert c.lookup("u") is None
    assert c.used_bytes == 0
    assert c.counters.demoted == 1
    assert c.counters.produced == 1


def test_lookup_has_no_side_effects(clock):
    c = make(clock)
    c.admit("u", 10, lease(deadline=5.0))
    c.produced("u", "psi")
    before = c.lookup("u")
    for _ in range(10):
        c.lookup("u")
    clock.now = 6.0
    assert c.lookup("u") == before  # neither the lease nor the pins moved
    assert c.expire() == ["u"]  # and lookups did not keep it alive


def test_expired_lease_frees_and_counts_as_wasted(clock):
    c = make(clock)
    c.admit("u", 30, lease(deadline=1.0))
    c.produced("u", "psi")
    clock.now = 0.5
    assert c.expire() == []
    clock.now = 1.5
    assert c.expire() == ["u"]
    assert c.used_bytes == 0
    assert c.counters.expired == 1


def test_leased_entries_are_never_evicted_budget_refuses_instead(clock):
    c = make(clock, budget=100)
    assert c.admit("a", 60, lease()).outcome is Admission.ADMITTED
    c.produced("a", "psi-a")
    refused = c.admit("b", 50, lease("r2"))
    assert refused.outcome is Admission.REFUSED
    assert refused.reason == "hbm_budget"
    assert c.lookup("a").state is EntryState.RESIDENT
    assert c.counters.refused == 1
    assert c.admit("huge", 101, lease()).reason == "too_large"


def test_consumed_unpinned_entries_are_evicted_lru_first(clock):
    c = make(clock, budget=100)
    for i, key in enumerate(["a", "b", "c"]):
        clock.now = float(i)
        c.admit(key, 30, lease(deadline=100))
        c.produced(key, key)
        c.claim(key)
        c.unpin(key)
    clock.now = 10.0
    c.claim("a")  # a becomes most recently used (and is pinned: not evictable)
    c.unpin("a")
    assert c.admit("d", 40, lease(deadline=100)).outcome is Admission.ADMITTED
    assert c.lookup("b") is None  # least recently consumed went first
    assert c.lookup("a") is not None
    assert c.lookup("c") is not None
    assert c.counters.evicted == 1
    assert c.counters.evicted_undemoted == 1  # b had no host copy: lost to both tiers


def test_pinned_entries_survive_eviction_and_demotion(clock):
    c = make(clock, budget=50)
    c.admit("a", 40, lease())
    c.produced("a", "psi")
    c.claim("a")  # pinned by the running rank
    assert c.admit("b", 20, lease()).outcome is Admission.REFUSED
    assert c.pin_for_copy("a") == "psi"
    c.demoted("a", ok=True, keep=False)  # the rank still holds its pin: HBM copy stays
    assert c.lookup("a").state is EntryState.DEMOTED
    c.unpin("a")
    assert c.lookup("a").pins == 0


def test_demoted_hot_copies_are_hits_evicted_first_and_re_leasable(clock):
    c = make(clock, budget=100)
    for i, key in enumerate(["hot", "cold"]):
        clock.now = float(i)
        c.admit(key, 40, lease(deadline=100))
        c.produced(key, key)
        c.claim(key)
        c.unpin(key)
    c.pin_for_copy("hot")
    c.demoted("hot", ok=True, keep=True)
    assert c.lookup("hot").state is EntryState.DEMOTED
    assert c.claim("hot").outcome is Claim.HIT  # a returning user: no reload
    c.unpin("hot")
    assert c.admit("new", 30, lease()).outcome is Admission.ADMITTED
    assert c.lookup("hot") is None  # demoted copies go first: their psi is safe in host DRAM
    assert c.lookup("cold") is not None
    assert (c.counters.evicted, c.counters.evicted_undemoted) == (1, 0)
    c.admit("cold", 40, lease("r9", deadline=50))
    assert c.lookup("cold").state is EntryState.RESIDENT


def test_new_signal_releases_consumed_entry_without_recompute(clock):
    c = make(clock)
    c.admit("u", 10, lease(deadline=5))
    c.produced("u", "psi")
    c.claim("u")
    c.unpin("u")
    again = c.admit("u", 10, lease("r2", deadline=20))
    assert again.outcome is Admission.ALREADY_RESIDENT
    view = c.lookup("u")
    assert view.state is EntryState.RESIDENT
    assert view.lease == Lease("r2", 20)


def test_second_signal_takes_over_lease_but_never_shortens_it(clock):
    c = make(clock)
    c.admit("u", 10, lease("r1", deadline=9))
    assert c.admit("u", 10, lease("r2", deadline=3)).outcome is Admission.ALREADY_PRODUCING
    assert c.lookup("u").lease == Lease("r2", 9)
    c.produced("u", "psi")
    assert c.admit("u", 10, lease("r3", deadline=12)).outcome is Admission.ALREADY_RESIDENT
    assert c.lookup("u").lease == Lease("r3", 12)


def test_failed_production_frees(clock):
    c = make(clock)
    c.admit("u", 10, lease())
    c.production_failed("u")
    assert c.lookup("u") is None
    assert c.used_bytes == 0
    assert c.counters.failed == 1
    assert not c.produced("u", "late psi")  # a late result is refused: the caller drops it


def test_invalid_transitions_raise(clock):
    c = make(clock)
    with pytest.raises(InvalidTransition):
        c.unpin("nothing")
    c.admit("u", 10, lease())
    c.produced("u", "psi")
    e = c._entries["u"]
    with pytest.raises(InvalidTransition):
        c._move(e, EntryState.DEMOTED)  # resident psi cannot be demoted before it is consumed


def consumed(c: HbmCache, clock: Clock, key: str, nbytes: int) -> None:
    """An entry produced and consumed at the clock's time (unpinned: its call is done)."""
    c.admit(key, nbytes, lease())
    c.produced(key, f"psi-{key}")
    c.claim(key)
    c.unpin(key)


def test_under_pressure_the_least_recently_used_consumed_psi_is_demoted_ahead_of_eviction(clock):
    c = make(clock, budget=100)
    for t, key in enumerate(["a", "b", "c"]):
        clock.now = float(t)
        consumed(c, clock, key, 30)
    assert c.demotion_candidates(reserve_bytes=10) == []  # 90 + 10 fits the budget
    assert c.demotion_candidates(reserve_bytes=30) == ["a"]  # 20 over: the oldest covers it
    assert c.demotion_candidates(reserve_bytes=50) == ["a", "b"]  # 40 over: two
    assert c.demotion_candidates(reserve_bytes=30, in_flight_bytes=30) == []  # a copy under way covers it
    clock.now = 5.0
    c.claim("a")  # a returning call: "a" is now the most recently used, and pinned by its call
    assert c.demotion_candidates(reserve_bytes=30) == ["b"]
    c.unpin("a")
    # A demoted entry covers the room it frees; then eviction takes it first.
    assert c.pin_for_copy("b") == "psi-b"
    c.demoted("b", ok=True, keep=True)
    assert c.demotion_candidates(reserve_bytes=30) == []
    assert c.admit("d", 30, lease()).outcome is Admission.ADMITTED
    assert c.lookup("b") is None  # the demoted copy went, the undemoted ones stayed
    assert c.counters.evicted_undemoted == 0
    assert c.demotion_candidates(reserve_bytes=30) == ["c"]  # leased "d" is never a candidate


def test_settled_candidates_cover_their_room_without_being_picked_again(clock):
    """Entries settled to go without a copy (the demotion gate declined them) count as covered:
    the next candidates are the ones after them, none while they cover the reserve, and
    eviction takes them before the other consumed psi, until a call reads one again."""
    c = make(clock)  # budget 100
    for t, key in enumerate(["a", "b", "c"]):
        clock.now = float(t)
        consumed(c, clock, key, 30)
    assert c.demotion_candidates(reserve_bytes=50) == ["a", "b"]
    assert c.settle("a")
    assert not c.settle("a")  # once
    assert c.demotion_candidates(reserve_bytes=50) == ["b"]
    assert c.demotion_candidates(reserve_bytes=30) == []  # "a" alone covers 20 over
    assert c.settle("b")
    assert c.demotion_candidates(reserve_bytes=80) == ["c"]  # 70 over
    clock.now = 5.0
    c.claim("a")  # read again: a candidate again, the most recently used
    c.unpin("a")
    assert c.demotion_candidates(reserve_bytes=80) == ["c", "a"]
    assert c.admit("d", 30, lease()).outcome is Admission.ADMITTED
    assert c.lookup("b") is None  # the settled one went first
    assert c.counters.evicted_undemoted == 1
    assert not c.settle("d")  # leased: not one to settle


def test_eviction_takes_demoted_psi_least_recently_used_first_then_consumed(clock):
    """Hot copies (DEMOTED) go before consumed psi without a copy, whatever their age; among
    them the least recently used first, a copy demoted late by its last use, not by its copy."""
    c = make(clock, budget=120)
    for t, key in enumerate(["a", "b", "c", "d"]):
        clock.now = float(t)
        consumed(c, clock, key, 30)
    for key in ("c", "a"):  # c's copy finishes first, a's later: a was used before c
        c.pin_for_copy(key)
        c.demoted(key, ok=True, keep=True)
    clock.now = 10.0
    assert c.admit("e", 30, lease()).outcome is Admission.ADMITTED
    assert c.lookup("a") is None  # the oldest hot copy went first
    assert [k for k in ("b", "c", "d") if c.lookup(k) is not None] == ["b", "c", "d"]
    c.claim("c")  # read again: now the most recently used hot copy ...
    c.unpin("c")
    c.produced("e", "psi-e")
    assert c.admit("f", 30, lease()).outcome is Admission.ADMITTED
    assert c.lookup("c") is None  # ... and still a hot copy: it goes before b and d
    assert c.lookup("b") is not None
    assert c.admit("g", 30, lease()).outcome is Admission.ADMITTED
    assert c.lookup("b") is None  # then consumed psi, least recently used first
    assert c.counters.evicted_undemoted == 1


def test_release_without_host_tier(clock):
    c = make(clock)
    c.admit("u", 10, lease())
    c.produced("u", "psi")
    c.claim("u")
    c.release("u")  # pinned: stays
    assert c.lookup("u") is not None
    c.unpin("u")
    c.release("u")
    assert c.lookup("u") is None
    assert c.counters.released == 1


ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["admit", "produce", "fail", "claim", "unpin", "copy", "demote", "release", "tick", "settle"]
        ),
        st.integers(0, 4),
        st.integers(1, 60),
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(ops)
@example(
    [("admit", 0, 6), ("produce", 0, 6), ("claim", 0, 6), ("unpin", 0, 6), ("copy", 0, 6)]
)  # kept demoted
def test_invariants_under_random_operations(sequence):
    clock = Clock()
    c = make(clock, budget=100)
    pins: dict[int, int] = {}
    for op, key, size in sequence:
        if op == "admit":
            c.admit(key, size, Lease("o", clock.now + 3))
        elif op == "produce":
            c.produced(key, f"psi{key}")
        elif op == "fail":
            c.production_failed(key)
        elif op == "claim":
            if c.claim(key).outcome is Claim.HIT:
                pins[key] = pins.get(key, 0) + 1
        elif op == "unpin" and pins.get(key):
            c.unpin(key)
            pins[key] -= 1
        elif op == "copy":
            if c.pin_for_copy(key) is not None:
                c.demoted(key, ok=size % 2 == 0, keep=size % 3 == 0)
        elif op == "release":
            c.release(key)
        elif op == "settle":
            c.settle(key)
        elif op == "tick":
            clock.now += size / 10
            c.expire()
        entries = c._entries.values()
        assert c.used_bytes == sum(e.nbytes for e in entries) <= c.budget_bytes
        assert all(e.state not in (EntryState.EXPIRED, EntryState.FREED) for e in entries)  # terminal: gone
        # The bookkeeping that spares eviction a sort: unleased entries, least recently used first.
        unleased = [e for e in entries if e.state in (EntryState.CONSUMED, EntryState.DEMOTED)]
        assert set(c._resident) == {e.key for e in entries if e.state is EntryState.RESIDENT}
        for state in (EntryState.CONSUMED, EntryState.DEMOTED):  # one order per state
            held = {e.key for e in unleased if e.state is state and not e.settled}
            assert set(c._lru[state]) == held
            used_at = [e.last_used for e in c._lru[state].values()]
            assert used_at == sorted(used_at)
        settled = [e for e in entries if e.settled]
        assert all(e.state is EntryState.CONSUMED and e.pins == 0 for e in settled)
        assert set(c._settled) == {e.key for e in settled}
        assert c._settled_bytes == sum(e.nbytes for e in settled)
        assert c.leased_bytes == sum(
            e.nbytes for e in entries if e.state in (EntryState.PRODUCING, EntryState.RESIDENT)
        )
        assert c.producing == sum(1 for e in entries if e.state is EntryState.PRODUCING)
        assert c.evictable_bytes == sum(e.nbytes for e in unleased if e.pins == 0)
        for k, n in pins.items():
            if n:  # a pinned entry is never gone
                assert c.lookup(k) is not None
                assert c.lookup(k).pins >= n


def test_variants_are_the_other_entries_of_a_group_until_they_leave(clock):
    """Keys grouped by name (the ranker: (user, prefix version, model)); a claim is by key only."""
    c = HbmCache(100, clock, group_of=lambda key: key[0])
    c.admit(("u", "old"), 30, lease())
    assert c.variants(("u", "new")) == [("u", "old")]
    assert c.variants(("u", "old")) == []
    assert c.variants(("v", "new")) == []
    c.produced(("u", "old"), "psi-old")
    assert c.claim(("u", "new")).outcome is Claim.MISS  # another content: never this psi
    assert c.lookup(("u", "old")).state is EntryState.RESIDENT  # and untouched
    clock.now = 11.0
    c.expire()
    assert c.variants(("u", "new")) == []
    assert make(clock).variants(("u", "new")) == []  # no groups: no variants


def test_a_lowered_budget_frees_unleased_psi_in_eviction_order_and_keeps_leased_psi(clock):
    """The device refused memory the budget allowed (relay_cache.py): the budget drops, unleased
    psi is freed (demoted first, then least recently used) until what is held fits, leased psi
    stays for its call, and admissions between the new and the configured budget are refused
    for room, not as too large."""
    c = make(clock, budget=100)
    for key, nbytes in (("leased", 30), ("old", 20), ("new", 20), ("copied", 20)):
        c.admit(key, nbytes, lease())
        c.produced(key, "psi")
        if key != "leased":
            clock.now += 1.0
            c.claim(key)
            c.unpin(key)
    c.pin_for_copy("copied")
    c.demoted("copied", ok=True, keep=True)
    assert c.used_bytes == 90
    assert c.lower_budget(55) == 40  # the demoted copy, then the least recently used
    assert c.budget_bytes == 55
    assert c.configured_bytes == 100
    assert [c.lookup(k) is not None for k in ("leased", "old", "new", "copied")] == [True, False, True, False]
    assert c.counters.budget_lowered == 1
    assert c.counters.evicted == 2
    assert c.counters.evicted_undemoted == 1
    assert c.lower_budget(0) == 20  # below the leased psi: it stays
    assert c.used_bytes == 30
    assert c.lookup("leased").state is EntryState.RESIDENT
    refused = c.admit("u", 10, lease())
    assert refused.outcome is Admission.REFUSED
    assert refused.reason == "hbm_budget"
    assert c.admit("huge", 101, lease()).reason == "too_large"
    assert c.lower_budget(80) == 0
    assert c.budget_bytes == 0
    assert c.counters.budget_lowered == 2
