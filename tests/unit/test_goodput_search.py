"""The goodput search (bench/goodput.py) against synthetic P99 curves: it finds the limit to within
the precision, extends past the grid instead of censoring, and never confuses a floor for a limit."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from bench.goodput import (
    censored_note,
    incomplete_record,
    never_worse_rows,
    parse_args,
    plan,
    point_config,
    reference_for,
    repeat_seed,
    summary_rows,
    workload_config,
)
from relaygr.search import LimitSearch, Point, SearchConfig, find_limit, recorded_beyond_reach
from relaygr.workload import WorkloadConfig, generate

SLO = 50.0
GRID = SearchConfig(grid=(10, 20, 40, 80, 160, 320), cap_rps=5000)


def curve(limit: float, noise: float = 0.0, seed: int = 0):
    """A measure(rate) whose P99 grows with the rate and crosses the SLO at `limit` (x a seeded
    uniform factor in [1 - noise, 1 + noise] per measurement); records what it was asked."""
    rng = random.Random(seed)
    asked: list[float] = []

    def measure(rate: float) -> Point:
        asked.append(rate)
        p99 = SLO * rate / (limit * (1 + rng.uniform(-noise, noise)))
        return Point(rate, p99, p99 <= SLO)

    measure.asked = asked  # type: ignore[attr-defined]
    return measure


def check_bracket(result, precision: float) -> None:
    """goodput met, first miss missed, within the precision of each other."""
    assert result.first_miss_rps is not None
    assert not result.censored
    assert result.first_miss_rps <= result.goodput_rps * (1 + precision) + 1e-9
    outcome = {p.rate_rps: p.meets_slo for _, p in result.points}
    assert outcome[result.goodput_rps] is True
    assert outcome[result.first_miss_rps] is False


@pytest.mark.parametrize("limit", [11.0, 27.0, 55.5, 137.0, 300.0, 319.0])
@pytest.mark.parametrize("precision", [0.10, 0.02])
def test_monotone_curve_limit_found_within_precision(limit, precision):
    config = SearchConfig(GRID.grid, precision=precision, cap_rps=GRID.cap_rps)
    measure = curve(limit)
    result = find_limit(measure, config)
    check_bracket(result, precision)
    assert result.goodput_rps <= limit < result.first_miss_rps
    # The grid is stepped in order up to the first miss, then bisected.
    grid_rates = [p.rate_rps for phase, p in result.points if phase == "grid"]
    assert grid_rates == [r for r in GRID.grid if r <= limit] + [min(r for r in GRID.grid if r > limit)]
    assert {phase for phase, _ in result.points} <= {"grid", "bisect"}


@pytest.mark.parametrize("seed", range(20))
def test_noisy_curve_still_brackets_a_met_and_a_missed_rate(seed):
    result = find_limit(curve(100.0, noise=0.1, seed=seed), GRID)
    check_bracket(result, 0.10)
    assert 100.0 * 0.9 / 1.1 <= result.goodput_rps <= 100.0 * 1.1
    assert result.first_miss_rps >= 100.0 * 0.9  # type: ignore[operator]


def test_a_configuration_that_never_meets_steps_down_to_the_floor():
    config = SearchConfig(GRID.grid, cap_rps=GRID.cap_rps, floor_rps=1.0)
    measure = curve(0.01)
    result = find_limit(measure, config)
    assert result.goodput_rps == 0.0
    assert not result.censored
    assert measure.asked == [10, 5, 2.5, 1.25, 1.0]  # type: ignore[attr-defined]
    assert result.first_miss_rps == 1.0  # the lowest rate tried: the floor itself
    assert [phase for phase, _ in result.points] == ["grid", "down", "down", "down", "down"]


def test_a_miss_within_a_step_of_the_floor_measures_the_floor_before_reading_zero():
    # k17f: one grid rate, 42.19 req/s, missed; the next step down (33.75) is under the floor
    # (40): the floor is measured, and the search reads its limit from it, not goodput 0.
    config = SearchConfig((42.1875,), cap_rps=42.1875, floor_rps=40.0, growth=1.25, precision=0.12)
    measure = curve(41.0)
    result = find_limit(measure, config)
    assert measure.asked == [42.1875, 40.0]  # type: ignore[attr-defined]
    assert result.goodput_rps == 40.0
    assert result.first_miss_rps == 42.1875
    # Below the floor as well: both measured, nothing met, goodput 0 from a measured floor.
    low = curve(30.0)
    assert find_limit(low, config).goodput_rps == 0.0
    assert low.asked == [42.1875, 40.0]  # type: ignore[attr-defined]


def test_a_miss_at_the_grid_bottom_steps_down_then_bisects():
    result = find_limit(curve(3.3), SearchConfig(GRID.grid, cap_rps=GRID.cap_rps))
    check_bracket(result, 0.10)
    assert result.goodput_rps <= 3.3 < result.first_miss_rps  # type: ignore[operator]
    assert [p.rate_rps for phase, p in result.points if phase == "down"] == [5, 2.5]


def test_meeting_past_the_grid_extends_it_geometrically_then_finds_the_limit():
    result = find_limit(curve(1000.0), GRID)
    check_bracket(result, 0.10)
    assert result.goodput_rps <= 1000.0 < result.first_miss_rps  # type: ignore[operator]
    grid_rates = [p.rate_rps for phase, p in result.points if phase == "grid"]
    assert grid_rates == [10, 20, 40, 80, 160, 320, 640, 1280]


def test_meeting_everywhere_up_to_the_cap_is_reported_censored():
    config = SearchConfig(GRID.grid, cap_rps=1000)
    measure = curve(1e9)
    result = find_limit(measure, config)
    assert result.censored
    assert result.first_miss_rps is None
    assert result.goodput_rps == 1000
    assert measure.asked == [10, 20, 40, 80, 160, 320, 640, 1000]  # type: ignore[attr-defined]


def client_bound_at(limit: float, client_limit: float):
    """A system whose P99 crosses the SLO at `limit`, replayed by a load generator that falls
    behind at `client_limit` and above (its points there miss: a late client's P99 is huge)."""
    system = curve(limit)

    def measure(rate: float) -> Point:
        point = system(rate)
        if rate >= client_limit:
            return Point(rate, 5000.0, False, client_bound=True)
        return point

    measure.asked = system.asked  # type: ignore[attr-defined]
    return measure


def test_a_client_bound_point_ends_the_search_censored_not_as_the_systems_miss():
    measure = client_bound_at(limit=1e9, client_limit=300)
    result = find_limit(measure, GRID)
    assert result.censored
    assert result.first_miss_rps is None  # no rate was missed by the system
    assert result.goodput_rps == 160  # the highest rate met below the client's ceiling
    assert result.client_bound_rps == 320
    assert measure.asked == [10, 20, 40, 80, 160, 320]  # type: ignore[attr-defined]  # nothing above it


def test_a_client_bound_point_in_the_bisection_censors_at_the_highest_met_below_it():
    """The system misses at 160 (limit 100); the load generator falls behind once, at the
    bisection's 120: nothing between 80 and 160 is known, so the result is censored at 80."""
    system = curve(100)

    def measure(rate: float) -> Point:
        return Point(rate, 5000.0, False, client_bound=True) if rate == 120 else system(rate)

    result = find_limit(measure, GRID)
    assert result.censored
    assert result.first_miss_rps is None
    assert result.client_bound_rps == 120
    assert result.goodput_rps == 80
    assert [p.rate_rps for _, p in result.points] == [10, 20, 40, 80, 160, 120]


def test_a_point_on_a_broken_stack_ends_the_search_censored_at_the_highest_met_below_it():
    """As k16e's relay at L16384 (H200): met 33.75, missed 50.6, then its trigger lost the
    renewed broker and the bisection's 42.2 ran without pre-inference. That point is no miss of
    the relay's, and nothing after it can be trusted: the limit is >= 33.75, censored."""
    system = curve(45)

    def measure(rate: float) -> Point:
        if rate == 60:
            return Point(rate, 77.5, False, {"stack_broken": True}, stack_broken=True)
        return system(rate)

    result = find_limit(measure, GRID)
    assert result.censored
    assert result.first_miss_rps is None
    assert result.stack_broken_rps == 60
    assert result.client_bound_rps is None
    assert result.goodput_rps == 40
    assert [p.rate_rps for _, p in result.points] == [10, 20, 40, 80, 60]
    assert recorded_beyond_reach({"stack_broken": True, "lag_ms_p99": 1.0})
    assert recorded_beyond_reach({"client_bound": True})
    assert not recorded_beyond_reach({"client_bound": False, "stack_broken": False})
    assert censored_note(result) == " (CENSORED: the stack was broken at 60 req/s)"


def test_a_real_miss_below_the_client_ceiling_still_bisects_the_limit():
    """must_reach steps past the system's miss at 40 to 160, where the client falls behind: the
    miss at 40 bounds the limit, and the search bisects under it as usual."""
    measure = client_bound_at(limit=30, client_limit=150)
    result = find_limit(measure, GRID, must_reach=160)
    check_bracket(result, 0.10)
    assert result.goodput_rps <= 30 < result.first_miss_rps  # type: ignore[operator]
    assert not result.censored
    assert result.client_bound_rps == 160


def test_a_client_bound_point_is_no_miss_in_the_bounds_of_a_search_cut_short():
    search = LimitSearch(GRID)
    search.observe(Point(10, 5.0, True))
    search.observe(Point(20, 5000.0, False, client_bound=True))
    assert search.bounds() == (10, None)
    assert search.next_rate() is None  # ended at the client's ceiling


def test_must_reach_keeps_stepping_the_grid_but_not_the_limit():
    """A later configuration measures every grid rate an earlier one met (equal-rate comparisons),
    yet its limit is still bracketed by its own first miss, even when a higher rate meets again."""

    def measure(rate: float) -> Point:
        p99 = 60.0 if rate == 40 or 25 < rate < 40 else 10.0  # misses in (25, 40], meets elsewhere
        return Point(rate, p99, p99 <= SLO)

    result = find_limit(measure, GRID, must_reach=160)
    assert [p.rate_rps for phase, p in result.points if phase == "grid"] == [10, 20, 40, 80, 160]
    check_bracket(result, 0.10)
    assert 20 <= result.goodput_rps <= 25 < result.first_miss_rps <= 40  # type: ignore[operator]
    # The rates that met above the first miss say the limit is within the run's spread.
    assert result.met_above_miss_rps == 160
    assert find_limit(curve(55.0), GRID).met_above_miss_rps is None  # a monotone curve: none


def test_compare_rates_are_measured_once_at_the_end_and_do_not_move_the_limit():
    measure = curve(55.0)
    alone = find_limit(curve(55.0), GRID)
    result = find_limit(measure, GRID, compare=[20, 30, 10])
    assert (result.goodput_rps, result.first_miss_rps) == (alone.goodput_rps, alone.first_miss_rps)
    compared = [p.rate_rps for phase, p in result.points if phase == "compare"]
    assert compared == [30]  # 10 and 20 were grid points already
    assert len(measure.asked) == len(set(measure.asked))  # type: ignore[attr-defined]


def test_the_search_refuses_misuse():
    search = LimitSearch(GRID)
    with pytest.raises(ValueError, match="asked for"):
        search.observe(Point(11.0, 1.0, True))
    with pytest.raises(RuntimeError, match="not over"):
        search.result()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"grid": ()},
        {"grid": (20, 10)},
        {"grid": (10, 10)},
        {"grid": (0, 10)},
        {"grid": (10,), "precision": 0},
        {"grid": (10,), "growth": 1.0},
        {"grid": (10, 20), "cap_rps": 15},
        {"grid": (10,), "floor_rps": 20},
    ],
)
def test_bad_search_configs_are_refused(kwargs):
    with pytest.raises(ValueError, match="SearchConfig"):
        SearchConfig(**kwargs)


