"""Every benchmark configuration (relaygr.harness.CONFIGS) makes a stack, in the benchmarks and
in the demo, with its own settings on top of the run's."""

from __future__ import annotations

import pytest

from bench import goodput, relay
from relaygr import demo
from relaygr.harness import CONFIGS


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
