"""The workload generator: reproducible, the rates and shapes it promises, and the materializer's
contract ((user, prefix version) names one prefix)."""

from __future__ import annotations

import collections
import dataclasses
from typing import Literal

import numpy as np
import pytest
import torch

from relaygr.workload import (
    Materializer,
    WorkloadConfig,
    generate,
    ml100k_shape,
    read_length_histogram,
    think_time_s,
    user_prefix_lengths,
)
from services.ranker.wire import rank_inputs
from shared.protos import events_pb2 as ev
from shared.wire import RequestLimits

LONG = WorkloadConfig(seed=3, duration_s=3600.0, rate_rps=20.0)  # ~72k requests, ~0.5 s to plan


@pytest.fixture(scope="module")
def long_workload():
    return generate(LONG)


def test_same_seed_same_plan_other_seed_other_plan():
    config = WorkloadConfig(seed=11, duration_s=120.0, rate_rps=30.0)
    a, b = generate(config), generate(config)
    assert a.requests == b.requests
    assert a.requests
    other = generate(dataclasses.replace(config, seed=12))
    assert [r.t_retrieval_s for r in other.requests] != [r.t_retrieval_s for r in a.requests]


def test_requests_are_sorted_unique_and_inside_the_horizon(long_workload):
    reqs = long_workload.requests
    times = [r.t_retrieval_s for r in reqs]
    assert times == sorted(times)
    assert len({r.request_id for r in reqs}) == len(reqs)
    assert all(0 <= r.t_retrieval_s < LONG.duration_s for r in reqs)
    assert all(r.recent_len == 64 for r in reqs)
    assert all(r.candidates == 256 for r in reqs)


@pytest.mark.parametrize("arrivals", ["poisson", "bursty"])
def test_realized_rate_is_close_to_the_offered_rate(arrivals: Literal["poisson", "bursty"]):
    config = dataclasses.replace(LONG, arrivals=arrivals, seed=5)
    realized = generate(config).describe()["realized_rps"]
    assert realized == pytest.approx(config.rate_rps, rel=0.08)


def test_bursty_arrivals_are_burstier_than_poisson():
    def dispersion(arrivals: Literal["poisson", "bursty"]) -> float:
        w = generate(dataclasses.replace(LONG, arrivals=arrivals, session_mean_requests=1.0))
        counts = np.histogram([r.t_retrieval_s for r in w.requests], bins=int(LONG.duration_s))[0]
        return float(counts.var() / counts.mean())  # 1 for Poisson

    assert dispersion("poisson") == pytest.approx(1.0, abs=0.15)
    assert dispersion("bursty") > 2.0


def test_returning_fraction_follows_the_session_size(long_workload):
    expected = 1 - 1 / LONG.session_mean_requests
    got = long_workload.describe()["returning_fraction"]
    # A few points under: sessions cut by the horizon (the think times' tail is days long).
    assert expected - 0.06 < got <= expected + 0.01
    single = generate(dataclasses.replace(LONG, session_mean_requests=1.0, duration_s=300.0))
    assert single.describe()["returning_fraction"] == 0.0


def test_lengths_follow_the_scaled_ml100k_shape_with_a_short_head():
    config = WorkloadConfig(users=200_000, length_scale=16.0, short_head_fraction=0.2)
    lengths = user_prefix_lengths(config)
    hist = np.asarray(ml100k_shape()["history_lengths"]) * 16
    head_hi = 20 * 16
    body = lengths[lengths >= head_hi]
    for q in (10, 50, 90, 99):
        assert np.percentile(body, q) == pytest.approx(np.percentile(hist, q), rel=0.05)
    assert lengths.max() <= hist.max() + 16
    short = np.mean(lengths < head_hi)
    assert short == pytest.approx(0.2, abs=0.01)
    assert lengths.min() >= config.profile_tokens + 1
    assert np.mean(lengths < 100) > 0.04  # the head reaches down to a handful of tokens
    clipped = user_prefix_lengths(dataclasses.replace(config, max_prefix_len=4096))
    assert clipped.max() == 4096


