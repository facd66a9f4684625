"""The replay's per-call evidence: the slowest served calls and each call's time breakdown."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import os
import time
from pathlib import Path

import pytest

from relaygr.harness import (
    _probe_work,
    boot_id,
    cpu_model,
    host_cpu_fractions,
    host_cpu_times,
    host_probe_ms,
    machine,
)
from relaygr.replay import OK, ReplayResult, RequestRecord, replay
from relaygr.workload import Materializer, PlannedRequest, WorkloadConfig, generate
from shared.protos import ranker_pb2 as pb


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


def test_a_lead_in_is_replayed_but_left_out_of_every_figure():
    measured = [served(i, latency_ms=10.0 + i) for i in range(50)]
    lead = [
        RequestRecord(100 + i, dataclasses.replace(planned(100 + i), lead_in=True), status=OK, latency_ms=900.0,
                      served_by="full_recompute", server_total_ms=1.0, sent_at_s=0.001 * i)
        for i in range(10)
    ]  # fmt: skip
    refused = RequestRecord(200, dataclasses.replace(planned(200), lead_in=True), status="RESOURCE_EXHAUSTED")
    run = result([*lead, refused, *measured])
    assert run.measured == measured
    summary = run.summary(slo_ms=100.0)
    assert (summary["planned"], summary["sent"], summary["ok"], summary["failed"]) == (50, 50, 50, 0)
    assert summary["max_ms"] == pytest.approx(59.0)  # none of the lead-in's 900 ms calls
    assert summary["meets_slo"]
    assert all(not r.planned.lead_in for r in run.slowest_ok(0.5))


def test_each_serving_path_is_summarised_on_its_own():
    full = [served(i, latency_ms=30.0 + i, queue_ms=10.0) for i in range(20)]
    hits = [
        dataclasses.replace(
            served(100 + i, latency_ms=4.0, queue_ms=1.0), served_by="hbm_hit", compute_ms=2.0
        )
        for i in range(10)
    ]
    summary = result([*full, *hits]).summary(slo_ms=100.0)
    by = summary["by_served"]
    assert set(by) == {"full_recompute", "hbm_hit"}  # paths that served no call are left out
    assert by["hbm_hit"]["calls"] == 10
    assert by["hbm_hit"]["compute_ms_p50"] == pytest.approx(2.0)
    assert by["hbm_hit"]["latency_ms_p99"] == pytest.approx(4.0)
    assert by["full_recompute"]["compute_ms_p50"] == pytest.approx(20.0)
    assert by["full_recompute"]["queue_ms_p99"] == pytest.approx(10.0)
    assert by["full_recompute"]["latency_ms_p50"] == pytest.approx(39.5, abs=0.6)


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


def test_host_cpu_fractions_split_busy_idle_and_stolen_time():
    before = {"total": 1000.0, "idle": 600.0, "steal": 10.0}
    after = {"total": 2000.0, "idle": 1100.0, "steal": 110.0}
    # 1000 ticks: 500 idle, 100 stolen, 400 busy
    assert host_cpu_fractions(before, after) == {"host_cpu_busy": 0.4, "host_cpu_steal": 0.1}
    assert host_cpu_fractions({}, after) == {}
    assert host_cpu_fractions(after, after) == {}  # no time passed: nothing to divide by


def test_host_cpu_times_reads_this_host_where_linux_has_proc_stat():
    times = host_cpu_times()
    if not os.path.exists("/proc/stat"):
        assert times == {}
        return
    assert times["total"] > 0
    assert 0 <= times["steal"] <= times["total"]
    assert 0 <= times["idle"] <= times["total"]


def test_the_machine_record_names_this_boot():
    # Leased machines here are all called "vm": the boot id tells one lease's results from another's.
    if not os.path.exists("/proc/sys/kernel/random/boot_id"):
        assert boot_id() is None
        return
    assert boot_id() == boot_id()
    assert len(boot_id() or "") == 36  # a UUID
    assert machine()["boot_id"] == boot_id()


def test_the_machine_record_names_the_host_cpu_and_its_speed():
    # Leases of one machine kind differ in host speed; host-bound limits are compared with it.
    info = machine()
    assert info["cpu_model"] == cpu_model()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and "model name" in cpuinfo.read_text():
        assert info["cpu_model"]
    assert info["host_probe_ms"] > 0
    assert host_probe_ms(n=1000, runs=1) > 0
    # The probe's work is fixed, the same on every host: i=0 reads its own 0, 1 and 2 miss.
    assert _probe_work(3) == 3


def test_breakdown_of_an_unanswered_call_has_no_server_timings():
    row = RequestRecord(3, planned(3), status="DEADLINE_EXCEEDED", latency_ms=1000.0).breakdown()
    assert row["status"] == "DEADLINE_EXCEEDED"
    assert math.isnan(row["server_total_ms"])
    assert math.isnan(row["network_ms"])


class _Producer:
    async def send(self, topic: str, value: bytes, key: bytes):
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


class _BlockingRouter:
    """Answers at once, but blocks the caller's event loop for `block_s` on its third call (as
    building a large request or a garbage collection would)."""

    def __init__(self, block_s: float) -> None:
        self.block_s = block_s
        self.calls = 0

    async def Rank(self, request, *, timeout: float):  # noqa: ASYNC109 (the stub's signature)
        self.calls += 1
        if self.calls == 3:
            time.sleep(self.block_s)  # noqa: ASYNC251 (the stall is the point)
        return pb.RankReply(served_by=pb.FULL_RECOMPUTE)


async def test_the_replay_measures_its_own_event_loop_lag():
    # A loop stall in the load generator is timed into every call in flight: the replay reports it.
    workload = generate(WorkloadConfig(seed=3, rate_rps=40, duration_s=0.5, users=50, recent_tokens=4,
                                       candidates=8, fixed_prefix_len=64))  # fmt: skip
    result = await replay(workload, producer=_Producer(), retrieval_topic="t", router_stub=_BlockingRouter(0.08),
                          materializer=Materializer.for_workload(workload), slo_ms=1000.0,
                          start_delay_s=0.0, lookahead_s=0.05)  # fmt: skip
    assert len(workload) >= 3
    assert all(r.ok for r in result.records)
    summary = result.summary(1000.0)
    assert summary["client_loop_lag_ms_max"] >= 70.0
    assert summary["client_loop_lag_ms_p99"] <= summary["client_loop_lag_ms_max"]
    assert len(result.loop_lag_ms) >= 10  # sampled every 5 ms over the replay


class _CollectingRouter(_BlockingRouter):
    """Runs a full collection on the caller's loop on its third call."""

    async def Rank(self, request, *, timeout: float):  # noqa: ASYNC109 (the stub's signature)
        self.calls += 1
        if self.calls == 3:
            gc.collect()
        return pb.RankReply(served_by=pb.FULL_RECOMPUTE)


