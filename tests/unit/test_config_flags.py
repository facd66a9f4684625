"""shared.config.load_config: flags are taken whole, never by a prefix of their name."""

from __future__ import annotations

import importlib

import pytest

from services.ranker.config import RankerConfig
from shared.config import ConfigError, load_config


def test_a_prefix_of_a_flag_is_refused_not_matched() -> None:
    # `--expander-socket` once matched `--expander-socket-path` by abbreviation, and a ranker given
    # the old flag silently ran without its host tier.
    with pytest.raises(ConfigError, match="expander-socket"):
        load_config(RankerConfig, ["--device", "cpu", "--expander-socket", "/tmp/x.sock"], env={})


def test_the_whole_flag_is_taken() -> None:
    config = load_config(RankerConfig, ["--device", "cpu", "--expander-socket-path", "/tmp/x.sock"], env={})
    assert config.expander_socket_path == "/tmp/x.sock"


def test_the_copy_piece_size_is_read_in_mib_and_a_negative_one_refused() -> None:
    config = load_config(RankerConfig, ["--device", "cpu", "--copy-piece-mb", "0.5"], env={})
    assert config.copy_piece_bytes == 512 * 1024
    assert load_config(RankerConfig, ["--device", "cpu"], env={}).copy_piece_bytes == 0  # whole copies
    with pytest.raises(ConfigError, match=r"copy_piece_mb .* must be >= 0"):
        load_config(RankerConfig, ["--device", "cpu", "--copy-piece-mb", "-1"], env={})


def test_the_interpreter_settings_default_short_and_refuse_bad_values() -> None:
    config = load_config(RankerConfig, ["--device", "cpu"], env={})
    assert config.gil_switch_ms == 0.05
    assert config.timer_slack_us == 1.0
    env = load_config(RankerConfig, ["--device", "cpu"], env={"RELAYGR_RANKER_TIMER_SLACK_US": "0"})
    assert env.timer_slack_us == 0.0  # the kernel's default kept
    with pytest.raises(ConfigError, match=r"timer_slack_us .* must be >= 0"):
        load_config(RankerConfig, ["--device", "cpu", "--timer-slack-us", "-5"], env={})
    with pytest.raises(ConfigError, match="gil_switch_ms"):
        load_config(RankerConfig, ["--device", "cpu", "--gil-switch-ms", "0"], env={})


@pytest.mark.parametrize(
    ("setting", "flag", "env_name", "scheduler_field"),
    [
        (
            "first_chunk_absorbs",
            "--first-chunk-absorbs",
            "RELAYGR_RANKER_FIRST_CHUNK_ABSORBS",
            "first_chunk_absorbs",
        ),
        (
            "step_budget_by_kind",
            "--step-budget-by-kind",
            "RELAYGR_RANKER_STEP_BUDGET_BY_KIND",
            "budget_by_kind",
        ),
    ],
)
def test_the_schedulers_unmeasured_rules_are_off_by_default_and_reach_the_rankers_scheduler(
    setting: str, flag: str, env_name: str, scheduler_field: str
) -> None:
    from services.ranker.service import RankerService

    assert not getattr(load_config(RankerConfig, ["--device", "cpu"], env={}), setting)
    config = load_config(RankerConfig, ["--device", "cpu", flag, "true"], env={})
    assert getattr(RankerService(config).engine.scheduler.config, scheduler_field)
    assert getattr(load_config(RankerConfig, ["--device", "cpu"], env={env_name: "1"}), setting)
    with pytest.raises(ConfigError):
        load_config(RankerConfig, ["--device", "cpu", flag, "sometimes"], env={})


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("services.ranker.config", "RankerConfig"),
        ("services.router.config", "RouterConfig"),
        ("services.trigger.config", "TriggerConfig"),
        ("services.expander.config", "ExpanderConfig"),
    ],
)
def test_every_service_prints_its_help(module: str, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    # A literal "%" in a setting's help ("5-7% of the scores' spread") made the ranker's --help
    # raise a TypeError inside argparse instead of printing.
    cls = getattr(importlib.import_module(module), name)
    with pytest.raises(SystemExit) as exited:
        load_config(cls, ["--help"], env={})
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "(env RELAYGR_" in out
    if name == "RankerConfig":
        assert "5-7% of" in out  # printed as written


def test_full_batch_graphs_are_refused_past_the_full_graphs_limit() -> None:
    config = load_config(RankerConfig, ["--device", "cpu", "--graph-full-batch-tokens", "2048"], env={})
    assert config.graph_full_batch_tokens == 2048
    with pytest.raises(ConfigError, match="RELAYGR_RANKER_GRAPH_FULL_BATCH_TOKENS must not exceed"):
        load_config(
            RankerConfig,
            ["--device", "cpu", "--graph-full-batch-tokens", "4096", "--graph-max-full-tokens", "2048"],
            env={},
        )
    with pytest.raises(ConfigError, match="graph_full_batch_tokens"):
        load_config(RankerConfig, ["--device", "cpu", "--graph-full-batch-tokens", "-1"], env={})