def test_fixed_prefix_len_gives_exactly_that_length():
    w = generate(WorkloadConfig(duration_s=60.0, rate_rps=20.0, fixed_prefix_len=3000))
    assert w.requests
    assert {r.prefix_len for r in w.requests} == {3000}


def test_a_users_length_does_not_depend_on_rate_or_duration():
    a = generate(WorkloadConfig(seed=2, duration_s=300.0, rate_rps=10.0, users=500))
    b = generate(WorkloadConfig(seed=2, duration_s=200.0, rate_rps=40.0, users=500))
    la = {r.user_id: r.prefix_len for r in a.requests}
    lb = {r.user_id: r.prefix_len for r in b.requests}
    common = la.keys() & lb.keys()
    assert common
    assert all(la[u] == lb[u] for u in common)


def test_gaps_stay_within_their_bounds(long_workload):
    gaps_ms = [(r.t_rank_s - r.t_retrieval_s) * 1e3 for r in long_workload.requests]
    assert min(gaps_ms) >= LONG.gap_min_ms
    assert max(gaps_ms) <= LONG.gap_max_ms
    think = long_workload.think_times_s()
    assert min(think) >= 1.0 * LONG.think_scale - 1e-9  # the next request after the previous reply


def test_think_times_follow_the_ml100k_non_zero_gaps():
    q = ml100k_shape()["gap_seconds_quantiles"]
    zero = ml100k_shape()["gap_zero_fraction"]
    # The conditional level u of overall quantile 90 maps back onto that quantile.
    u = (0.90 - zero) / (1 - zero)
    assert think_time_s([u], 1.0)[0] == pytest.approx(q["90"], rel=1e-6)
    samples = think_time_s(np.random.default_rng(0).random(200_000), 0.1)
    assert np.median(samples) == pytest.approx(3.7, rel=0.1)
    assert samples.min() >= 0.1


def test_prefix_version_is_fixed_in_a_session_and_increments_per_session():
    config = WorkloadConfig(seed=4, duration_s=600.0, rate_rps=30.0, users=50, version_base=7)
    w = generate(config)
    by_user: dict[int, list] = collections.defaultdict(list)
    for r in w.requests:
        by_user[r.user_id].append(r)
    repeat_users = 0
    for reqs in by_user.values():
        versions = sorted({r.prefix_version for r in reqs})
        assert versions[0] == config.version_base + 1
        assert versions == list(range(versions[0], versions[0] + len(versions)))
        # Each version is one session: indices 0..k-1 once each, in time order.
        for v in versions:
            session = [r.session_index for r in reqs if r.prefix_version == v]
            assert session == list(range(len(session)))
        repeat_users += len(versions) > 1
    assert repeat_users > 10
    first_session_start: dict[tuple[int, int], float] = {}
    for r in w.requests:
        if r.session_index == 0:
            first_session_start.setdefault((r.user_id, r.prefix_version), r.t_retrieval_s)
    for (user, version), t in first_session_start.items():
        if version > config.version_base + 1:  # sessions of a user start in version order
            assert t >= first_session_start[(user, version - 1)]