def test_workload_names():
    base = WorkloadConfig()
    assert workload_config("L4096", base).fixed_prefix_len == 4096
    assert workload_config("mix", base).fixed_prefix_len is None
    assert workload_config("L4096", base).session_mean_requests == base.session_mean_requests
    # -s1: sessions of one request (no reuse), everything else as without it.
    single = workload_config("L4096-s1", base)
    assert (single.fixed_prefix_len, single.session_mean_requests) == (4096, 1.0)
    mix_single = workload_config("mix-s1", base)
    assert (mix_single.fixed_prefix_len, mix_single.session_mean_requests) == (None, 1.0)
    assert not any(
        r.returning for r in generate(dataclasses.replace(single, duration_s=5.0, rate_rps=40.0)).requests
    )
    for bad in ("L4k", "L4096-s2", "mix-", "s1", "L-s1"):
        with pytest.raises(ValueError, match="unknown workload"):
            workload_config(bad, base)


def test_repeats_repeat_the_named_workloads_each_with_its_own_seed(capsys):
    args = parse_args(["--workloads", "L4096,L8192,mix", "--repeats", "3"])
    assert plan(args) == [
        ("L4096", 0),
        ("L8192", 0),
        ("mix", 0),
        ("L4096", 1),
        ("mix", 1),
        ("L4096", 2),
        ("mix", 2),
    ]
    args = parse_args(
        ["--workloads", "L8192", "--repeats", "2", "--repeat-workloads", "L8192", "--seed", "5"]
    )
    assert plan(args) == [("L8192", 0), ("L8192", 1)]
    # Every configuration replays repeat r with the same seed; repeats replay different ones.
    assert [repeat_seed(args, r) for r in (0, 1)] == [5, 6]
    a, b = (generate(dataclasses.replace(workload_config("L8192", WorkloadConfig(seed=repeat_seed(args, r))),
                                         duration_s=5.0, rate_rps=50.0)) for r in (0, 1))  # fmt: skip
    assert [q.t_rank_s for q in a.requests] != [q.t_rank_s for q in b.requests]
    # Repeats that repeat nothing say so; naming a workload the run does not have is refused.
    assert plan(parse_args(["--workloads", "L8192", "--repeats", "2"])) == [("L8192", 0)]
    assert "repeats nothing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--workloads", "L8192", "--repeats", "2", "--repeat-workloads", "L4096"])
    assert "--repeat-workloads: L4096 not in --workloads" in capsys.readouterr().err


