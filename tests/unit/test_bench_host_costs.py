import json

from bench import host_costs


def test_host_costs_times_every_loop_operation_alone_and_under_gil_contention(tmp_path):
    host_costs.main(["--device", "cpu", "--preset", "tiny", "--prefix-len", "64", "--reps", "2",
                     "--out-dir", str(tmp_path), "--tag", "t"])  # fmt: skip
    written = json.loads((tmp_path / "host-costs-cpu-t.json").read_text())
    rows = written["results"]
    ops = {"gil_retake", "demote", "demote_unpooled", "demote_copy", "demote_kv_copy", "reload", "new_psi"}
    assert {(r["op"], r["condition"]) for r in rows} == {
        (o, c) for o in ops for c in ("alone", "gil_contended")
    }
    for r in rows:
        assert 0 < r["wall_us_p50"] <= r["wall_us_p90"]
        assert r["reps"] == 2
        assert r["psi_bytes"] > 0


def test_the_contending_thread_stops_and_the_switch_interval_is_restored():
    import sys
    import threading

    before = sys.getswitchinterval()
    with host_costs.gil_contention(True, 0.25):
        assert abs(sys.getswitchinterval() - 0.25e-3) < 1e-9
        assert any(t.name == "gil-contender" for t in threading.enumerate())
    assert sys.getswitchinterval() == before
    assert not any(t.name == "gil-contender" for t in threading.enumerate())
