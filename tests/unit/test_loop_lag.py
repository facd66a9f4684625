"""services/ranker/loop_lag.py: the event loop's lag, smoothed, and when the relay sheds work."""

from __future__ import annotations

import math

import pytest

from services.ranker.loop_lag import LoopLag


def test_the_lag_is_smoothed_over_its_window_and_presses_past_the_threshold():
    lag = LoopLag(threshold_ms=2.0, window_s=0.5)
    lag.observe(0.0, 0.5)
    assert lag.lag_ms == 0.5  # the first reading as it is
    assert not lag.pressed()
    lag.observe(0.05, 20.0)  # one late tick moves the average by 1 - e^-0.1 of the gap
    assert lag.lag_ms == pytest.approx(0.5 + (1 - math.exp(-0.1)) * 19.5)
    assert lag.pressed()  # 2.36 ms: past the threshold
    now = 0.05
    for _ in range(40):  # two seconds of prompt ticks: it comes back under
        now += 0.05
        lag.observe(now, 0.0)
    assert lag.lag_ms < 0.1
    assert not lag.pressed()
    lag.observe(now, -3.0)  # a clock that woke early reads as no lag
    assert lag.lag_ms >= 0.0


def test_a_sustained_lag_presses_and_a_threshold_of_zero_never_does():
    off, on = LoopLag(threshold_ms=0.0), LoopLag(threshold_ms=5.0)
    for i in range(100):
        off.observe(i * 0.05, 30.0)
        on.observe(i * 0.05, 30.0)
    assert off.lag_ms == pytest.approx(30.0)
    assert not off.pressed()
    assert on.pressed()


@pytest.mark.parametrize(("threshold", "window"), [(-1.0, 0.5), (2.0, 0.0)])
def test_bad_settings_are_refused(threshold, window):
    with pytest.raises(ValueError, match="threshold_ms"):
        LoopLag(threshold_ms=threshold, window_s=window)
