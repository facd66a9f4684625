"""bench.psi_alloc: the relay's psi churn under an LRU byte budget, size classes, and the CPU run."""

from __future__ import annotations

import json

import pytest

from bench.psi_alloc import Op, churn, main, psi_bytes


def test_a_psi_block_is_every_layers_k_and_v_then_its_timestamps():
    # bench preset: 8 layers x K and V x 1024 features x 2 bytes = 32 KiB a token, + 8 for its time.
    assert psi_bytes(4096, "bench") == 4096 * (8 * 2 * 1024 * 2 + 8)
    assert psi_bytes(100, "tiny") == 100 * (2 * 2 * 32 * 4 + 8)


def test_held_psi_is_a_hit_and_the_least_recently_used_goes_first():
    a, b, c = (1, 1), (2, 1), (3, 1)
    out = churn([(a, 40), (b, 40), (a, 40), (c, 40), (b, 40)], budget_bytes=100)
    # a and b fit; a is read (now the most recent); c needs room: b, the least recent, goes;
    # b's return is not held any more and comes back in a's place.
    assert out.ops == [Op("alloc", 0, 40), Op("alloc", 1, 40), Op("free", 1), Op("alloc", 2, 40),
                       Op("free", 0), Op("alloc", 3, 40)]  # fmt: skip
    assert (out.hits, out.allocs, out.evictions, out.too_large) == (1, 4, 2, 0)


def test_psi_over_the_whole_budget_is_never_kept_and_frees_nothing():
    out = churn([((1, 1), 60), ((2, 1), 200)], budget_bytes=100)
    assert out.ops == [Op("alloc", 0, 60)]
    assert out.too_large == 1


def test_the_keep_fraction_is_a_draw_of_its_seed():
    requests = [((user, 1), 10) for user in range(1000)]
    half = churn(requests, budget_bytes=10**9, keep_fraction=0.5, seed=3)
    assert half == churn(requests, budget_bytes=10**9, keep_fraction=0.5, seed=3)
    assert 400 < half.allocs < 600
    assert churn(requests, budget_bytes=10**9, keep_fraction=1.0).allocs == 1000


def test_with_size_classes_the_budget_counts_class_bytes_as_the_rankers_cache_does():
    # Three 40-byte psi under a 100-byte budget: exact, two fit; counted as 50-byte classes, too.
    requests = [((user, 1), 40) for user in range(3)]
    exact = churn(requests, budget_bytes=100)
    classes = churn(requests, budget_bytes=120, footprint=lambda n: 50)
    assert (exact.allocs, exact.evictions) == (3, 1)
    assert (classes.allocs, classes.evictions) == (3, 1)  # 3 x 50 > 120: one goes
    assert [op.nbytes for op in classes.ops if op.kind == "alloc"] == [40, 40, 40]  # blocks' own bytes
    assert churn(requests, budget_bytes=120).evictions == 0  # exact bytes would hold all three
    assert churn([((1, 1), 40)], budget_bytes=45, footprint=lambda n: 50).too_large == 1


def test_the_cpu_replay_writes_every_variant_without_allocator_figures(tmp_path):
    main(["--device", "cpu", "--duration-s", "3", "--rate", "100", "--budget-mb", "300",
          "--variants", "default", "expandable+classes", "--out-dir", str(tmp_path), "--tag", "t"])  # fmt: skip
    (path,) = tmp_path.glob("psi-alloc-*-t.json")
    rows = json.loads(path.read_text())["results"]
    assert [r["variant"] for r in rows] == ["default", "expandable+classes"]
    for row in rows:
        assert row["allocs"] > 0
        assert row["evictions"] > 0
        assert row["ooms"] == 0
        assert row["alloc_retries"] is None
        assert row["reserved_peak_gb"] is None
    assert rows[0]["class_waste"] == 0.0
    assert 0.0 < rows[1]["class_waste"] < 0.125
    # Class bytes fill the budget sooner: at least as many evictions as exact bytes.
    assert rows[1]["evictions"] >= rows[0]["evictions"]


@pytest.mark.parametrize("flag", [["--keep-fraction", "0"], ["--class-ratio", "1"], ["--budget-mb", "-1"]])
def test_wrong_values_are_refused_at_the_command_line(flag):
    with pytest.raises(SystemExit):
        main(["--device", "cpu", *flag])
