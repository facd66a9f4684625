"""bench.calls: the FIFO replay, the busiest windows and the per-file row."""

from __future__ import annotations

import gzip
import json
import lzma

import pytest

from bench import calls


def call(at_s: float, compute_ms: float, queue_ms: float = 0.0, served_by: str = "full_recompute") -> dict:
    return {
        "at_s": at_s,
        "compute_ms": compute_ms,
        "queue_ms": queue_ms,
        "served_by": served_by,
        "status": "OK",
    }


def test_the_fifo_replay_queues_a_burst_behind_each_calls_compute():
    # Three calls at once, 4 ms each, then one long after: waits 0, 4, 8, then 0.
    burst = [call(1.0, 4.0), call(1.0, 4.0), call(1.0, 4.0), call(2.0, 4.0)]
    assert calls.fifo_queue_ms(burst) == pytest.approx([0.0, 4.0, 8.0, 0.0])
    # Send order, not file order; a call arriving while the server is busy waits the rest.
    assert calls.fifo_queue_ms([call(0.003, 1.0), call(0.0, 5.0)]) == pytest.approx([0.0, 2.0])


def test_the_calls_of_one_batch_are_replayed_once_when_the_last_has_come():
    # A batch of three (6 ms for all, sequence 7) whose last call came at 2 ms, then a call alone.
    batch = [dict(call(t, 6.0), batch_seq=7, instance="a") for t in (0.0, 0.001, 0.002)]
    alone = dict(call(0.003, 1.0), batch_seq=8, instance="a")
    assert calls.fifo_queue_ms([*batch, alone]) == pytest.approx([2.0, 1.0, 0.0, 5.0])
    # The same sequence number on another instance is another batch.
    other = dict(call(0.0, 6.0), batch_seq=7, instance="b")
    assert len(calls.batches([*batch, other])) == 2
    row = calls.analyse("f", [*batch, alone])
    assert row["compute_share"] == pytest.approx(7.0 / 3.0, abs=1e-3)  # 6 + 1 ms over 3 ms of sends
    late = [dict(c, lag_ms=lag) for c, lag in zip([*batch, alone], (0.5, 0.7, 4000.0, 1.0), strict=True)]
    assert calls.analyse("f", late)["lag_ms_p99"] == 4000.0  # the client fell behind for one call


def test_the_busiest_window_counts_send_times_within_it():
    times = [0.0, 0.01, 0.05, 0.2, 0.21, 0.22, 0.23, 0.5]
    assert calls.busiest_window(times, 0.06) == 4  # 0.2 .. 0.23
    assert calls.busiest_window(times, 0.005) == 1
    assert calls.busiest_window([], 0.06) == 0


def test_a_files_row_from_gzipped_records(tmp_path, capsys):
    records = [call(i * 0.01, 2.0, queue_ms=float(i % 3)) for i in range(100)]
    records[5]["served_by"] = "hbm_hit"
    records.append({"at_s": float("nan"), "status": "", "served_by": "", "compute_ms": 0.0, "queue_ms": 0.0})
    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    out = tmp_path / "rows.json"
    rows = calls.main([str(path), "--json", str(out)])
    assert json.loads(out.read_text()) == rows
    row = rows[0]
    assert row["calls"] == 100  # the unsent one is left out
    assert row["served"] == {"full_recompute": 0.99, "hbm_hit": 0.01}
    assert row["fifo_queue_ms_p99"] == 0.0  # 2 ms of work every 10 ms: never a wait
    assert row["queue_ms_p99"] == 2.0
    assert row["compute_share"] == pytest.approx(200 / 990, abs=1e-3)
    assert row["lag_ms_p99"] == 0.0  # records without the client's send lag
    assert "p.jsonl.gz" in capsys.readouterr().out


