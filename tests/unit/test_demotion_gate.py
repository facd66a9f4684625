"""The demotion gate: host DRAM gets consumed psi while reloads pay for the copies."""

from __future__ import annotations

import pytest

from services.ranker.demotion_gate import DemotionGate


def test_open_until_enough_demotions_are_measured_or_while_a_cost_is_unknown():
    gate = DemotionGate(sample_every=8, min_demotions=4)
    for _ in range(3):
        gate.demoted()
    assert gate.reload_yield is None
    assert gate.admits(1, saving_ms=1.0, cost_ms=100.0)  # not measured enough: assumed to pay
    gate.demoted()
    assert gate.reload_yield == 0.0
    assert not gate.earns(saving_ms=1.0, cost_ms=0.3)
    assert gate.earns(saving_ms=None, cost_ms=0.3)  # nothing to weigh by: open
    assert gate.earns(saving_ms=1.0, cost_ms=None)


def test_copies_pay_when_yield_times_saving_covers_the_copy():
    # The length mix on an H200 (k11b): ~2000 demotions, no reload: closed. L4096 (k11a): 8% of
    # demotions reloaded, 1.6 ms saved each, 0.3 ms of host a copy: closed (0.13 < 0.3). At 16384
    # tokens a reload saves ~16 ms: 2.5% suffices.
    gate = DemotionGate(min_demotions=100, memory=1000.0)
    for i in range(1000):
        gate.demoted()
        if i % 12 == 0:
            gate.reloaded()
    assert gate.reload_yield == pytest.approx(1 / 12, rel=0.1)
    assert not gate.earns(saving_ms=1.6, cost_ms=0.3)
    assert gate.earns(saving_ms=16.0, cost_ms=0.4)


def test_closed_it_still_copies_a_fixed_sample_of_users_and_reopens_when_reloads_come():
    gate = DemotionGate(sample_every=4, min_demotions=10, memory=50.0)
    for _ in range(50):
        gate.demoted()
    admitted = [u for u in range(40) if gate.admits(u, saving_ms=2.0, cost_ms=0.3)]
    assert admitted == list(range(0, 40, 4))  # the same users each time: their yield is measured
    for _ in range(50):  # the sample's copies now come back: a later workload, a larger arena
        gate.demoted()
        gate.reloaded()
    assert gate.reload_yield == pytest.approx(1.0, rel=0.4)
    assert all(gate.admits(u, saving_ms=2.0, cost_ms=0.3) for u in range(40))


def test_recent_demotions_weigh_most():
    gate = DemotionGate(min_demotions=1, memory=100.0)
    for user in range(100):
        assert gate.admits(user, saving_ms=None, cost_ms=None)
        gate.demoted()
        gate.reloaded()
    for user in range(500):  # reloads stopped long ago
        if gate.admits(user, saving_ms=None, cost_ms=None):
            gate.demoted()
    assert gate.reload_yield is not None
    assert gate.reload_yield < 0.01


def test_closed_for_long_it_reopens_within_its_memory_of_candidates():
    """The gate forgets by candidates, not by copies: closed, it copies one candidate in
    `sample_every`, and a memory counted in copies would reach that many times further back.
    At 16384 tokens (k20b) a benchmark's low-rate points closed the gate with copies of psi
    whose users never came back, and at its high rates it had not reopened."""
    memory, every = 200.0, 8
    gate = DemotionGate(sample_every=every, min_demotions=10, memory=memory)
    for user in range(20 * int(memory)):  # long closed: nothing copied came back
        if gate.admits(user, saving_ms=2.0, cost_ms=0.3):
            gate.demoted()
    assert not gate.earns(saving_ms=2.0, cost_ms=0.3)
    copies_before = gate._counted
    reopened_after = None
    for n, user in enumerate(range(10**6, 10**6 + 4 * int(memory))):  # now every copy comes back
        if gate.admits(user, saving_ms=2.0, cost_ms=0.3):
            if user % every:  # not one of the sample: the gate is open again
                reopened_after = n
                break
            gate.demoted()
            gate.reloaded()
    assert reopened_after is not None
    # It opens at a yield of 0.3 / 2 = 0.15: here after a few of the sample's copies came back
    # (~memory / every copies in its window); counted in copies, 0.15 x memory of them had to.
    assert reopened_after < memory / 2
    assert gate._counted - copies_before < 0.15 * memory / 2


def test_bad_settings_are_refused():
    for bad in ({"sample_every": 0}, {"min_demotions": -1}, {"memory": 0.5}):
        with pytest.raises(ValueError, match="sample_every"):
            DemotionGate(**bad)
