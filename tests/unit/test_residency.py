"""ResidencyMap: side-effect-free lookups, version match, deadlines, bounded size (clock passed in)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.residency import Residency, ResidencyMap


def test_record_and_lookup_until_the_deadline():
    m = ResidencyMap()
    m.record(7, 3, "a:1", deadline=10.0, now=0.0, fingerprint=5)
    assert m.lookup(7, 3, now=9.99) == Residency(7, 3, 5, "a:1", 10.0)
    assert m.lookup(7, 3, now=10.0) is None  # the lease has passed
    assert m.lookup(8, 3, now=1.0) is None


def test_lookup_needs_the_same_prefix_version():
    m = ResidencyMap()
    m.record(7, 3, "a:1", 10.0, 0.0, fingerprint=5)
    assert m.lookup(7, 4, 1.0) is None
    m.record(7, 4, "b:1", 10.0, 1.0, fingerprint=5)  # a newer pre-inference replaces the entry
    assert m.lookup(7, 3, 1.0) is None
    assert m.lookup(7, 4, 1.0).instance == "b:1"
    assert len(m) == 1


def test_an_entry_names_its_psi_by_content_and_the_latest_pre_inference_wins():
    m = ResidencyMap()
    m.record(7, 3, "a:1", 10.0, 0.0, fingerprint=0xAAAA)
    assert m.lookup(7, 3, 1.0).fingerprint == 0xAAAA
    # Other tokens under the same prefix version, pre-inferred elsewhere: the entry follows them.
    m.record(7, 3, "b:1", 10.0, 1.0, fingerprint=0xBBBB)
    entry = m.lookup(7, 3, 2.0)
    assert (entry.instance, entry.fingerprint) == ("b:1", 0xBBBB)
    assert len(m) == 1


def test_lookup_has_no_side_effects():
    m = ResidencyMap(max_entries=2)
    m.record(1, 1, "a", 10.0, 0.0, fingerprint=5)
    m.record(2, 1, "a", 10.0, 0.0, fingerprint=5)
    for _ in range(5):
        assert m.lookup(1, 1, 5.0) is not None  # neither refreshes nor reorders
    m.record(3, 1, "a", 10.0, 0.0, fingerprint=5)
    assert m.lookup(1, 1, 5.0) is None  # still the oldest recorded, so evicted
    assert m.lookup(2, 1, 5.0) is not None
    assert m.evicted == 1
    assert m.lookup(2, 1, 50.0) is None
    assert len(m) == 2  # an expired lookup does not drop anything either


def test_bounded_size_evicts_the_oldest_recorded():
    m = ResidencyMap(max_entries=3)
    for user in range(10):
        m.record(user, 1, "a", 100.0, float(user), fingerprint=5)
    assert len(m) == 3
    assert [u for u in range(10) if m.lookup(u, 1, 50.0)] == [7, 8, 9]
    m.record(7, 1, "b", 100.0, 11.0, fingerprint=5)  # re-recording makes it the newest
    m.record(10, 1, "a", 100.0, 12.0, fingerprint=5)
    assert [u for u in range(11) if m.lookup(u, 1, 50.0)] == [7, 9, 10]


def test_expire_drops_only_passed_entries_and_respects_re_records():
    m = ResidencyMap()
    m.record(1, 1, "a", 5.0, 0.0, fingerprint=5)
    m.record(2, 1, "a", 20.0, 0.0, fingerprint=5)
    m.record(1, 1, "a", 30.0, 1.0, fingerprint=5)  # lease extended by a new signal: the old deadline is stale
    assert m.expire(10.0) == 0
    assert m.lookup(1, 1, 10.0) is not None
    assert m.expire(25.0) == 1
    assert m.lookup(2, 1, 21.0) is None
    assert len(m) == 1
    assert m.expire(30.0) == 1
    assert len(m) == 0


def test_recording_a_passed_deadline_records_nothing_and_clears_the_user():
    m = ResidencyMap()
    m.record(1, 1, "a", 5.0, 0.0, fingerprint=5)
    m.record(1, 2, "b", 3.0, 4.0, fingerprint=5)
    assert len(m) == 0


def test_forget_only_the_named_instance():
    m = ResidencyMap()
    m.record(1, 1, "a", 5.0, 0.0, fingerprint=5)
    m.forget(1, "b")
    assert m.lookup(1, 1, 1.0) is not None
    m.forget(1, "a")
    assert m.lookup(1, 1, 1.0) is None
    m.forget(99)  # unknown users are fine


def test_max_entries_must_be_positive():
    with pytest.raises(ValueError, match="max_entries"):
        ResidencyMap(0)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["record", "expire", "forget"]),
            st.integers(0, 6),  # user
            st.integers(0, 2),  # version
            st.floats(0.5, 20.0),  # lease length
            st.floats(0.0, 3.0),  # time step
        ),
        max_size=80,
    ),
    max_entries=st.integers(1, 5),
)
def test_matches_a_naive_model(ops, max_entries):
    """Against a list-based model: same live entries, never more than max_entries, and the heap
    of deadlines stays bounded."""
    m = ResidencyMap(max_entries)
    model: list[Residency] = []  # oldest recorded first
    now = 0.0
    for op, user, version, lease, step in ops:
        now += step
        if op == "record":
            model = [e for e in model if e.user_id != user]
            model.append(Residency(user, version, 5, "i", now + lease))
            model = model[-max_entries:]
            m.record(user, version, "i", now + lease, now, fingerprint=5)
        elif op == "expire":
            model = [e for e in model if e.deadline > now]
            m.expire(now)
        else:
            model = [e for e in model if e.user_id != user]
            m.forget(user)
        assert len(m) <= max_entries
        assert len(m._deadlines) <= 2 * len(m) + 64 + 1
        for u in range(7):
            for v in range(3):
                expected = next((e for e in model if e.user_id == u and e.prefix_version == v), None)
                if expected is not None and expected.deadline <= now:
                    expected = None
                assert m.lookup(u, v, now) == expected
