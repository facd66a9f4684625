"""bench.stacks: py-spy's raw profile read per thread, functions merged across lines, shares
that add up, and bad input refused in one line."""

from __future__ import annotations

import json

import pytest

from bench.stacks import frame_key, main, read, summarise

# As py-spy 0.4.3 writes it (`record --format raw --threads --idle`), trimmed.
PROFILE = """\
thread (25652): MainThread;<module> (t.py:9) 100
thread (25694): relaygr-engine;Thread.run (threading.py:982);_loop (engine.py:950);_issue_copies (engine.py:1470) 30
thread (25694): relaygr-engine;Thread.run (threading.py:982);_loop (engine.py:990);_issue_copies (engine.py:1471) 10
thread (25694): relaygr-engine;Thread.run (threading.py:982);_loop (engine.py:980);_plan (engine.py:1075) 60
thread (25695): copy-watch;Thread.run (threading.py:982);Event.wait (threading.py:629) 50
"""


def test_stacks_are_read_per_thread_with_a_functions_lines_merged():
    threads = read(PROFILE.splitlines())
    assert set(threads) == {"MainThread (25652)", "relaygr-engine (25694)", "copy-watch (25695)"}
    assert frame_key("_issue_copies (engine.py:1470)") == "_issue_copies (engine.py)"
    assert frame_key("<module> (<string>:2)") == "<module> (<string>)"
    rows = {r["thread"]: r for r in summarise(threads)}
    engine = rows["relaygr-engine (25694)"]
    assert engine["samples"] == 100
    assert engine["share"] == pytest.approx(100 / 250)
    inclusive = dict(engine["inclusive"])
    assert inclusive["_loop (engine.py)"] == pytest.approx(1.0)
    assert inclusive["_issue_copies (engine.py)"] == pytest.approx(0.4)  # two lines, one function
    assert dict(engine["self"]) == pytest.approx({"_plan (engine.py)": 0.6, "_issue_copies (engine.py)": 0.4})
    assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0)
    assert summarise(threads)[-1]["thread"] == "copy-watch (25695)"  # busiest first: 100, 100, 50


def test_the_command_prints_and_writes_the_summary_and_refuses_bad_input(tmp_path, capsys):
    profile = tmp_path / "pyspy.txt"
    profile.write_text(PROFILE)
    out = tmp_path / "stacks.json"
    assert main([str(profile), "--thread", "engine", "--top", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "## relaygr-engine (25694): 100 samples, 40.0% of all" in printed
    assert "MainThread" not in printed
    (row,) = json.loads(out.read_text())
    assert len(row["inclusive"]) == 3
    bad = tmp_path / "bad.txt"
    bad.write_text("not a profile\n")
    for argv in ([str(bad)], [str(tmp_path / "missing.txt")], [str(profile), "--top", "0"],
                 [str(profile), "--thread", "("]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
