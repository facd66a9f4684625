"""The ranker's host CPU per request, over a recent window."""

from __future__ import annotations

import pytest

from services.ranker.host_cost import HostCost


def test_cpu_per_request_over_the_window():
    cost = HostCost(window_s=2.0, min_requests=10)
    assert cost.ms_per_request() is None
    cost.observe(0.0, cpu_s=10.0, requests=100)
    assert cost.ms_per_request() is None  # one reading: nothing between
    cost.observe(1.0, cpu_s=10.5, requests=600)
    assert cost.ms_per_request() == pytest.approx(1.0)  # 0.5 s of CPU for 500 requests
    # Older readings leave the window; the last one at or before its start is kept (t=1.0 here).
    cost.observe(2.5, cpu_s=11.0, requests=700)
    cost.observe(4.0, cpu_s=14.0, requests=800)  # the host got dearer: 3.5 s of CPU, 200 requests
    assert cost.ms_per_request() == pytest.approx((14.0 - 10.5) / 200 * 1e3)


def test_too_few_requests_give_no_figure_and_a_clock_going_back_gives_no_negative():
    cost = HostCost(min_requests=32)
    cost.observe(0.0, cpu_s=1.0, requests=0)
    cost.observe(1.0, cpu_s=2.0, requests=31)
    assert cost.ms_per_request() is None
    cost.observe(1.5, cpu_s=0.5, requests=64)  # CPU read lower (waits counted late): never negative
    assert cost.ms_per_request() == 0.0
