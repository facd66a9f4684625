"""10,000 malformed retrieval events through the real trigger: none crashes it, every one is
dead-lettered with its reason, no well-formed event is lost, offsets are committed."""

from __future__ import annotations

import pytest

from bench.fuzz import run_fuzz

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_malformed_events_are_dead_lettered_and_nothing_is_lost():
    record = run_fuzz(malformed_count=10_000, good_count=300, seed=3)
    assert record["crashes"] == 0
    assert record["dlq_events"] == 10_000
    assert record["dlq_unreadable"] == 0
    assert record["lost_events"] == 0
    assert record["offsets_committed"]
