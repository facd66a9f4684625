"""One settings scheme across the services (shared/config.py states the rule): own settings are
RELAYGR_<SERVICE>_*, settings two services agree on are one variable read by both, modes are enums
with their choices in the error and in --help, and an old variable that is set stops start-up
naming its replacement."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from services.expander.config import ExpanderConfig
from services.ranker.config import BatchCopies, Device, HostPsiFormat, RankerConfig
from services.router.config import FrontDoor, Placement, RouterConfig
from services.trigger.admission import Policy
from services.trigger.config import TriggerConfig
from shared.config import ConfigError, describe, load_config
from shared.settings import LogLevel

CONFIGS: dict[str, type] = {
    "ranker": RankerConfig,
    "router": RouterConfig,
    "trigger": TriggerConfig,
    "expander": ExpanderConfig,
}
# Minimal argv for each config to load (the router and the trigger need their rankers).
ARGV: dict[str, list[str]] = {"router": ["--rankers", "r:1"], "trigger": ["--rankers", "r:1"]}
# Variables defined once in shared/settings.py (or shared client groups) and read by several services.
SHARED_PREFIXES = ("RELAYGR_KAFKA_", "RELAYGR_TLS_", "RELAYGR_MODEL_")
SHARED = {
    "RELAYGR_EXPANDER_SOCKET_PATH", "RELAYGR_DEFAULT_LEASE_MS", "RELAYGR_MAX_LEASE_MS",
    "RELAYGR_RETRIEVAL_TOPIC", "RELAYGR_SIGNAL_TOPIC", "RELAYGR_DLQ_TOPIC", "RELAYGR_TOPIC_PARTITIONS",
    "RELAYGR_MAX_PREFIX_TOKENS", "RELAYGR_LOAD_FACTOR", "RELAYGR_LOAD_SLACK", "RELAYGR_RANKERS",
}  # fmt: skip
UNIT = re.compile(r"_(MS|S|US|BYTES|MB)$")


def _fields(cls: type) -> dict[str, dataclasses.Field]:  # type: ignore[type-arg]
    return {f.metadata["env"]: f for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("service", CONFIGS)
def test_every_variable_follows_the_naming_rule(service):
    own = f"RELAYGR_{service.upper()}_"
    for env in _fields(CONFIGS[service]):
        assert env.startswith(own) or env.startswith(SHARED_PREFIXES) or env in SHARED, (
            f"{service}: {env} is neither RELAYGR_{service.upper()}_* nor a shared setting"
        )


@pytest.mark.parametrize("service", CONFIGS)
def test_quantities_carry_their_unit(service):
    for name, f in {f.name: f for f in dataclasses.fields(CONFIGS[service])}.items():
        if re.search(r"_(ms|s|us|bytes|mb)$", name):
            assert UNIT.search(f.metadata["env"]), f"{service}.{name}: {f.metadata['env']} lacks the unit"


def test_settings_two_services_agree_on_are_one_definition():
    """The same variable in two configs has the same default, help and check: one definition."""
    seen: dict[str, tuple[str, dataclasses.Field]] = {}  # type: ignore[type-arg]
    for service, cls in CONFIGS.items():
        for env, f in _fields(cls).items():
            if env in SHARED and env in seen:
                other, g = seen[env]
                assert (f.default, f.metadata["help"], f.metadata["check"]) == (
                    g.default, g.metadata["help"], g.metadata["check"],
                ) or env == "RELAYGR_RANKERS", f"{env}: {service} and {other} define it differently"  # fmt: skip
            seen.setdefault(env, (service, f))
    # The pairs that used to drift: the expander's socket, the default lease, the prefix limit.
    assert _fields(RankerConfig)["RELAYGR_EXPANDER_SOCKET_PATH"].default == ExpanderConfig().socket_path
    assert (
        load_config(RankerConfig, [], {}).default_lease_ms
        == load_config(RouterConfig, ARGV["router"], {}).default_lease_ms
    )
    assert (
        load_config(ExpanderConfig, [], {}).max_lease_s * 1e3
        == load_config(RankerConfig, [], {}).max_lease_ms
    )


def test_one_variable_sets_a_shared_setting_in_every_service():
    env = {"RELAYGR_DEFAULT_LEASE_MS": "1500", "RELAYGR_MAX_LEASE_MS": "9000"}
    assert load_config(RankerConfig, [], env).default_lease_ms == 1500.0
    assert load_config(RouterConfig, ARGV["router"], env).default_lease_ms == 1500.0
    assert load_config(ExpanderConfig, [], env).max_lease_s == 9.0
    assert load_config(TriggerConfig, ARGV["trigger"], env).max_lease_ms == 9000.0


@pytest.mark.parametrize(
    ("cls", "argv", "field", "value", "expected"),
    [
        (RankerConfig, ["--device", "cpu"], "device", Device.CPU, "auto, cpu, cuda, npu"),
        (RankerConfig, ["--batch-copies", "kernel"], "batch_copies", BatchCopies.KERNEL,
         "engine, scores_aside, kernel"),
        (RankerConfig, ["--host-psi-format", "fp8"], "host_psi_format", HostPsiFormat.FP8, "native, fp8"),
        (RouterConfig, [*ARGV["router"], "--placement", "round_robin"], "placement", Placement.ROUND_ROBIN,
         "affinity, round_robin"),
        (RouterConfig, [*ARGV["router"], "--front-door", "grpc"], "front_door", FrontDoor.GRPC, "relay, grpc"),
        (TriggerConfig, [*ARGV["trigger"], "--policy", "off"], "policy", Policy.OFF, "sequence, all, off"),
        (ExpanderConfig, ["--log-level", "debug"], "log_level", LogLevel.DEBUG, "debug, info, warning, error"),
    ],
)  # fmt: skip
def test_modes_are_enums_that_list_their_choices(cls, argv, field, value, expected):
    assert getattr(load_config(cls, argv, {}), field) is value
    bad = [*argv[:-1], "bogus"]
    with pytest.raises(ConfigError, match=re.escape(f"'bogus': must be one of {expected}")):
        load_config(cls, bad, {})


@pytest.mark.parametrize(
    ("cls", "old", "new"),
    [
        (RankerConfig, "RELAYGR_EXPANDER_SOCKET", "RELAYGR_EXPANDER_SOCKET_PATH"),
        (RankerConfig, "RELAYGR_LEASE_MS", "RELAYGR_DEFAULT_LEASE_MS"),
        (RankerConfig, "RELAYGR_LOG_LEVEL", "RELAYGR_RANKER_LOG_LEVEL"),
        (RankerConfig, "RELAYGR_MAX_BATCH", "RELAYGR_RANKER_MAX_BATCH"),
        (RankerConfig, "RELAYGR_RANKER_SCORES_ASIDE", "RELAYGR_RANKER_BATCH_COPIES"),
        (RouterConfig, "RELAYGR_ROUTER_DEFAULT_LEASE_MS", "RELAYGR_DEFAULT_LEASE_MS"),
        (ExpanderConfig, "RELAYGR_EXPANDER_MAX_LEASE_S", "RELAYGR_MAX_LEASE_MS"),
        (TriggerConfig, "RELAYGR_SLO_MS", "RELAYGR_TRIGGER_SLO_MS"),
        (TriggerConfig, "RELAYGR_LOG_LEVEL", "RELAYGR_TRIGGER_LOG_LEVEL"),
    ],
)
def test_an_old_variable_that_is_set_stops_start_up_naming_the_new_one(cls, old, new):
    argv = ARGV.get({v: k for k, v in CONFIGS.items()}[cls], [])
    with pytest.raises(ConfigError, match=f"{old} is no longer read: set {new} instead"):
        load_config(cls, argv, {old: "1"})


def test_describe_and_help_list_every_setting_with_its_variable():
    for cls in CONFIGS.values():
        for flag, env, _default, _help in describe(cls):
            assert flag.startswith("--")
            assert env.startswith("RELAYGR_")
    out = subprocess.run([sys.executable, "-m", "services.trigger", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout  # fmt: skip
    flat = " ".join(out.split())
    for flag, env, _default, _help in describe(TriggerConfig):
        assert flag in flat
        assert f"env {env}" in flat
    assert "one of sequence | all | off; default 'sequence'" in flat