async def test_the_replay_times_its_own_garbage_collections_and_stops_after():
    workload = generate(WorkloadConfig(seed=3, rate_rps=40, duration_s=0.5, users=50, recent_tokens=4,
                                       candidates=8, fixed_prefix_len=64))  # fmt: skip
    callbacks = len(gc.callbacks)
    result = await replay(workload, producer=_Producer(), retrieval_topic="t", router_stub=_CollectingRouter(0.0),
                          materializer=Materializer.for_workload(workload), slo_ms=1000.0,
                          start_delay_s=0.0, lookahead_s=0.05)  # fmt: skip
    assert len(result.gc_pause_ms) >= 1  # at least the one this router ran
    summary = result.summary(1000.0)
    assert 0.0 < summary["client_gc_pause_ms_max"] <= summary["client_gc_pause_ms_total"]
    assert len(gc.callbacks) == callbacks  # the replay's timer is gone with it


def test_a_signal_path_service_that_does_not_answer_its_metrics_reads_as_empty(capsys):
    # A frozen trigger's scrape timed out and ended a whole benchmark run; now it reads as {}
    # (behind), said on stderr, and the next broker renewal restarts it.
    import asyncio
    import socket

    from relaygr.harness import scrape_signal_path

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        assert asyncio.run(scrape_signal_path(port, "trigger")) == {}
    assert f"the trigger's metrics (port {port}) did not answer" in capsys.readouterr().err


def test_new_and_returning_users_calls_are_summarised_apart():
    new = [served(i, latency_ms=30.0 + i) for i in range(4)]  # first calls, in full
    back = [
        dataclasses.replace(
            served(100 + i, latency_ms=5.0),
            planned=planned(100 + i, session_index=1),
            served_by="dram_reload" if i == 0 else "hbm_hit",
        )
        for i in range(4)
    ]
    by = result([*new, *back]).summary(slo_ms=100.0)["by_user"]
    assert by["new"]["calls"] == by["returning"]["calls"] == 4
    assert by["new"]["full_recompute"] == 1.0
    assert (by["returning"]["hbm_hit"], by["returning"]["dram_reload"]) == (0.75, 0.25)
    assert by["returning"]["latency_ms_p99"] == pytest.approx(5.0)
    assert by["new"]["latency_ms_p99"] == pytest.approx(33.0, abs=0.1)
    empty = result([]).summary(slo_ms=100.0)["by_user"]
    assert empty["new"]["calls"] == 0