@pytest.mark.parametrize("rate", [2.0, 40.0, 400.0])
def test_each_point_lasts_at_least_10_s_and_400_calls(rate):
    cfg = point_config(WorkloadConfig(seed=3, users=1000), rate, min_duration_s=10.0, min_calls=400)
    assert cfg.duration_s >= max(10.0, 400 / rate)
    assert len(generate(cfg)) >= 400


def _record(config: str, repeat: int, goodput: float, points: list[tuple[float, float]]) -> dict:
    return {
        "config": config,
        "workload": "mix",
        "repeat": repeat,
        "goodput_rps": goodput,
        "points": [{"rate_rps": r, "p99_ms": p, "meets_slo": p <= SLO} for r, p in points],
    }


def test_never_worse_rows_set_every_rate_the_baseline_met_beside_the_relay():
    records = [
        _record("baseline", 0, 20, [(10, 20.0), (20, 40.0), (40, 80.0)]),
        _record("relay", 0, 40, [(10, 21.0), (40, 45.0)]),
    ]
    rows = never_worse_rows(records)
    assert [(r["rate_rps"], r["p99_ms"]) for r in rows] == [(10, 21.0), (20, "not measured")]
    assert math.isclose(rows[0]["ratio"], 21.0 / 20.0)
    assert rows[0]["not_worse"] is True


