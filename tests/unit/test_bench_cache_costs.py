import json

import pytest

from bench import cache_costs


def test_cache_costs_times_each_event_loop_operation_with_and_without_hot_copies(tmp_path):
    cache_costs.main(
        ["--budget-mib", "400", "--psi-mib", "10", "--reps", "3", "--out-dir", str(tmp_path), "--tag", "t"]
    )
    written = json.loads((tmp_path / "cache-costs-cpu-t.json").read_text())
    rows = written["results"]
    assert {(r["hot_copies"], r["op"]) for r in rows} == {
        (case, op) for case in ("none", "1 in 8") for op in ("admit_keep", "hit", "demote_ahead", "expire")
    }
    assert all(r["cpu_us_p50"] >= 0 and r["wall_us_p90"] >= r["wall_us_p50"] for r in rows)
    assert all(r["entries"] >= 40 for r in rows)  # the cache stays full: every admission evicts
    assert written["config"]["psi_mib"] == 10


def test_the_built_cache_is_full_with_the_hot_copies_asked_for():
    relay = cache_costs.build(400, 10, 8, copy_ms=0.3, saving_ms=1.6)
    assert len(relay.cache) == 40
    assert relay.cache.used_bytes == 400 * cache_costs.MIB
    hot = cache_costs.hot_copies(400, 10, 8)
    assert [relay.cache.lookup(k).state.value for k in hot] == ["demoted"] * 5
    assert cache_costs.hot_copies(400, 10, 0) == []


@pytest.mark.parametrize(
    "bad", [["--psi-mib", "0"], ["--budget-mib", "30", "--psi-mib", "10"], ["--reps", "0"]]
)
def test_bad_sizes_are_refused_with_one_line(bad, capsys):
    with pytest.raises(SystemExit):
        cache_costs.main(bad)
    assert "must be" in capsys.readouterr().err
