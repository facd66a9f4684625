"""The replay's per-call evidence: the slowest served calls and each call's time breakdown."""

from __future__ import annotations

import math

import pytest

from relaygr.replay import OK, ReplayResult, RequestRecord
from relaygr.workload import PlannedRequest


def planned(i: int, prefix_len: int = 100, session_index: int = 0) -> PlannedRequest:
    return PlannedRequest(
        request_id=f"r{i}",
        t_retrieval_s=0.01 * i,
        t_rank_s=0.01 * i + 0.05,
        user_id=i + 1,
        prefix_version=1,
        prefix_len=prefix_len,
        recent_len=16,
        candidates=32,
        session_index=session_index,
    )


def served(i: int, latency_ms: float, queue_ms: float = 10.0) -> RequestRecord:
    return RequestRecord(
        i,
        planned(i),
        status=OK,
        latency_ms=latency_ms,
        served_by="full_recompute",
        instance_id="vm:1",
        cache_ms=1.0,
        queue_ms=queue_ms,
        compute_ms=20.0,
        server_total_ms=queue_ms + 25.0,
        lag_ms=0.5,
        sent_at_s=0.01 * i,
    )


def result(records: list[RequestRecord]) -> ReplayResult:
    return ReplayResult(records, planned_duration_s=1.0, wall_s=1.0, score_sample_every=0)


def test_slowest_ok_takes_the_slowest_fraction_of_served_calls_only():
    records = [served(i, latency_ms=float(i)) for i in range(100)]
    refused = RequestRecord(100, planned(100), status="RESOURCE_EXHAUSTED", latency_ms=5000.0)
    replay = result([*records, refused])
    slowest = replay.slowest_ok(0.02)
    assert [r.index for r in slowest] == [99, 98]  # slowest first; the refusal is not served
    assert [r.index for r in replay.slowest_ok(0.001)] == [99]  # at least one
    assert result([refused]).slowest_ok(0.5) == []


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_slowest_ok_rejects_a_fraction_outside_0_1(fraction):
    with pytest.raises(ValueError, match="fraction"):
        result([served(0, 1.0)]).slowest_ok(fraction)


def test_breakdown_splits_the_client_latency():
    row = served(7, latency_ms=300.0, queue_ms=200.0).breakdown()
    assert row["served_by"] == "full_recompute"
    assert row["instance"] == "vm:1"
    assert (row["prefix_len"], row["suffix_len"], row["returning"]) == (100, 48, False)
    # server: cache 1 + queue 200 + compute 20 + the rest 4 = 225; outside the server: 75
    assert row["server_other_ms"] == pytest.approx(4.0)
    assert row["server_total_ms"] == pytest.approx(225.0)
    assert row["network_ms"] == pytest.approx(75.0)
    assert row["latency_ms"] == pytest.approx(
        row["cache_ms"] + row["queue_ms"] + row["compute_ms"] + row["server_other_ms"] + row["network_ms"]
    )


def test_breakdown_of_an_unanswered_call_has_no_server_timings():
    row = RequestRecord(3, planned(3), status="DEADLINE_EXCEEDED", latency_ms=1000.0).breakdown()
    assert row["status"] == "DEADLINE_EXCEEDED"
    assert math.isnan(row["server_total_ms"])
    assert math.isnan(row["network_ms"])
