"""Every benchmark configuration (relaygr.harness.CONFIGS) makes a stack, in the benchmarks and
in the demo, with its own settings on top of the run's."""

from __future__ import annotations

import pytest

from bench import goodput, relay
from relaygr import demo
from relaygr.harness import CONFIGS, _admissions, _event_loops, ranker_latency_target_ms, ranker_slo_ms
from relaygr.launcher import StackConfig
from services.ranker.config import RankerConfig
from services.trigger.config import TriggerConfig
from shared.config import load_config


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_configuration_makes_a_stack(name):
    args = goodput.parse_args(["--configs", name, "--arena-gb", "2"])
    bench_stack = relay.stack_config(name, args)
    demo_stack = demo.stack_config(demo.DemoConfig(), name, 50.0)
    for stack in (bench_stack, demo_stack):
        assert stack.arena_bytes % 4096 == 0
        own = tuple(CONFIGS[name].get("trigger_args", ()))
        assert stack.trigger_args[len(stack.trigger_args) - len(own) :] == own  # after the run's
    want_gb = CONFIGS[name].get("arena_gb", 2.0)
    assert bench_stack.arena_bytes == int(want_gb * 2**30) // 4096 * 4096
    # Its rankers' and trigger's own flags parse: a misspelt one would first fail on a GPU lease.
    load_config(RankerConfig, ["--device", "cpu", *CONFIGS[name].get("ranker_args", ())], env={})
    trigger_env = {"RELAYGR_RANKERS": "127.0.0.1:50051"}
    load_config(TriggerConfig, list(CONFIGS[name].get("trigger_args", ())), env=trigger_env)


def test_a_configuration_that_fixes_its_arena_overrides_the_runs():
    args = goodput.parse_args(["--configs", "relay,relay-arena24", "--arena-gb", "80"])
    assert relay.stack_config("relay", args).arena_bytes == 80 * 2**30
    assert relay.stack_config("relay-arena24", args).arena_bytes == 24 * 2**30


def test_rankers_schedule_by_half_the_slo_unless_a_configuration_says_otherwise():
    # What the launcher passes (--latency-target-ms SLO/2) and the goodput records carry, so that
    # the capacity model orders calls as the rankers did.
    assert ranker_latency_target_ms("relay-nospare", 50.0) == 25.0
    assert ranker_latency_target_ms("baseline", 300.0) == 150.0
    assert ranker_latency_target_ms("relay-nospare-far", 50.0) == 0.0
    assert ranker_latency_target_ms("relay-nospare-target25", 300.0) == 25.0
    assert ranker_latency_target_ms("not-a-configuration", 40.0) == 20.0


def test_rankers_hold_calls_doomed_past_the_slo_unless_a_configuration_says_otherwise():
    assert ranker_slo_ms("relay", 50.0) == 50.0
    assert ranker_slo_ms("baseline", 300.0) == 300.0
    # The -edf configurations know no SLO: earliest deadline first whatever the load.
    assert ranker_slo_ms("baseline-edf", 50.0) == ranker_slo_ms("relay-edf", 50.0) == 0.0
    assert CONFIGS["relay-edf"].get("trigger_args") == CONFIGS["relay"].get("trigger_args")


def test_two_processes_per_gpu_split_each_gpu_s_hbm_budget():
    args = goodput.parse_args(["--configs", "relay-nospare-2p", "--rankers", "2", "--device", "cuda",
                               "--hbm-budget-mb", "60000"])  # fmt: skip
    stack = relay.stack_config("relay-nospare-2p", args)
    assert (stack.rankers, stack.rankers_per_device, stack.hbm_budget_mb) == (4, 2, 30000.0)
    assert [stack.device_index(i) for i in range(stack.rankers)] == [0, 0, 1, 1]
    assert stack.trigger_args[-2:] == ("--spare-busy-max", "0")  # relay-nospare's own, kept
    single = relay.stack_config("relay-nospare", args)
    assert (single.rankers, single.rankers_per_device, single.hbm_budget_mb) == (2, 1, 60000.0)
    assert [single.device_index(i) for i in range(single.rankers)] == [0, 1]


