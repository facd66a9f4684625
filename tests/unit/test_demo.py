"""The demo's SLO calibration and its check that the relay run showed something (pure, no stack)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench.workload import Workload, generate
from relaygr.demo import DemoConfig, calibrate, probe_requests, relay_problems
from services.trigger.latency_model import Sample
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
