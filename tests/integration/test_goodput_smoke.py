"""bench.goodput end to end on the CPU stack (tiny model): baseline and relay, one short workload,
an SLO no point can meet, so each search steps down to its floor and ends in a few points."""

from __future__ import annotations

import json
import sys

import pytest

from bench import goodput
from relaygr.sim import AdmissionPolicy
from services.trigger.config import ADMISSION_SETTINGS

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_goodput_run_writes_a_result_with_a_first_miss_for_every_record(tmp_path):
    paths = goodput.main([
        "--configs", "relay,baseline", "--workloads", "L128", "--repeats", "1", "--slo-ms", "0.01",
        "--grid", "4", "8", "--floor-rps", "2", "--min-duration-s", "1", "--min-calls", "4",
        "--users", "200", "--recent", "8", "--candidates", "16", "--settle-s", "0", "--warmup-s", "1",
        "--lead-in-s", "1", "--out-dir", str(tmp_path), "--tag", "smoke",
        "--calls-dir", str(tmp_path / "calls"),
        # The load from two processes (relaygr/load.py); a bound no CI hiccup reaches, so that
        # the search runs as the test expects (client-bound searches: test_goodput_search).
        "--client-processes", "2", "--client-lag-bound-ms", "1000",
    ])  # fmt: skip
    json_path = next(p for p in paths if p.suffix == ".json")
    assert json_path.name.startswith("goodput-")
    assert json_path.name.endswith("-smoke.json")
    assert {p.suffix for p in paths} == {".json", ".md", ".png"}
    run = json.loads(json_path.read_text())
    assert {"machine", "config", "results"} <= run.keys()
    assert run["config"]["configs"] == ["baseline", "relay"]  # the reference runs first
    assert sorted(r["config"] for r in run["results"]) == ["baseline", "relay"]
    for record in run["results"]:
        assert record["workload"] == "L128"
        assert record["repeat"] == 0
        assert record["first_miss_rps"] is not None
        assert not record["censored"]
        assert record["client_bound_rps"] is None
        # The ranker's measured step costs (the capacity model's): eager on the CPU, no graphs.
        assert set(record["ranker_step_costs"]) == {"eager"}
        assert record["ranker_step_costs"]["eager"]["per_step_ms"] >= 0
        # The trigger's admission settings as its start-up line gave them (the capacity model's),
        # the benchmark's own flags among them.
        settings = record["trigger_settings"]
        assert set(settings) == set(ADMISSION_SETTINGS)
        assert settings["slo_ms"] == 0.01
        assert settings["suffix_tokens_estimate"] == 8 + 16
        assert AdmissionPolicy.of_run(record).spare_busy_max == settings["spare_busy_max"]
        assert record["goodput_rps"] == 0.0  # nothing meets a 10 us SLO
        assert [p["rate_rps"] for p in record["points"]] == [4.0, 2.0]  # grid bottom, then down to the floor
        for point in record["points"]:
            assert point["meets_slo"] is False
            assert point["calls"] >= 4
            assert point["p99_ms"] > 0
            by_user = point["by_user"]  # new and returning users' calls apart
            assert by_user["new"]["calls"] + by_user["returning"]["calls"] == point["ok"]
            assert 0.0 <= point["busy_fraction"] <= 1.0
            assert point["gpu_util"] is None  # nvidia-smi's count: GPU stacks only
            assert 0.0 <= point["starved_fraction"] <= 1.0  # idle between batches with calls waiting
            assert point["device_gap_s"] >= point["device_starved_s"] >= 0.0
            assert point["starved_gaps_over_1ms"] >= 0
            assert point["device_fill_wait_s"] >= 0.0
            assert point["loop_launch_wall_s"] > 0
            assert point["loop_launch_cpu_s"] > 0
            assert point["device_rank_s"] > 0  # the ranker's counters were scraped
            # Pre-inference steps by how they ran: all eager on the CPU (no graphs), every one
            # counted in the pre-inference device time.
            assert point["preinfer_graph_steps"] == 0.0
            assert point["preinfer_eager_seconds"] == pytest.approx(
                point["device_preinfer_s"], rel=1e-6, abs=1e-9
            )
            assert point["preinfer_started"] >= point["preinfer_started_joined"] >= 0.0
            assert point["preinfer_start_wait_s"] >= 0.0
            assert point["preinfer_done"] >= point["preinfer_done_after_call"] >= 0.0
            assert point["preinfer_done_s"] >= point["preinfer_build_s"] >= 0.0
            assert point["signal_trips"] >= point["signal_trips_over_50ms"] >= 0.0
            # Every event the trigger decided on was timed from its retrieval time.
            assert point["trigger_event_lags"] >= point["trigger_event_lags_over_20ms"] >= 0.0
            assert point["trigger_event_lag_ms_sum"] >= 0.0
            if record["config"] == "baseline":
                assert point["preinfer_eager_steps"] == 0.0
                assert point["preinfer_started"] == 0.0
            for key in ("hbm_hit", "inflight_join", "partial_prefix", "dram_reload", "full_recompute"):
                assert 0.0 <= point[key] <= 1.0
            for key in ("reloads", "demotions", "hbm_evictions", "hbm_evicted_undemoted", "hbm_released",
                        "resident_bytes_max",
                        "prefetches_issued", "prefetches_used", "prefetches_wasted", "prefetches_failed",
                        "demotion_lag_p99_ms", "dram_evictions", "dram_used_bytes_max", "alloc_retries",
                        "device_mallocs", "device_frees",
                        "gc_pause_s", "gc_pauses_over_20ms", "preinfers_expired", "late_signals",
                        "host_stalls_over_20ms_ranker", "host_stalls_over_20ms_router",
                        "host_stalls_over_20ms_trigger", "loop_stalls_over_20ms_ranker",
                        "loop_stalls_over_20ms_router", "loop_stalls_over_20ms_trigger"):  # fmt: skip
                assert point[key] >= 0
            # Our processes' CPU over the point: the ranker computed, the client replayed the load.
            assert point["client_processes"] == 2
            assert point["client_bound"] is False
            # The load's parent process only waits on its workers: its share may round to 0.
            assert 0.0 <= point["cpu_cores_client"] < 64.0
            for name in ("client_w0", "client_w1", "ranker_0", "router", "trigger", "broker"):
                assert 0.0 < point[f"cpu_cores_{name}"] < 64.0, name
                assert 0.0 < point[f"cpu_top_thread_{name}"] <= point[f"cpu_cores_{name}"] + 1e-9, name
            # The next point started from a quiet stack: it drained well before its 60 s bound.
            assert 0.0 <= point["drain_s"] < 60.0
            # psi copies and a call's reload path by stage, in the record (0 where none was timed).
            for stage in ("issue", "device_wait", "copy", "settle"):
                assert point[f"reload_{stage}_ms_mean"] >= 0.0
                assert point[f"demote_{stage}_ms_mean"] >= 0.0
            for stage in ("spawn", "acquire", "copy", "store", "wake"):
                assert point[f"reload_path_{stage}_ms_mean"] >= 0.0
            assert 0.0 <= point["prefetch"] <= 1.0
            assert point["prefetches_used"] + point["prefetches_wasted"] <= point["prefetches_issued"]
            # The trigger's decisions over the point: every event decided, admissions by ground.
            reasons = (
                "not_at_risk",
                "adds_work",
                "footprint_bound",
                "load_bound",
                "too_late",
                "already_resident",
                "admitted",
            )
            assert sum(point.get(f"trigger_{r}", 0.0) for r in reasons) > 0
            assert point.get("trigger_admitted", 0.0) == sum(
                point.get(f"trigger_admitted_{ground}", 0.0) for ground in ("risk", "reuse", "spare")
            )
            if record["config"] == "baseline":
                assert point.get("trigger_admitted", 0.0) == 0.0
            # The calls that set the P99, each whole, slowest first, and the stages' P99s.
            slowest = point["slowest"]
            assert slowest
            assert [c["latency_ms"] for c in slowest] == sorted(
                (c["latency_ms"] for c in slowest), reverse=True
            )
            assert slowest[0]["latency_ms"] >= point["p99_ms"] - 0.1
            assert {"served_by", "prefix_len", "queue_ms", "compute_ms", "network_ms"} <= slowest[0].keys()
            for stage in ("queue", "compute", "launch", "server_total", "network"):
                assert f"{stage}_ms_p99" in point
            assert point["batch_p99"] >= 1
            assert {"batch", "batch_tokens", "launch_ms"} <= slowest[0].keys()
            assert 0.0 <= point["client_loop_lag_ms_p99"] <= point["client_loop_lag_ms_max"]
            assert 0.0 <= point["client_gc_pause_ms_max"] <= point["client_gc_pause_ms_total"] + 1e-9
            assert 0.0 <= point["returning_share"] < 1.0
            assert point["calls"] >= 4  # the measured window's calls; the lead-in's are not counted
            # The rankers' host ms per request as reported (None before they had a figure).
            assert point["ranker_host_ms_per_request"] is None or point["ranker_host_ms_per_request"] > 0
            # What the gates weighed at the point's end (None while not yet measured), and the
            # event loop's CPU per copy to host DRAM (0 where none was copied).
            for gate in ("demotion", "keep"):
                for key in (f"{gate}_gate_returns_per_action", f"{gate}_gate_host_ms_per_action"):
                    assert point[key] is None or point[key] >= 0.0
            assert point["demote_loop_cpu_ms_mean"] >= 0.0
            if sys.platform.startswith("linux"):  # the host's CPU shares, from /proc/stat
                assert 0.0 <= point["host_cpu_steal"] <= 1.0
                assert 0.0 < point["host_cpu_busy"] <= 1.0
    md = next(p for p in paths if p.suffix == ".md").read_text()
    assert "relay / baseline" in md
    # --calls-dir: every measured call of every point, in send order, one JSON line each.
    for record in run["results"]:
        for point in record["points"]:
            files = sorted(
                (tmp_path / "calls").glob(f"{record['config']}-L128-p*-{point['rate_rps']:g}.jsonl")
            )
            assert len(files) == 1, files
            calls = [json.loads(line) for line in files[0].read_text().splitlines()]
            assert len(calls) == point["calls"]
            sent = [c["at_s"] for c in calls]
            assert sent == sorted(sent)
            assert {"user_id", "session_index", "served_by", "queue_ms", "compute_ms"} <= calls[0].keys()
