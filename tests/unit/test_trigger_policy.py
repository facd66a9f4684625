"""The trigger's latency model, admission decisions and ledger (pure, no I/O)."""

from __future__ import annotations

import pytest

from services.trigger.admission import Bounds, InstanceLedger, Policy, Reason, decide
from services.trigger.latency_model import LatencyModel, Sample
from shared.modelspec import preset

BOUNDS = Bounds(slo_ms=50.0, risk_fraction=0.5, footprint_fraction=0.9, max_backlog=2)


def test_latency_model_fits_the_rankers_measurements():
    model = LatencyModel(preset("bench"), assumed_tflops=200.0)
    assert not model.calibrated
    uncalibrated = model.full_ms(8192)
    assert uncalibrated > model.full_ms(1024) > 0
    truth = {n: 1.0 + 0.002 * n + 1e-7 * n * n for n in (512, 1024, 2048, 4096, 8192)}
    model.observe([Sample(n, ms) for n, ms in truth.items()])
    assert model.calibrated
    for n, ms in truth.items():
        assert model.full_ms(n) == pytest.approx(ms, rel=1e-6)
    assert model.predict(4096, queue_depth=2, queued_tokens=1024) == pytest.approx(
        truth[4096] + 2 * truth[1024]
    )


def test_latency_model_never_predicts_speed_ups_at_length():
    model = LatencyModel(preset("tiny"), assumed_tflops=1.0)
    model.observe([Sample(n, 10.0 + n * 0.01 - n * n * 1e-7) for n in (100, 1000, 2000, 4000)])
    assert model.full_ms(100_000) > model.full_ms(4000)


def ledger(budget: int = 1000, resident: int = 0, backlog: int = 0) -> InstanceLedger:
    led = InstanceLedger()
    led.report(0.0, budget, resident, backlog, 0)
    return led


def test_decisions_in_order():
    key = (1, 1)
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 20.0, 100, ledger(), key, 1.0) is Reason.NOT_AT_RISK
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 30.0, 100, ledger(), key, 1.0) is Reason.ADMITTED
    assert (
        decide(Policy.SEQUENCE_AWARE, BOUNDS, 30.0, 100, ledger(resident=850), key, 1.0)
        is Reason.FOOTPRINT_BOUND
    )
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 30.0, 100, ledger(backlog=2), key, 1.0) is Reason.LOAD_BOUND
    led = ledger()
    led.admit(key, 100, now=1.0, lease_deadline=3.0)
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 30.0, 100, led, key, 2.0) is Reason.ALREADY_RESIDENT
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 30.0, 100, led, key, 4.0) is Reason.ADMITTED  # lease over


def test_ablation_policies():
    assert decide(Policy.ALL, BOUNDS, 1.0, 10**9, ledger(resident=10**9), (1, 1), 0.0) is Reason.ADMITTED
    assert decide(Policy.OFF, BOUNDS, 1e9, 1, ledger(), (1, 1), 0.0) is Reason.NOT_AT_RISK


def test_ledger_counts_admissions_until_a_later_report_or_the_lease_end():
    led = ledger(budget=1000, resident=100, backlog=0)
    led.admit((1, 1), 200, now=1.0, lease_deadline=5.0)
    led.admit((2, 1), 300, now=2.0, lease_deadline=2.5)
    assert led.resident_bytes() == 600
    assert led.backlog() == 2
    led.forget_expired(3.0)
    assert led.resident_bytes() == 300
    led.report(4.0, 1000, 250, 1, 0)  # the ranker now reports user 1's psi itself
    assert led.resident_bytes() == 250
    assert led.backlog() == 1
    assert led.is_admitted((1, 1), 4.5)


def test_latency_model_ignores_a_stalled_batch():
    model = LatencyModel(preset("tiny"), assumed_tflops=1.0)
    truth = {n: 2.0 + 0.01 * n for n in (100, 200, 400, 800, 1600, 3200)}
    samples = [Sample(n, ms) for n, ms in truth.items() for _ in range(3)]
    samples.append(Sample(100, 3000.0))  # a compile stall
    model.observe(samples)
    assert model.full_ms(100) == pytest.approx(truth[100], rel=0.05)
