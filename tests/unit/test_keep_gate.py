"""The keep gate: a full ranking keeps its prefix's psi while later reads of kept psi pay for it."""

from __future__ import annotations

import pytest

from services.ranker.keep_gate import PROBE_EVERY, KeepDeviceCost, KeepGate, probed


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


def _batches(cost: KeepDeviceCost, n: int, per_token_s: float, bias: float, keep_every: int) -> None:
    """Full batches of 1-3 calls at 1024-4096 tokens, every `keep_every`-th call keeping its psi;
    their time `bias` x the prediction plus `per_token_s` a kept token, the prediction being
    what the engine's fit says (which the keeping batches feed, hence the bias)."""
    for i in range(n):
        calls = 1 + i % 3
        lengths = [1024 * (1 + (i + c) % 4) for c in range(calls)]
        predicted = sum(0.5e-3 + 0.7e-6 * n_tokens for n_tokens in lengths)
        kept = sum(n_tokens for c, n_tokens in enumerate(lengths) if (i + c) % keep_every == 0)
        cost.observe(predicted, bias * predicted + per_token_s * kept, kept)


def test_the_device_time_of_a_keep_is_told_apart_from_the_fits_bias():
    # ~0.27 ms a 4096-token keep (k29a bench.core, H100): 66 ns a token.
    cost = KeepDeviceCost(memory=256.0, min_batches=8)
    assert cost.per_token_s is None
    assert cost.ms_per_keep(4096) is None
    _batches(cost, 200, per_token_s=66e-9, bias=0.93, keep_every=2)
    assert cost.per_token_s == pytest.approx(66e-9, rel=1e-6)
    assert cost.ms_per_keep(4096) == pytest.approx(0.27, rel=0.01)
    assert not cost.needs_plain
    # Keeping for free: nothing, whatever the fit's bias.
    free = KeepDeviceCost(min_batches=8)
    _batches(free, 200, per_token_s=0.0, bias=1.2, keep_every=3)
    assert free.per_token_s == pytest.approx(0.0, abs=1e-12)


def test_without_plain_batches_the_cost_is_unknown_and_plain_ones_are_wanted():
    cost = KeepDeviceCost(memory=64.0, min_batches=4)
    _batches(cost, 100, per_token_s=66e-9, bias=1.0, keep_every=1)  # every call keeps
    assert cost.per_token_s is None
    assert cost.needs_plain
    # A few plain batches (the probe's users) and the fit can tell.
    for i in range(10):
        cost.observe(1e-3 * (1 + i % 3), 1e-3 * (1 + i % 3), 0)
    assert cost.per_token_s == pytest.approx(66e-9, rel=0.05)
    # Ten of the last ~64 batches (memory) plain: past PLAIN_SHARE_WANTED, the probe may stop...
    assert not cost.needs_plain
    # ... and resumes once keeping batches crowd the plain ones out again.
    _batches(cost, 300, per_token_s=66e-9, bias=1.0, keep_every=1)
    assert cost.needs_plain
    # Proportional keeps (kept tokens a fixed share of the prediction, no plain batch) cannot
    # be told from a bias.
    flat = KeepDeviceCost(min_batches=1)
    for _ in range(50):
        flat.observe(2e-3, 2.2e-3, 1000)
    flat.observe(2e-3, 2e-3, 0)
    flat.observe(2e-3, 2e-3, 0)
    assert flat.per_token_s is not None  # two plain batches: told apart


def test_bad_measurements_are_ignored_and_bad_settings_refused():
    cost = KeepDeviceCost(min_batches=1)
    for bad in ((0.0, 1e-3, 10), (float("nan"), 1e-3, 10), (1e-3, float("inf"), 10), (1e-3, -1.0, 10)):
        cost.observe(*bad)
    assert cost.per_token_s is None
    assert cost.needs_plain
    with pytest.raises(ValueError, match="memory and min_batches"):
        KeepDeviceCost(memory=0.5)
    with pytest.raises(ValueError, match="memory and min_batches"):
        KeepDeviceCost(min_batches=0)


def test_the_probe_never_takes_a_sampled_user():
    probed_users = [u for u in range(64) if probed(u, sample_every=8)]
    assert probed_users == [u for u in range(64) if u % PROBE_EVERY == PROBE_EVERY - 1]
    assert not any(probed(u, sample_every=1) for u in range(64))  # every user sampled
    assert all(u % 5 for u in range(200) if probed(u, sample_every=5))
