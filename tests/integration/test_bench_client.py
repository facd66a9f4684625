"""bench.client: the load generator alone against a stub ranker in its own process; every
planned call is answered, on both event loops, and the result file names the loop per row."""

from __future__ import annotations

import json

import pytest

from bench import client

pytestmark = pytest.mark.integration


def test_the_load_generator_alone_answers_every_call_on_both_loops(tmp_path):
    client.main(["--rates", "20", "--duration-s", "1", "--prefix-len", "256", "--producer", "none",
                 "--out-dir", str(tmp_path), "--tag", "t"])  # fmt: skip
    run = json.loads(next(tmp_path.glob("client-*-t.json")).read_text())
    rows = run["results"]
    assert [r["loop"] for r in rows] == ["asyncio", "uvloop"]
    for row in rows:
        assert row["ok"] > 0
        assert row["failed"] == 0
        assert row["p99_ms"] >= row["p50_ms"] > 0


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        client.main(["--rates", "0"])
    with pytest.raises(SystemExit):
        client.main(["--loops", "trio"])


def test_the_load_from_several_processes_is_measured_beside_one(tmp_path):
    client.main(["--rates", "20", "--duration-s", "1", "--prefix-len", "256", "--loops", "asyncio",
                 "--processes", "1", "2", "--out-dir", str(tmp_path), "--tag", "p"])  # fmt: skip
    rows = json.loads(next(tmp_path.glob("client-*-p.json")).read_text())["results"]
    assert [(r["loop"], r["processes"]) for r in rows] == [("asyncio", 1), ("asyncio", 2)]
    for row in rows:
        assert row["ok"] > 0
        assert row["failed"] == 0
        assert row["publish_failed"] == 0


@pytest.mark.parametrize("flags", [["--processes", "0"], ["--processes", "2", "--producer", "none"]])
def test_load_processes_that_cannot_run_are_refused(flags, capsys):
    with pytest.raises(SystemExit):
        client.main(flags)
    assert "--processes" in capsys.readouterr().err
