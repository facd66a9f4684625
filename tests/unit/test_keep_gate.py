"""The keep gate: a full ranking keeps its prefix's psi while later reads of kept psi pay for it."""

from __future__ import annotations

import pytest

from services.ranker.keep_gate import KeepGate


def test_open_until_enough_psi_is_kept_or_while_a_cost_is_unknown():
    gate = KeepGate(sample_every=8, min_kept=4)
    for _ in range(3):
        gate.kept()
    assert gate.reuse is None
    assert gate.admits(1, saving_ms=0.1, cost_ms=100.0)  # not measured enough: assumed to pay
    gate.kept()
    assert gate.reuse == 0.0
    assert not gate.earns(saving_ms=1.0, cost_ms=0.5)
    assert gate.earns(saving_ms=None, cost_ms=0.5)  # nothing to weigh by: open
    assert gate.earns(saving_ms=1.0, cost_ms=None)


def test_keeping_pays_where_reads_times_saving_cover_the_host_time():
    # The length mix on an H200 (k12c): ~0.9 reads per kept psi; a read saves 0.1-0.4 ms of
    # device time at 512-1024 tokens, 1.1 at 2048, 2.7 at 4096; keeping cost ~1 ms of host.
    gate = KeepGate(min_kept=100, memory=1000.0)
    for i in range(1000):
        gate.kept()
        if i % 10:
            gate.read()
    assert gate.reuse == pytest.approx(0.9, rel=0.1)
    assert not gate.earns(saving_ms=0.3, cost_ms=1.0)  # 768 tokens: closed
    assert gate.earns(saving_ms=2.7, cost_ms=1.0)  # 4096 tokens: open
    # Sessions of many calls read each psi more than once: the gate opens for shorter prefixes.
    for user in range(3000):
        assert gate.admits(user, saving_ms=None, cost_ms=None)
        gate.kept()
        gate.read()
        gate.read()
        gate.read()
    assert gate.reuse == pytest.approx(3.0, rel=0.05)
    assert gate.earns(saving_ms=0.4, cost_ms=1.0)


def test_closed_it_keeps_for_a_fixed_sample_of_users_and_reopens_when_reads_come():
    gate = KeepGate(sample_every=4, min_kept=10, memory=50.0)
    for _ in range(50):
        gate.kept()
    admitted = [u for u in range(40) if gate.admits(u, saving_ms=2.0, cost_ms=1.0)]
    assert admitted == list(range(0, 40, 4))  # the same users each time: their reads are measured
    for _ in range(50):  # the sample's psi is now read back: users returning within their session
        gate.kept()
        gate.read()
    assert gate.reuse == pytest.approx(1.0, rel=0.4)
    assert all(gate.admits(u, saving_ms=2.0, cost_ms=1.0) for u in range(40))


def test_bad_settings_are_refused():
    for bad in ({"sample_every": 0}, {"min_kept": -1}, {"memory": 0.5}):
        with pytest.raises(ValueError, match=">= "):
            KeepGate(**bad)
