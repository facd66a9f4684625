"""bench.goodput --merge: result files of one sitting (GPUs of one host side by side) become one
report with repeats renumbered; files of different machines or protocols are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import goodput


def result_file(
    path: Path,
    gpu: str,
    records: list[dict],
    host: str = "h1",
    slo_ms: float = 50.0,
    lead_in_s: float = 10.0,
    boot: str = "b1",
) -> Path:
    machine = {
        "host": host,
        "boot_id": boot,
        "device": "NVIDIA H100",
        "commit": "abc",
        "cuda_visible_devices": gpu,
        "cpu_model": "Some Xeon",
        "cpu_count": 16,
        "host_probe_ms": 12.5,
    }
    config = {"preset": "bench", "slo_ms": slo_ms, "rankers": 1, "min_duration_s": 10.0, "min_calls": 400,
              "precision": 0.1, "session_mean_requests": 3.0, "think_scale": 0.1, "gap_ms": [20.0, 200.0], "tag": gpu,
              "configs": ["baseline", "relay"], "lead_in_s": lead_in_s}  # fmt: skip
    path.write_text(json.dumps({"machine": machine, "config": config, "results": records}))
    return path


def record(config: str, workload: str, goodput: float, repeat: int = 0) -> dict:
    points = [{"rate_rps": goodput, "p99_ms": 40.0, "meets_slo": True},
              {"rate_rps": goodput * 1.1, "p99_ms": 60.0, "meets_slo": False}]  # fmt: skip
    return {"config": config, "workload": workload, "repeat": repeat, "goodput_rps": goodput,
            "first_miss_rps": goodput * 1.1, "censored": False, "points": points}  # fmt: skip


def test_merge_renumbers_repeats_per_config_and_workload_in_file_order(tmp_path):
    a = result_file(
        tmp_path / "a.json", "0", [record("baseline", "L4096", 50), record("relay", "L4096", 150)]
    )
    b = result_file(tmp_path / "b.json", "1", [record("baseline", "L4096", 60), record("relay", "L4096", 130),
                                               record("baseline", "mix", 100)])  # fmt: skip
    records, settings, info = goodput.merge([a, b])
    got = {(r["config"], r["workload"], r["repeat"]): r["goodput_rps"] for r in records}
    assert got == {("baseline", "L4096", 0): 50, ("relay", "L4096", 0): 150, ("baseline", "L4096", 1): 60,
                   ("relay", "L4096", 1): 130, ("baseline", "mix", 0): 100}  # fmt: skip
    assert settings["merged_from"] == ["a.json", "b.json"]
    assert settings["configs"] == ["baseline", "relay"]
    assert info["host"] == "h1"
    assert info["cuda_visible_devices"] == "0,1"


def test_merge_writes_one_report_with_medians(tmp_path):
    a = result_file(
        tmp_path / "a.json", "0", [record("baseline", "L4096", 50), record("relay", "L4096", 150)]
    )
    b = result_file(
        tmp_path / "b.json", "1", [record("baseline", "L4096", 60), record("relay", "L4096", 130)]
    )
    paths = goodput.main(["--merge", str(a), str(b), "--tag", "merged", "--out-dir", str(tmp_path / "out")])
    md = next(p for p in paths if p.suffix == ".md").read_text()
    assert "NVIDIA H100" in md
    assert "(commit abc)" in md
    assert "Host: Some Xeon, 16 cores; a fixed Python loop took 12.5 ms" in md  # the measuring host
    assert "| L4096 | 55 (50, 60) | 140 (150, 130) |" in md  # medians over both repeats, every value
    merged = json.loads(next(p for p in paths if p.suffix == ".json").read_text())
    assert [r["repeat"] for r in merged["results"]] == [0, 0, 1, 1]
    assert merged["machine"]["host"] == "h1"


@pytest.mark.parametrize(
    ("other", "message"),
    [
        ({"host": "h2"}, "machine.host"),
        ({"boot": "b2"}, "machine.boot_id"),  # another lease of a machine with the same name
        ({"slo_ms": 30.0}, "config.slo_ms"),
        ({"lead_in_s": 0.0}, "config.lead_in_s"),
    ],
)
def test_merge_refuses_files_of_another_sitting_or_protocol(tmp_path, other, message):
    a = result_file(tmp_path / "a.json", "0", [record("baseline", "L4096", 50)])
    b = result_file(tmp_path / "b.json", "1", [record("baseline", "L4096", 60)], **other)
    with pytest.raises(ValueError, match=message):
        goodput.merge([a, b])
    with pytest.raises(SystemExit, match="bench.goodput --merge: .*" + message):
        goodput.main(["--merge", str(a), str(b), "--out-dir", str(tmp_path)])


def test_merge_needs_two_readable_files(tmp_path):
    a = result_file(tmp_path / "a.json", "0", [record("baseline", "L4096", 50)])
    with pytest.raises(ValueError, match="at least two"):
        goodput.merge([a])
    with pytest.raises(ValueError, match=r"missing\.json"):
        goodput.merge([a, tmp_path / "missing.json"])
