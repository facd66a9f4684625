"""The take-over pass choice (services/ranker/takeover.py): the eager partial pass until partial
passes measure dearer than full rankings of their calls, then the full graph, but for a sample
that keeps the ratio measured; never the graph under the `partial` policy."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from services.ranker.config import RankerConfig
from services.ranker.takeover import TakeoverPass, TakeoverPassCollector, TakeoverPolicy
from shared.config import ConfigError, load_config


def choices(t: TakeoverPass, n: int) -> list[bool]:
    out = []
    for _ in range(n):
        full = t.wants_full()
        t.ran(full)
        out.append(full)
    return out


def test_partial_until_a_partial_pass_is_measured():
    t = TakeoverPass()
    assert math.isnan(t.ratio)
    assert choices(t, 5) == [False] * 5
    assert t.passes == {"partial": 5, "full": 0}


def test_partial_while_partial_passes_measure_cheaper():
    t = TakeoverPass()
    t.observe(partial_s=0.012, full_s=0.0195)  # 16384 tokens on an H200 (k12b)
    assert t.ratio == pytest.approx(0.012 / 0.0195)
    assert not any(choices(t, 16))


def test_the_graph_while_partial_passes_measure_dearer_but_one_in_sample_every():
    t = TakeoverPass(sample_every=4)
    t.observe(partial_s=0.025, full_s=0.011)  # 11.8k tokens on the mix (k13a)
    assert choices(t, 8) == [True, True, True, False, True, True, True, False]
    assert t.passes == {"partial": 2, "full": 6}


def test_the_ratio_follows_recent_passes():
    t = TakeoverPass(memory=2.0)
    t.observe(0.03, 0.01)
    assert t.ratio > 1
    for _ in range(8):
        t.observe(0.005, 0.01)
    assert t.ratio < 1  # the dear pass has faded
    assert not t.wants_full()


def test_unusable_measurements_are_ignored():
    t = TakeoverPass()
    for partial_s, full_s in ((0.0, 0.01), (0.01, 0.0), (math.nan, 0.01), (0.01, math.inf), (-1.0, 0.01)):
        t.observe(partial_s, full_s)
    assert math.isnan(t.ratio)


def test_the_partial_policy_never_replays_the_graph():
    t = TakeoverPass(TakeoverPolicy.PARTIAL)
    t.observe(0.03, 0.01)
    assert not any(choices(t, 16))


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="sample_every"):
        TakeoverPass(sample_every=0)
    with pytest.raises(ValueError, match="memory"):
        TakeoverPass(memory=0.5)


def test_the_collector_exports_passes_and_the_ratio():
    t = TakeoverPass(sample_every=2)
    registry = CollectorRegistry()
    registry.register(TakeoverPassCollector(t))
    assert math.isnan(registry.get_sample_value("relaygr_ranker_partial_cost_ratio"))
    t.observe(0.02, 0.01)
    choices(t, 4)
    assert registry.get_sample_value("relaygr_ranker_partial_cost_ratio") == pytest.approx(2.0)
    assert registry.get_sample_value("relaygr_ranker_takeover_passes_total", {"pass": "full"}) == 2
    assert registry.get_sample_value("relaygr_ranker_takeover_passes_total", {"pass": "partial"}) == 2


def test_the_setting_takes_either_policy_and_refuses_others():
    assert load_config(RankerConfig, ["--device", "cpu"], env={}).takeover_pass is TakeoverPolicy.MEASURED
    env = {"RELAYGR_RANKER_TAKEOVER_PASS": "partial"}
    assert load_config(RankerConfig, ["--device", "cpu"], env=env).takeover_pass is TakeoverPolicy.PARTIAL
    with pytest.raises(ConfigError, match="takeover"):
        load_config(RankerConfig, ["--device", "cpu", "--takeover-pass", "graph"], env={})