def test_each_configuration_is_compared_with_the_baseline_of_its_layout():
    configs = ["baseline", "baseline-2p-mps", "relay", "relay-2p-mps", "relay-nospare-2p-mps", "relay-edf"]
    assert reference_for("relay-2p-mps", configs) == "baseline-2p-mps"
    assert reference_for("relay-nospare-2p-mps", configs) == "baseline-2p-mps"
    assert reference_for("relay", configs) == "baseline"
    assert reference_for("relay-edf", configs) == "baseline"  # no baseline-edf ran
    assert reference_for("baseline-2p-mps", configs) == "baseline"  # the layout's own ratio
    assert reference_for("baseline", configs) is None
    assert reference_for("relay-2p-mps", ["relay-2p-mps"]) is None  # nothing to compare with
    expandable = ["baseline-2p-mps", "baseline-2p-mps-expandable", "relay-2p-mps-expandable"]
    assert reference_for("relay-2p-mps-expandable", expandable) == "baseline-2p-mps-expandable"
    assert reference_for("baseline-2p-mps", ["baseline-2p-mps", "relay-2p-mps"]) is None
    records = [
        _record("baseline-2p-mps", 0, 20, [(10, 20.0), (20, 40.0), (40, 80.0)]),
        _record("relay-2p-mps", 0, 20, [(10, 21.0), (20, 60.0), (40, 80.0)]),
    ]
    (row,) = summary_rows(records, ["baseline-2p-mps", "relay-2p-mps"])
    assert row["relay-2p-mps / baseline-2p-mps"] == pytest.approx(1.0)
    rows = never_worse_rows(records)
    assert [(r["reference"], r["config"], r["rate_rps"], r["not_worse"]) for r in rows] == [
        ("baseline-2p-mps", "relay-2p-mps", 10, True),
        ("baseline-2p-mps", "relay-2p-mps", 20, False),
    ]