def test_materialize_same_user_and_version_same_prefix_suffix_varies():
    w = generate(WorkloadConfig(seed=9, duration_s=300.0, rate_rps=20.0, users=200))
    sessions: dict[tuple[int, int], list] = collections.defaultdict(list)
    for r in w.requests:
        sessions[(r.user_id, r.prefix_version)].append(r)
    a, b = next(reqs for reqs in sessions.values() if len(reqs) >= 2)[:2]
    m1, m2 = Materializer.for_workload(w), Materializer.for_workload(w, max_cached_tokens=1)
    (p1, s1), (p2, s2) = m1.materialize(a), m1.materialize(b)
    p3, _ = m2.materialize(b)  # a fresh materializer rebuilds the prefix: the same tokens
    assert m1.hits == 1
    for p in (p2, p3):
        assert torch.equal(p1.profile, p.profile)
        assert torch.equal(p1.long_term.items, p.long_term.items)
        assert torch.equal(p1.long_term.timestamps, p.long_term.timestamps)
    assert p1.length == a.prefix_len
    assert not torch.equal(s1.candidates, s2.candidates)
    assert not torch.equal(s1.recent.items, s2.recent.items)
    assert len(s1.recent) == a.recent_len
    assert s1.candidates.numel() == a.candidates
    # Timestamps increase: history, then recent behaviours, then the query.
    assert bool((p1.long_term.timestamps.diff() >= 0).all())
    assert int(p1.long_term.timestamps[-1]) < int(s1.recent.timestamps[0])
    assert int(s1.recent.timestamps[-1]) < s1.query_time
    # Another version of the same user is another prefix.
    other = m1.prefix(a.user_id, a.prefix_version + 1, a.prefix_len)
    assert not torch.equal(other.long_term.items, p1.long_term.items)


def test_messages_are_valid_on_the_wire():
    w = generate(WorkloadConfig(seed=1, duration_s=30.0, rate_rps=10.0))
    m = Materializer.for_workload(w)
    planned = w.requests[0]
    checked, suffix = rank_inputs(m.rank_request(planned), RequestLimits())
    prefix = checked.tensors()
    want_prefix, want_suffix = m.materialize(planned)
    assert torch.equal(prefix.long_term.items, want_prefix.long_term.items)
    assert torch.equal(suffix.candidates, want_suffix.candidates)
    event = ev.RetrievalEvent.FromString(m.retrieval_event(planned, 5, 6).SerializeToString())
    assert event.schema_version == 1
    assert event.prefix_len == planned.prefix_len
    assert event.prefix_len == len(event.prefix.profile_le) // 8 + len(event.prefix.long_term.items_le) // 8
    assert (event.request_id, event.user_id) == (planned.request_id, planned.user_id)


def test_a_lead_in_is_planned_before_the_measured_window_and_marked():
    base = WorkloadConfig(seed=4, duration_s=10.0, rate_rps=50.0, fixed_prefix_len=512)
    cold = generate(base)
    warm = generate(dataclasses.replace(base, lead_in_s=20.0))
    assert not any(r.lead_in for r in cold.requests)
    assert cold.measured == cold.requests
    lead = [r for r in warm.requests if r.lead_in]
    measured = warm.measured
    assert lead
    assert measured
    assert all(r.t_retrieval_s < 20.0 for r in lead)
    assert all(20.0 <= r.t_retrieval_s < 30.0 for r in measured)
    assert warm.describe()["requests"] == len(measured)
    assert warm.describe()["lead_in_requests"] == len(lead)

    # The window meets users returning from sessions begun before it: a cold 10 s plan has about
    # a third of its requests returning, a warm one over half (the session model: 2/3 at most).
    def returning(reqs: list) -> float:
        return sum(r.returning for r in reqs) / len(reqs)

    assert returning(cold.requests) < 0.4
    assert 0.5 < returning(measured) < 0.7


def test_the_measured_window_is_offered_the_planned_rate_whatever_the_lead_in():
    for lead_in in (0.0, 10.0, 20.0):
        rates = [
            len(generate(WorkloadConfig(seed=s, duration_s=10.0, rate_rps=50.0, lead_in_s=lead_in)).measured)
            / 10.0
            for s in range(20)
        ]
        assert sum(rates) / len(rates) == pytest.approx(50.0, rel=0.05), lead_in


