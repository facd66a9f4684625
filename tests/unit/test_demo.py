"""The demo's SLO calibration, its check that the relay run showed something, its headline (which
claims only what its sample supports) and its settings check (pure, no stack)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from relaygr.core_demo import CoreDemoRow, contention_remark
from relaygr.demo import (
    REPORTED_PERCENTILES,
    DemoConfig,
    calibrate,
    check,
    headline,
    min_calls,
    percentile_supported,
    probe_requests,
    relay_problems,
)
from relaygr.workload import Workload, generate
from services.trigger.latency_model import Sample
from shared.config import ConfigError
from shared.stats import percentile

SUFFIX = 16 + 32  # the demo's recent tokens + candidates


@pytest.fixture(scope="module")
def workload() -> Workload:
    return generate(DemoConfig().workload())


def machine(speed: float) -> Callable[[int], float]:
    """A machine's full-ranking compute (ms) by tokens; `speed` divides it."""
    return lambda n: (2.0 + 0.01 * n + 1e-4 * n * n) / speed


def measurements(workload: Workload, compute: Callable[[int], float], overhead_ms: float = 3.0):
    """What probing a stack gives: client latency by prefix length, and the ranker's samples."""
    probes, _ = probe_requests(workload, 90.0)
    measured = {r.prefix_len: compute(r.prefix_len + SUFFIX) + overhead_ms for r in probes}
    samples = [
        Sample(r.prefix_len + SUFFIX, compute(r.prefix_len + SUFFIX)) for r in probes for _ in range(3)
    ]
    return measured, samples


def test_probes_span_the_workload_and_include_its_tail(workload):
    probes, tail = probe_requests(workload, 90.0)
    lengths = [r.prefix_len for r in probes]
    assert lengths == sorted(set(lengths))
    assert len(lengths) >= 3
    assert tail == int(percentile([float(r.prefix_len) for r in workload.requests], 90.0))
    assert tail in lengths
    assert max(lengths) == max(r.prefix_len for r in workload.requests)


def test_the_calibrated_slo_puts_the_long_tail_at_risk(workload):
    compute = machine(speed=1.0)
    measured, samples = measurements(workload, compute)
    cal = calibrate(workload, measured, samples, slo_percentile=90.0, risk_fraction=0.5)
    _, tail = probe_requests(workload, 90.0)
    assert cal.slo_ms == measured[tail]
    at_risk = [r.prefix_len for r in workload.requests if compute(r.prefix_len + SUFFIX) > 0.5 * cal.slo_ms]
    assert cal.at_risk_requests == len(at_risk)
    assert 0 < cal.at_risk_requests < cal.requests  # the tail is at risk, the short head is not
    assert cal.at_risk_from_prefix == min(at_risk)
    assert f"{cal.at_risk_requests} of {cal.requests} requests" in cal.describe(0.5)


@pytest.mark.parametrize("speed", [0.1, 10.0])
def test_the_same_requests_are_at_risk_on_a_slower_or_faster_machine(workload, speed):
    # What a constant SLO could not do: on a 10x faster machine nothing would be at risk.
    reference = calibrate(workload, *measurements(workload, machine(1.0)), 90.0, 0.5)
    other = calibrate(workload, *measurements(workload, machine(speed), overhead_ms=3.0 / speed), 90.0, 0.5)
    assert other.slo_ms == pytest.approx(reference.slo_ms / speed)
    assert (other.at_risk_requests, other.at_risk_from_prefix) == (
        reference.at_risk_requests,
        reference.at_risk_from_prefix,
    )


def test_a_given_slo_is_kept_and_may_put_nothing_at_risk(workload):
    cal = calibrate(workload, *measurements(workload, machine(1.0)), 90.0, 0.5, slo_ms=1e6)
    assert cal.slo_ms == 1e6
    assert cal.slo_source == "given"
    assert cal.at_risk_requests == 0
    assert cal.at_risk_from_prefix is None
    assert "none of the" in cal.describe(0.5)


def test_calibration_needs_measurements_at_three_lengths(workload):
    measured, _ = measurements(workload, machine(1.0))
    with pytest.raises(ValueError, match="fewer than 3 lengths"):
        calibrate(workload, measured, [Sample(100, 5.0), Sample(200, 9.0)], 90.0, 0.5)


