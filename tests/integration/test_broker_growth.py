"""bench.broker_growth end to end on the embedded broker: a few seconds at a low rate, two
partition counts; every window's records are consumed and the result file says what was run."""

from __future__ import annotations

import json

import pytest

from bench import broker_growth

pytestmark = pytest.mark.integration


def test_broker_growth_writes_one_row_per_partition_count_and_window(tmp_path, capsys):
    broker_growth.main([
        "--partitions", "1", "3", "--rate", "40", "--record-kb", "20", "--duration-s", "2.5",
        "--window-s", "1", "--out-dir", str(tmp_path), "--tag", "smoke",
    ])  # fmt: skip
    [path] = tmp_path.glob("broker-growth-*-smoke.json")
    doc = json.loads(path.read_text())
    rows = doc["results"]
    assert {r["partitions"] for r in rows} == {1, 3}
    for r in rows:
        # Every window's records came back through the broker, in order of their windows.
        assert r["consumed"] > 0
        assert 0 < r["latency_ms_p50"] <= r["latency_ms_p99"]
        assert r["broker_cores"] >= 0
        assert r["records_held"] > 0
    assert doc["config"]["broker"].startswith("tansu")
    assert "partitions   3" in capsys.readouterr().out


def test_broker_growth_refuses_a_bad_setting():
    with pytest.raises(SystemExit):
        broker_growth.main(["--partitions", "0", "--no-write"])