def test_describe_states_the_workload(long_workload):
    d = long_workload.describe()
    for key in ("requests", "realized_rps", "returning_fraction", "prefix_len_p50", "prefix_len_p90",
                "prefix_len_p99", "prefix_len_max", "distinct_users", "gap_ms_p50", "gap_ms_p99",
                "think_s_p50", "think_s_p90", "think_s_p99"):  # fmt: skip
        assert key in d, key
    assert d["requests"] == len(long_workload)
    assert d["prefix_len_p50"] <= d["prefix_len_p90"] <= d["prefix_len_p99"] <= d["prefix_len_max"]
    assert d["prefix_len_max"] <= LONG.max_prefix_len


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="lead_in_s"):
        WorkloadConfig(lead_in_s=-1.0)
    with pytest.raises(ValueError, match="lead_in_s"):
        WorkloadConfig(lead_in_s=float("nan"))
    with pytest.raises(ValueError, match="fixed_prefix_len"):
        WorkloadConfig(fixed_prefix_len=4)
    with pytest.raises(ValueError, match="session_mean_requests"):
        WorkloadConfig(session_mean_requests=0.5)
    with pytest.raises(ValueError, match="arrivals"):
        WorkloadConfig(arrivals="uniform")  # type: ignore[arg-type]


def test_a_length_histogram_draws_each_users_length_from_its_bins_by_weight():
    config = WorkloadConfig(users=40_000, length_histogram=((1024, 1.0), (4096, 0.0), (16384, 3.0)))
    lengths = user_prefix_lengths(config)
    assert lengths.min() >= config.profile_tokens + 1
    assert lengths.max() <= 16384
    low = np.mean(lengths <= 1024)
    assert low == pytest.approx(0.25, abs=0.01)  # weight 1 of 4
    assert not np.any((lengths > 1024) & (lengths <= 4096))  # weight 0: nobody there
    assert np.mean(lengths > 4096) == pytest.approx(0.75, abs=0.01)
    # Uniform within a bin: the upper bin's users spread over (4096, 16384].
    upper = lengths[lengths > 4096]
    assert np.median(upper) == pytest.approx((4096 + 16384) / 2, rel=0.03)
    assert np.array_equal(lengths, user_prefix_lengths(config))  # a function of the seed
    one = user_prefix_lengths(WorkloadConfig(users=1000, length_histogram=((64, 1.0),)))
    assert one.min() >= 9
    assert one.max() <= 64


def test_bad_length_histograms_are_refused():
    with pytest.raises(ValueError, match="upper lengths must increase"):
        WorkloadConfig(length_histogram=((4096, 1.0), (1024, 1.0)))
    with pytest.raises(ValueError, match="must exceed profile_tokens"):
        WorkloadConfig(length_histogram=((8, 1.0),))
    with pytest.raises(ValueError, match="not all 0"):
        WorkloadConfig(length_histogram=((1024, 0.0),))
    with pytest.raises(ValueError, match="not all 0"):
        WorkloadConfig(length_histogram=((1024, float("nan")),))
    with pytest.raises(ValueError, match="two length models"):
        WorkloadConfig(fixed_prefix_len=4096, length_histogram=((1024, 1.0),))


def test_a_length_histogram_file_is_read_with_its_header_and_comments(tmp_path):
    good = tmp_path / "lengths.csv"
    good.write_text("upper_length,weight\n# from our own logs\n1024, 50\n\n4096,30  # the body\n16384,20\n")
    assert read_length_histogram(good) == ((1024, 50.0), (4096, 30.0), (16384, 20.0))
    for text, message in (("1024\n", "expected 'upper_length,weight'"), ("1024,x\n", ":1: expected"),
                          ("a,b\n1024,1\n2048,y\n", ":3: expected"), ("# nothing\n", "no 'upper_length,weight'"),
                          ("4096,1\n1024,1\n", "must increase"), ("1024,-1\n", "weights must be")):  # fmt: skip
        bad = tmp_path / "bad.csv"
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_length_histogram(bad)
    with pytest.raises(ValueError, match="cannot read the length histogram"):
        read_length_histogram(tmp_path / "missing.csv")
