from relaygr.core_demo import run_core_demo


def test_core_demo_scores_match_and_cached_is_cheaper():
    rows = run_core_demo(users=2, prefix_len=600)
    assert len(rows) == 2
    assert max(r.max_abs_diff for r in rows) <= 1e-5
    assert all(r.prefix_len > 0 and r.cached_ms > 0 for r in rows)