def test_a_relay_run_without_pre_inference_is_reported():
    row = {"preinfer_admitted": 0, "psi_produced": 0, "hbm_hit": 0.0,
           "trigger_decisions": {"not_at_risk": 73, "admitted": 0}}  # fmt: skip
    problems = relay_problems(row)
    assert len(problems) == 3
    assert "not_at_risk" in problems[0]  # the trigger's decision counts say why
    assert relay_problems({"preinfer_admitted": 9, "psi_produced": 9, "hbm_hit": 0.12}) == []
    assert relay_problems({"preinfer_admitted": 9, "psi_produced": 9, "hbm_hit": 0.0}) == [
        "no ranking call was served from HBM"
    ]


def row(answered: int, p50: float, p90: float, p99: float, attainment: float) -> dict[str, Any]:
    """A result row as run_stack_demo makes it: unsupported percentiles already left out."""
    latency = dict(zip(REPORTED_PERCENTILES.values(), (p50, p90, p99, p99 * 1.5), strict=True))
    kept = {key: v if percentile_supported(q, answered) else None for (q, key), v in
            zip(REPORTED_PERCENTILES.items(), latency.values(), strict=True)}  # fmt: skip
    return {"answered": answered, "slo_attainment": attainment, **kept}


def test_percentiles_need_calls_beyond_them():
    assert [min_calls(q) for q in REPORTED_PERCENTILES] == [4, 20, 200, 2000]
    assert not percentile_supported(99.0, 73)  # the old headline's P99: the maximum of 73 calls
    assert percentile_supported(99.0, 200)
    assert not percentile_supported(99.0, 199)
    # At the threshold the nearest-rank estimate is not the sample's slowest call.
    for q in REPORTED_PERCENTILES:
        n = min_calls(q)
        values = [float(i) for i in range(n)]
        assert percentile(values, q) < max(values)


def test_the_headline_prints_no_p99_from_73_calls():
    base, relay = row(73, 20.0, 120.0, 178.3, 0.808), row(71, 8.0, 18.0, 18.8, 0.958)
    text = headline(42.0, DemoConfig(), base, relay)
    assert "SLO attainment 80.8% -> 95.8% (n = 73 -> 71 answered calls)" in text
    assert "P50 20.0 -> 8.0 ms" in text
    assert "P90 120.0 -> 18.0 ms" in text
    assert "178.3" not in text
    assert "18.8" not in text
    assert "P99: n too small (needs >= 200 calls" in text
    assert "P99.9: n too small (needs >= 2000 calls" in text


def test_the_headline_prints_p99_when_both_runs_have_enough_calls():
    text = headline(42.0, DemoConfig(), row(400, 20.0, 120.0, 178.3, 0.8), row(390, 8.0, 18.0, 18.8, 0.95))
    assert "P99 178.3 -> 18.8 ms" in text
    assert "P99.9: n too small" in text
    # One short run is enough to withhold it: both sides of a comparison need the sample.
    text = headline(42.0, DemoConfig(), row(400, 20.0, 120.0, 178.3, 0.8), row(150, 8.0, 18.0, 18.8, 0.95))
    assert "P99: n too small" in text


def core_row(user: int, full_ms: float, cached_ms: float) -> CoreDemoRow:
    return CoreDemoRow(user, 1000, full_ms, 20.0, cached_ms, 1e-7)


def test_a_core_speed_up_below_one_is_remarked_as_contention():
    rows = [core_row(0, 20.0, 5.0), core_row(1, 8.0, 10.0)]
    remark = contention_remark(rows, load=(3.5, 2.0, 1.0))
    assert remark is not None
    assert "1 (0.80x)" in remark
    assert "0 (" not in remark
    assert "load average 3.5" in remark
    assert "contention" in remark
    assert contention_remark([core_row(0, 20.0, 5.0)], load=(3.5, 2.0, 1.0)) is None


def test_the_demo_checks_its_settings_before_starting(monkeypatch):
    check(DemoConfig())  # the defaults pass
    with pytest.raises(ConfigError, match="at least one ranker"):
        check(DemoConfig(rankers=0))
    with pytest.raises(ConfigError, match="duration_s"):
        check(DemoConfig(duration_s=0.0))
    monkeypatch.setenv("RELAYGR_TRIGGER_RISK_FRACTION", "2")  # overridden by the demo's own flag: fine
    check(DemoConfig())
    with pytest.raises(ConfigError, match="risk_fraction"):
        check(DemoConfig(risk_fraction=2.0))
