"""Fault scenarios on the CPU stack (bench/faults.py): no ranking call may fail in any of them."""

from __future__ import annotations

import argparse

import pytest

from bench.faults import SCENARIOS, run_scenario

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_no_ranking_call_fails(scenario):
    args = argparse.Namespace(duration_s=8.0, fault_at_s=3.0, rate=4.0, slo_ms=300.0, attempt_timeout_ms=1000.0,
                              seed=1)  # fmt: skip
    record = run_scenario(scenario, args)
    assert record["calls"] > 20
    assert record["failed"] == 0, record
    if scenario == "ranker_kill":
        assert record["preinfers_admitted"] > 0  # the pre-inference path was exercised
