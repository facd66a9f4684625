"""bench.plan_cost runs and writes its table (its figures are timings: what they show is for the
benchmark to print; that a step's planning is bounded is tested by counting, test_rank_queue)."""

from __future__ import annotations

import json

import pytest

from bench import plan_cost


def test_plan_cost_writes_a_row_a_depth(tmp_path, capsys):
    assert plan_cost.main(["--depths", "1", "600", "--seconds", "0.05", "--out-dir", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("plan-cost-*.json")
    doc = json.loads(json_path.read_text())
    rows = {r["queued"]: r for r in doc["results"]}
    assert set(rows) == {1, 600}
    assert rows[600]["doomed"] > 0
    assert all(r["queue_us"] > 0 and r["list_us"] > 0 for r in rows.values())
    assert "cpu_model" in doc["machine"]
    assert "queued" in capsys.readouterr().out


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        plan_cost.main(["--rate", "0"])
    assert "must be positive" in capsys.readouterr().err
