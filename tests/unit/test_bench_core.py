"""bench.core: the device timeline of profiled calls, and its --profile path on the CPU."""

from __future__ import annotations

import json

import pytest

from bench.core import kernel_timeline, main


def test_the_timeline_splits_calls_into_device_work_gaps_inside_and_host_time_between():
    # Two calls of three operations each (us): the second and third of a call overlap (two
    # streams), a 100 us gap inside each call, 500 us of device idle between the calls.
    first = [(0.0, 1000.0), (1100.0, 1600.0), (1500.0, 2000.0)]
    second = [(s + 2500.0, e + 2500.0) for s, e in first]
    line = kernel_timeline([*second, *first], calls=2)  # any order: split by time
    assert line["span_ms"] == pytest.approx(2.0)
    assert line["busy_ms"] == pytest.approx(1.9)  # the overlap counted once
    assert line["idle_in_span_ms"] == pytest.approx(0.1)
    assert line["between_calls_ms"] == pytest.approx(0.5)
    assert kernel_timeline(first, calls=1)["between_calls_ms"] == 0.0
    # An operation inside another's time adds nothing; the span reaches the longest one's end.
    nested = kernel_timeline([(0.0, 1000.0), (100.0, 200.0)], calls=1)
    assert (nested["span_ms"], nested["busy_ms"]) == (pytest.approx(1.0), pytest.approx(1.0))


@pytest.mark.parametrize(("intervals", "calls"), [([], 1), ([(0.0, 1.0)] * 3, 2), ([(0.0, 1.0)], 0)])
def test_operations_that_do_not_split_into_the_calls_are_refused(intervals, calls):
    with pytest.raises(ValueError, match="do not split"):
        kernel_timeline(intervals, calls)


def test_the_profile_runs_on_the_cpu_and_is_written_with_the_results(tmp_path):
    main(["--preset", "tiny", "--device", "cpu", "--prefix-lens", "128", "--batches", "1", "--reps", "1",
          "--warmup", "1", "--profile", "--profile-prefix", "128", "--profile-batch", "1",
          "--out-dir", str(tmp_path)])  # fmt: skip
    (path,) = tmp_path.glob("core-*.json")
    result = json.loads(path.read_text())
    (row,) = result["results"]
    assert row["cached_rank_ms"] > 0
    assert row["eps_max"] < 1e-4
    (profiled,) = result["config"]["profile_calls"]  # the eager call (no graphs on the CPU)
    assert profiled["call"] == "eager"
    assert profiled["wall_ms"] > 0
    assert "span_ms" not in profiled  # the CPU has no device timeline