def test_summary_gives_the_median_over_repeats_and_the_ratio():
    records = [
        _record("baseline", 0, 10, []),
        _record("baseline", 1, 30, []),
        _record("relay", 0, 40, []),
        _record("relay", 1, 60, []),
    ]
    (row,) = summary_rows(records, ["baseline", "relay"])
    assert row["baseline"] == "20 (10, 30)"
    assert row["relay / baseline"] == pytest.approx(2.5)


def test_a_search_cut_short_keeps_its_points_and_bounds_but_no_limit():
    # A time limit stopped the search while bisecting: the points are real, the limit unknown.
    search = LimitSearch(GRID)
    measure = curve(55.0)
    for _ in range(5):  # 10, 20, 40, 80 (miss), then the first bisection point
        rate = search.next_rate()
        assert rate is not None
        search.observe(measure(rate))
    assert search.next_rate() is not None  # not over
    assert search.bounds() == (40.0, 60.0)  # 60 missed: the bisection's first point
    record = incomplete_record("relay", "mix", 1, search, SLO)
    assert record["incomplete"] is True
    assert record["goodput_rps"] is None
    assert record["first_miss_rps"] is None
    assert (record["met_rps_max"], record["missed_rps_min"]) == (40.0, 60.0)
    assert [p["phase"] for p in record["points"]] == ["grid"] * 4 + ["bisect"]
    complete = {"config": "relay", "workload": "mix", "repeat": 0, "goodput_rps": 30.0, "points": []}
    rows = summary_rows([complete, record], ["relay"])
    assert rows == [{"workload": "mix", "relay": "30 (30)"}]  # the cut-short search is no value


def test_bounds_before_any_miss():
    search = LimitSearch(GRID)
    search.observe(curve(1000.0)(10.0))
    assert search.bounds() == (10.0, None)


def test_a_recorded_point_is_client_bound_by_its_flag_or_else_by_its_send_lag():
    from relaygr.search import recorded_client_bound

    assert recorded_client_bound({"client_bound": True, "lag_ms_p99": 0.5})
    assert not recorded_client_bound({"client_bound": False, "lag_ms_p99": 900.0})  # the flag decides
    # Files from before the flag (bench/results/goodput-nvidia-h200-h5c: 4736 ms at 587.5 req/s).
    assert recorded_client_bound({"lag_ms_p99": 4735.8})
    assert not recorded_client_bound({"lag_ms_p99": 3.6})
    assert not recorded_client_bound({})


def test_the_sim_reads_a_limit_without_the_load_generators_points():
    from relaygr.sim import measured_limit

    points = [
        {"rate_rps": 375.0, "meets_slo": True, "lag_ms_p99": 2.0},
        {"rate_rps": 470.0, "meets_slo": True, "lag_ms_p99": 3.6},
        {"rate_rps": 587.5, "meets_slo": False, "lag_ms_p99": 4735.8},  # the client fell behind
    ]
    result = {"results": [{"config": "relay", "workload": "mix", "points": points}]}
    assert measured_limit(result, "relay", "mix") == (470.0, math.inf)  # a floor: no miss of its own
    points[2]["client_bound"] = False
    assert measured_limit(result, "relay", "mix") == (470.0, 587.5)