@pytest.mark.parametrize(("suffix", "opener"), [(".xz", lzma.open), (".gz", gzip.open), ("", open)])
def test_records_read_alike_however_they_are_stored(tmp_path, suffix, opener):
    records = [call(i * 0.01, 2.0) for i in range(20)]
    path = tmp_path / f"p.jsonl{suffix}"
    with opener(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    assert calls.read_calls(path) == records


def test_an_unreadable_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(SystemExit, match=r"bench\.calls: cannot read .*bad\.jsonl"):
        calls.main([str(bad)])


def test_by_path_rows_say_which_path_and_stage_make_the_tail(tmp_path, capsys):
    def rec(served_by: str, batch: int, latency_ms: float, cache_ms: float = 0.0) -> dict:
        r = call(0.0, 1.0, served_by=served_by)
        r.update(batch=batch, latency_ms=latency_ms, cache_ms=cache_ms, launch_ms=0.5, network_ms=2.0)
        return r

    records = [rec("hbm_hit", 1, 5.0) for _ in range(8)] + [rec("hbm_hit", 2, 6.0) for _ in range(4)]
    records += [rec("dram_reload", 1, 45.0, cache_ms=30.0) for _ in range(3)] + [
        rec("full_recompute", 1, 60.0)
    ]
    records += [rec("full_recompute", 1, 9.0) | {"psi_kept": True} for _ in range(2)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    calls.main([str(path), "--by-path"])
    out = capsys.readouterr().out
    assert "served_by" in out
    rows = {(r["served_by"], r["batch"]): r for r in calls.by_path("p", records)}
    assert rows[("hbm_hit", 1)]["calls"] == 8
    assert rows[("hbm_hit", 2)]["latency_ms_p50"] == 6.0
    reload = rows[("dram_reload", 1)]
    assert reload["cache_ms_p50"] == 30.0
    assert reload["server_other_ms_p50"] is None  # not in these records
    # 4 calls at or over 40 ms: 3 reloads and the full ranking.
    assert reload["slow_share"] == 0.75
    assert rows[("full_recompute", 1)]["slow_share"] == 0.25
    assert rows[("full_recompute", 1)]["calls"] == 1  # those that kept psi have a row of their own
    assert rows[("full_recompute+kept", 1)]["calls"] == 2
    assert rows[("hbm_hit", 1)]["slow_share"] == 0.0


def test_a_slow_threshold_that_is_not_positive_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(call(0.0, 1.0)) + "\n")
    with pytest.raises(SystemExit):
        calls.main([str(path), "--by-path", "--slow-ms", "0"])


def test_slow_windows_find_where_the_slow_calls_bunch_and_what_was_there(tmp_path, capsys):
    def rec(at_s: float, latency_ms: float, session_index: int, served_by: str) -> dict:
        return call(at_s, 1.0, served_by=served_by) | {
            "latency_ms": latency_ms,
            "session_index": session_index,
        }

    # 10 s of calls every 0.1 s, fast; a burst at 4.0-4.5 s of first calls, slow.
    quiet = [rec(i / 10, 5.0, 1, "hbm_hit") for i in range(100) if not 40 <= i < 45]
    burst = [rec(4.0 + i / 40, 90.0, 0, "inflight_join") for i in range(18)] + [call(4.45, 6.0, 2, "hbm_hit")]
    late = [rec(7.02, 60.0, 0, "full_recompute")]
    rows = calls.slow_windows("p", quiet + burst + late, slow_ms=50.0)
    assert [r["window_s"] for r in rows] == [4.0, 7.0]  # most slow calls first; none without slow calls
    top = rows[0]
    assert (top["calls"], top["slow"]) == (19, 18)
    assert top["first_call_share"] == round(18 / 19, 2)
    assert top["served"]["inflight_join"] == round(18 / 19, 2)
    assert top["mean_calls"] == round(len(quiet + burst + late) / 20, 1)
    assert calls.slow_windows("p", quiet, slow_ms=50.0) == []
    assert calls.slow_windows("p", [], slow_ms=50.0) == []
    # From the command line, a table after the files' rows.
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in quiet + burst + late))
    calls.main([str(path), "--slow-windows", "--slow-ms", "50"])
    out = capsys.readouterr().out
    assert "| p.jsonl | 4 | 19 |" in out


