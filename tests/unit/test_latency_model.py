"""The trigger's latency model refits at most once per refit_interval_s once calibrated on enough
samples."""

from __future__ import annotations

import pytest

from services.trigger import latency_model
from services.trigger.latency_model import LatencyModel, Sample
from shared.modelspec import preset


def _linear(ms_per_token: float, lengths: range) -> list[Sample]:
    return [Sample(n, 1.0 + ms_per_token * n) for n in lengths]


def test_refits_wait_for_the_interval_and_keep_the_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(latency_model.time, "monotonic", lambda: clock[0])
    model = LatencyModel(preset("tiny"), assumed_tflops=1.0, window=64, refit_interval_s=1.0)
    model.observe(_linear(0.01, range(100, 1100, 100)))
    assert model.calibrated
    assert model.full_ms(1000) == pytest.approx(11.0, rel=1e-6)
    # Twice as costly from now on: within the interval the fit stands ...
    model.observe(_linear(0.02, range(100, 3300, 50)))
    assert model.full_ms(1000) == pytest.approx(11.0, rel=1e-6)
    # ... and the first observation after it refits on every sample the window holds.
    clock[0] += 1.0
    model.observe(_linear(0.02, range(150, 300, 50)))
    assert model.full_ms(1000) == pytest.approx(21.0, rel=1e-3)


def test_interval_zero_refits_on_every_sample() -> None:
    model = LatencyModel(preset("tiny"), assumed_tflops=1.0, window=16)
    model.observe(_linear(0.01, range(100, 1700, 100)))
    model.observe(_linear(0.02, range(100, 1700, 100)))
    assert model.full_ms(1000) == pytest.approx(21.0, rel=1e-3)


def test_a_fit_on_few_samples_is_redone_on_every_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(latency_model.time, "monotonic", lambda: clock[0])
    model = LatencyModel(preset("tiny"), assumed_tflops=1.0, window=64, refit_interval_s=1.0)
    model.observe(_linear(0.01, range(100, 600, 100)))  # 5 samples: calibrated
    assert model.full_ms(1000) == pytest.approx(11.0, rel=1e-6)
    # Within the interval, but the window holds fewer than REFIT_EVERY_SAMPLE_BELOW: refitted.
    more = _linear(0.02, range(100, 2000, 100))
    assert len(model._samples) + len(more) < latency_model.REFIT_EVERY_SAMPLE_BELOW
    model.observe(more)
    assert model.full_ms(1000) > 11.0 * 1.2
