"""bench.work: device work per call and the relay's bound, from a goodput result."""

from __future__ import annotations

import json
import math

import pytest

from bench import work


def point(rate: float, rank_s: float, preinfer_s: float, served: dict, **extra) -> dict:
    return {"rate_rps": rate, "offered_rps": rate, "duration_s": 10.0, "device_rank_s": rank_s,
            "device_preinfer_s": preinfer_s, "by_served": served, "busy_fraction": 0.5, **extra}  # fmt: skip


def stage(compute: float, batch: float = 1.0, calls: int = 100) -> dict:
    return {"calls": calls, "compute_ms_p50": compute, "batch_p50": batch}


RUN = {
    "machine": {"device": "test"},
    "config": {"lead_in_s": 10.0},
    "results": [
        {"config": "baseline", "workload": "L4096", "points": [
            point(100.0, 8.0, 0.0, {"full_recompute": stage(4.0)}, returning_share=0.5)]},
        {"config": "relay", "workload": "L4096", "points": [
            # 1000 pre-inferences (1100 produced, 100 of them reloads) of 3.5 ms; hits 3 ms in pairs.
            point(110.0, 3.0, 3.5, {"hbm_hit": stage(3.0, batch=2.0), "full_recompute": stage(5.0)},
                  returning_share=0.6, psi_produced=1100, reloads=100)]},
    ],
}  # fmt: skip


def test_work_per_call_and_the_bound():
    rows = {r["config"]: r for r in work.rows(RUN)}
    base, relay = rows["baseline"], rows["relay"]
    assert base["work_ms"] == pytest.approx(8.0e3 / (100 * 20))  # 20 s: lead-in and window
    assert math.isnan(base["bound_ms"])
    assert math.isnan(base["ceiling"])
    assert relay["work_ms"] == pytest.approx(6.5e3 / (110 * 20))
    assert (relay["P_ms"], relay["C_ms"], relay["F_ms"]) == pytest.approx((3.5, 1.5, 5.0))
    assert relay["first"] == pytest.approx(0.4)
    # A first call: the cheaper of P + C (5.0) and F (5.0); the others C.
    assert relay["bound_ms"] == pytest.approx(0.4 * 5.0 + 0.6 * 1.5)
    assert relay["ceiling"] == pytest.approx(base["work_ms"] / relay["bound_ms"])


def test_a_point_without_hits_has_no_bound_and_bad_files_are_refused(tmp_path, capsys):
    run = json.loads(json.dumps(RUN))
    run["results"][1]["points"][0]["by_served"] = {"full_recompute": stage(5.0)}
    relay = next(r for r in work.rows(run) if r["config"] == "relay")
    assert math.isnan(relay["bound_ms"])
    good = tmp_path / "good.json"
    good.write_text(json.dumps(RUN))
    work.main([str(good)])
    assert "| relay | L4096 | 110 |" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit):
        work.main([str(bad)])
