"""Every benchmark configuration (relaygr.harness.CONFIGS) makes a stack, in the benchmarks and
in the demo, with its own settings on top of the run's."""

from __future__ import annotations

import pytest

from bench import goodput, relay
from relaygr import demo
from relaygr.harness import CONFIGS, ranker_latency_target_ms


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