def test_a_search_record_carries_what_the_capacity_model_needs_of_its_stack():
    """stack_settings: the ranker's measured step costs and the trigger's admission settings,
    from their start-up lines (also on a search cut short, whose points the model checks too)."""
    from types import SimpleNamespace

    from bench.goodput import stack_settings

    ranker = SimpleNamespace(records=lambda: [
        {"event": "preinfer_steps_calibrated", "per_step_ms": 4.5, "per_token_us": 0.0, "per_pair_ns": 0.03},
        {"event": "preinfer_graph_steps_calibrated", "per_step_ms": 0.7, "per_token_us": 0.37,
         "per_pair_ns": 0.02, "graph_tokens": 17408, "graph_batch": 2, "graph_reads_psi": True,
         "batch_copies": "kernel"},
    ])  # fmt: skip
    trigger = SimpleNamespace(records=lambda: [{"event": "trigger_ready", "admission": {"slo_ms": 50.0}}])
    got = stack_settings(SimpleNamespace(rankers=[ranker], trigger=trigger))  # type: ignore[arg-type]
    assert got["ranker_step_costs"]["eager"]["per_step_ms"] == 4.5
    assert got["ranker_step_costs"]["graph"]["per_pair_ns"] == 0.02
    assert got["ranker_step_costs"]["graph_reads_psi"] is True  # what the model plans chunks by
    assert got["ranker_step_costs"]["batch_copies"] == "kernel"  # how the model times batches' copies
    assert got["trigger_settings"] == {"slo_ms": 50.0}
    assert stack_settings(SimpleNamespace(rankers=[], trigger=None)) == {  # type: ignore[arg-type]
        "ranker_step_costs": {},
        "trigger_settings": {},
    }


class _RenewalFails:
    """A stack whose broker renewal leaves a service behind (Stack.renew_broker raises)."""

    def __init__(self, trigger_policy: str) -> None:
        self.config = type("Config", (), {"trigger_policy": trigger_policy})()

    async def renew_broker(self) -> bool:
        raise RuntimeError("trigger did not read the renewed broker within 15 s, 2 times")


@pytest.mark.parametrize(("policy", "broken"), [("sequence", True), ("off", False)])
def test_a_renewal_that_leaves_the_signal_path_behind_breaks_only_a_configuration_that_uses_it(
    monkeypatch, policy, broken
):
    # A relay measured without its trigger is no measurement of the relay (k16e); the baseline's
    # calls never touch Kafka, so its point stands.
    import asyncio
    import collections

    from bench import goodput
    from relaygr import harness

    async def fake_point(*_args, **_kwargs) -> harness.Point:
        summary = collections.defaultdict(float, {"meets_slo": True, "p99_ms": 20.0, "client_bound": False})
        return harness.Point("rate", 10.0, summary, collections.defaultdict(float), 0.0)

    monkeypatch.setattr(goodput, "run_point", fake_point)
    args = parse_args(["--configs", "relay"])
    runner = goodput.Runner(_RenewalFails(policy), args, label="relay")  # type: ignore[arg-type]
    point = asyncio.run(runner.measure(workload_config("L4096", WorkloadConfig()), 10.0))
    assert point.stack_broken is broken
    assert point.record["stack_broken"] is broken
    assert ("stack_broken_reason" in point.record) is broken


def test_the_expandable_variants_set_the_rankers_allocator_and_keep_their_layout():
    from relaygr.harness import stack_overrides

    overrides, _ = stack_overrides("relay-2p-mps-expandable")
    assert overrides["env"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert overrides["rankers_per_device"] == 2
    assert overrides["mps"] is True
    plain, _ = stack_overrides("baseline-expandable")
    assert plain["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "env" not in stack_overrides("baseline-2p-mps")[0]
    gc, _ = stack_overrides("relay-alloc-gc")
    assert gc["env"] == {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.9"}
    assert stack_overrides("baseline-alloc-nosplit")[0]["env"] == {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"
    }
