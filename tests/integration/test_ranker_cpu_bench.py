"""bench.ranker_cpu end to end on the CPU: real ranker processes, per-thread CPU read from /proc,
the result file written; returning users answered from the psi a relay ranker kept."""

from __future__ import annotations

import json
import os
import time

import pytest

from bench.ranker_cpu import ENGINE, MAIN, OTHER, main, thread_cpu_s


def test_thread_groups_of_this_process_add_up_to_its_cpu():
    # Not "no device loop here": in a full test run, engines of earlier in-process tests live on.
    groups = thread_cpu_s(os.getpid())
    assert set(groups) == {MAIN, ENGINE, OTHER}
    assert groups[MAIN] > 0  # this thread has run
    assert sum(groups.values()) <= time.process_time() + 0.05


def test_the_bench_measures_each_variant_and_writes_its_file(tmp_path):
    main(["--device", "cpu", "--preset", "tiny", "--prefix-len", "600", "--recent", "4", "--candidates", "8",
          "--rate", "40", "--calls", "40", "--warmup", "10", "--returning", "0.5", "--repeats", "1",
          "--variants", "baseline", "relay", "--out-dir", str(tmp_path)])  # fmt: skip
    (path,) = tmp_path.glob("ranker-cpu-*.json")
    rows = {r["variant"]: r for r in json.loads(path.read_text())["results"]}
    assert set(rows) == {"baseline", "relay"}
    for row in rows.values():
        assert row["calls"] == 40
        assert row["failed"] == 0
        assert row["cpu_ms_per_call"] == pytest.approx(
            row["main_cpu_ms_per_call"] + row["engine_cpu_ms_per_call"] + row["other_cpu_ms_per_call"]
        )
        assert row["engine_cpu_ms_per_call"] > 0  # the CPU device computes on the device loop
    assert set(rows["baseline"]["served_by"]) == {"full_recompute"}
    assert rows["relay"]["served_by"].get("hbm_hit", 0) > 0  # psi kept by its full rankings


@pytest.mark.parametrize(("flag", "value"), [("--rate", "0"), ("--returning", "1"), ("--calls", "-3")])
def test_values_out_of_range_stop_it_with_one_line(flag, value, capsys):
    with pytest.raises(SystemExit):
        main([flag, value])
    assert flag in capsys.readouterr().err
