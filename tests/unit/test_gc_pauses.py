"""Collector pauses are timed into the service's registry (shared.metrics.GcPauses)."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry

from shared.metrics import GcPauses


def test_every_collection_is_timed_by_generation_and_close_stops_it():
    registry = CollectorRegistry()
    pauses = GcPauses(registry, log_over_s=0.0)  # logs every pause: the logging path runs too
    try:
        gc.collect(2)
        gc.collect(0)
        for generation in ("0", "2"):
            count = registry.get_sample_value("relaygr_gc_pause_seconds_count", {"generation": generation})
            assert count is not None
            assert count >= 1
    finally:
        pauses.close()
    before = registry.get_sample_value("relaygr_gc_pause_seconds_count", {"generation": "2"})
    gc.collect(2)
    assert registry.get_sample_value("relaygr_gc_pause_seconds_count", {"generation": "2"}) == before
    pauses.close()  # twice: harmless