def test_paired_calls_are_compared_with_themselves_and_the_worst_windows_name_what_came_before():
    """--against: the same call (by index) in two files; the windows where the first file was
    slowest, with the take-overs and calls on pre-inferred psi just before them."""

    def c(index, at_s, latency_ms, served_by="full_recompute", session_index=1, prefix_len=100):
        return {"index": index, "at_s": at_s, "latency_ms": latency_ms, "served_by": served_by,
                "session_index": session_index, "prefix_len": prefix_len, "status": "OK"}  # fmt: skip

    reference = [c(i, 0.05 * i, 5.0) for i in range(40)]
    relay = [c(i, 0.05 * i, 5.0) for i in range(40)]
    relay[20] = c(20, 1.0, 6.0, "partial_prefix", 0, 11795)  # a take-over at 1.0 s ...
    relay[22] = c(22, 1.1, 45.0)  # ... and the calls after it slow
    relay[23] = c(23, 1.15, 25.0)
    relay[30] = c(30, 1.5, 6.0, "hbm_hit", 0)  # psi pre-inferred for a first call: no harm after
    relay.append({"index": 99, "status": "UNAVAILABLE"})  # failed calls and unpaired ones: left out
    summary, windows = calls.paired("relay", relay, reference, window_s=0.1, lead_s=0.25, top=2)
    assert summary["paired_calls"] == 40
    assert summary["mean_extra_ms"] == pytest.approx((1 + 40 + 20 + 1) / 40, abs=0.01)
    assert windows[0]["window_s"] == pytest.approx(1.1)
    assert windows[0]["mean_extra_ms"] == pytest.approx(30.0)  # calls 22 and 23
    assert windows[0]["took_over"] == [11795]
    assert windows[0]["psi_ahead"] == 1
    assert windows[0]["slowest_launch"] is None  # records without launch times: nothing to name
    assert calls.paired("x", relay, [])[1] == []  # nothing in common: no windows
    # Two calls on psi stamped at the same instant (records rounded to the millisecond).
    relay[31] = c(31, 1.5, 6.0, "hbm_hit", 0)
    assert calls.paired("relay", relay, reference, window_s=0.1, lead_s=0.25, top=2)[0]["paired_calls"] == 40


def test_the_worst_windows_name_the_slowest_launch_beside_the_references():
    """A stall of the device loop (k29b: a 37.1 ms launch of a full ranking keeping psi, where
    the baseline launched the same call in 0.8 ms) named in the windows it slowed."""

    def c(index, at_s, latency_ms, launch_ms, prefix_len=300):
        return {"index": index, "at_s": at_s, "latency_ms": latency_ms, "launch_ms": launch_ms,
                "served_by": "full_recompute", "session_index": 0, "prefix_len": prefix_len,
                "status": "OK"}  # fmt: skip

    reference = [c(i, 0.01 * i, 5.0, 0.8) for i in range(100)]
    relay = [c(i, 0.01 * i, 5.0, 0.5) for i in range(100)]
    relay[50] = c(50, 0.5, 50.0, 37.1, 7889)
    relay[51:60] = [c(i, 0.01 * i, 40.0, 0.7) for i in range(51, 60)]  # queued behind it
    _, windows = calls.paired("relay", relay, reference, window_s=0.1, lead_s=0.25, top=1)
    assert windows[0]["window_s"] == pytest.approx(0.5)
    assert windows[0]["slowest_launch"] == "37.1 ms (full_recompute, 7889 tokens; reference 0.8 ms)"


def test_against_reads_the_reference_and_prints_the_paired_tables(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    rows = [{"index": i, "at_s": 0.01 * i, "latency_ms": 5.0, "compute_ms": 1.0, "queue_ms": 0.0,
             "served_by": "full_recompute", "status": "OK"} for i in range(10)]  # fmt: skip
    a.write_text("".join(json.dumps(dict(r, latency_ms=7.0)) + "\n" for r in rows))
    b.write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls.main([str(a), "--against", str(b)])
    out = capsys.readouterr().out
    assert "against b.jsonl, call for call" in out
    assert "| a.jsonl | 10 | 2 |" in out
    with pytest.raises(SystemExit, match="cannot read"):
        calls.main([str(a), "--against", str(tmp_path / "missing.jsonl")])
