"""`relaygr demo`'s two stacks, a short replay each: under the SLO calibrated on this machine, the
workload's long tail is at risk, so the relay must pre-infer it and serve some ranking calls from
HBM, while the short head is not pre-inferred. (The demo once showed 0% HBM hits and nobody
noticed: its constant SLO put nothing at risk.) No assertion on latencies: CPU timings vary."""

from __future__ import annotations

import pytest

from relaygr.demo import DemoConfig, relay_problems, run_stack_demo

pytestmark = pytest.mark.integration


def test_relay_pre_infers_the_at_risk_tail_and_serves_it_from_hbm():
    calibration, (baseline, relay) = run_stack_demo(DemoConfig(duration_s=30.0))
    assert calibration.at_risk_requests > 0, calibration
    assert baseline["failed"] == relay["failed"] == 0
    assert baseline["preinfer_admitted"] == baseline["psi_produced"] == 0
    assert baseline["hbm_hit"] == 0
    assert relay_problems(relay) == [], relay
    decisions = relay["trigger_decisions"]
    assert decisions["admitted"] > 0, decisions
    assert decisions["not_at_risk"] > 0, decisions  # the short head was not pre-inferred