def test_a_stack_refuses_fewer_than_one_ranker_per_device():
    with pytest.raises(ValueError, match="rankers_per_device must be >= 1"):
        StackConfig(rankers_per_device=0).validate()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--client-processes", "0"], "--client-processes must be in"),
        (["--client-processes", "65"], "--client-processes must be in"),
        (["--client-lag-bound-ms", "0"], "--client-lag-bound-ms must be > 0"),
        (["--client-lag-bound-ms", "nan"], "--client-lag-bound-ms must be > 0"),
    ],
)
def test_the_load_generators_flags_are_checked_at_start(flags, message, capsys):
    with pytest.raises(SystemExit):
        goodput.parse_args(flags)
    assert message in capsys.readouterr().err


def test_the_load_generator_is_this_process_unless_asked_for_more():
    args = goodput.parse_args([])
    assert (args.client_processes, args.client_lag_bound_ms) == (1, 10.0)
    with goodput.load_generator(1) as load:
        assert load is None


def test_the_progress_line_prices_a_pre_inference_by_the_psi_it_built():
    # 0.1 s of pre-inference for 12 psi produced, 2 of them reloads: 10 ms a pre-inference.
    rankers = {"trigger_admitted": 10.0, "trigger_admitted_risk": 4.0, "psi_produced": 12.0,
               "reloads": 2.0, "device_preinfer_s": 0.1}  # fmt: skip
    assert "pre-inference 10.0 ms/psi" in _admissions(rankers)
    assert "pre-inference" not in _admissions({**rankers, "device_preinfer_s": 0.0})
    assert "pre-inference" not in _admissions({**rankers, "psi_produced": 2.0})  # reloads only
    # Its steps by kind, with the ranking calls they held and for how long.
    steps = {**rankers, "preinfer_eager_steps": 2.0, "preinfer_eager_seconds": 0.02, "preinfer_eager_prefixes": 2.0,
             "preinfer_eager_held_calls": 5.0, "preinfer_eager_held_s": 0.031}  # fmt: skip
    assert "eager 2 (10.0 ms, 1.0 prefixes, 0 over 10 ms, 5 calls held 31 ms)" in _admissions(steps)


def test_the_progress_line_splits_the_triggers_event_lag_at_the_brokers_ack():
    rankers = {
        "trigger_event_lags": 100.0,
        "trigger_event_lag_ms_sum": 3500.0,
        "trigger_event_lags_over_20ms": 40.0,
    }
    assert "event lag 35.0 ms mean (40 over 20 ms)" in _admissions(rankers)
    acks = {"publish_ack_ms_p50": 3.25, "publish_ack_ms_p99": 9.5}
    assert "event lag 35.0 ms mean (40 over 20 ms; acked p50 3.2 p99 9.5)" in _admissions(rankers, acks)
    nan = {"publish_ack_ms_p50": float("nan"), "publish_ack_ms_p99": float("nan")}  # none acked
    assert "event lag 35.0 ms mean (40 over 20 ms)" in _admissions(rankers, nan)


def test_the_progress_line_shows_each_rankers_event_loop_and_what_was_shed():
    rankers = {
        "cpu_main_thread_ranker_1": 0.29,
        "cpu_main_thread_ranker_0": 0.31,
        "cpu_main_thread_router": 0.2,
    }
    assert _event_loops(rankers) == "  event loop (cores): ranker_0 0.31, ranker_1 0.29"
    shed = {**rankers, "ranking_psi_shed": 12.0, "demotions_shed": 0.0}
    assert _event_loops(shed).endswith("; shed 12 keeps, 0 copies")
    assert _event_loops({}) == ""  # a file from before: nothing


@pytest.mark.parametrize("name", sorted(n for n in CONFIGS if CONFIGS[n].get("ranker_args")))
def test_every_configurations_ranker_flags_are_ranker_settings(name):
    """A configuration's own ranker flags load as the ranker's settings (a misspelt flag or value
    would otherwise surface only as a ranker that does not start on the GPU)."""
    load_config(RankerConfig, ["--device", "cpu", *CONFIGS[name]["ranker_args"]], env={})


@pytest.mark.parametrize("name", sorted(n for n in CONFIGS if CONFIGS[n].get("trigger_args")))
def test_every_configurations_trigger_flags_are_trigger_settings(name):
    """The same for a configuration's own trigger flags."""
    load_config(TriggerConfig, ["--rankers", "127.0.0.1:1", *CONFIGS[name]["trigger_args"]], env={})
