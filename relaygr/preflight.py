"""Checks a stack's settings before anything starts: every service's config, built as it will be.

`relaygr up` and `relaygr demo` start a broker, an expander, rankers, a router and a trigger, each
reading its own flags and the RELAYGR_* environment. A value that one of them rejects used to
surface only once the processes before it were up (or as an AssertionError from the launcher).
`check_stack` builds each service's config class from the same flags the launcher passes and the
environment the children inherit, so a bad value (a flag or an env var) fails before any process
starts, with the service's own message: the rules live in the config classes, not here.

Placeholders stand in for what exists only once the stack runs (ranker ports, the embedded
broker's address, the launcher's run directory); they are well-formed, so they never hide a
problem of the caller's values.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from relaygr.launcher import DLQ_TOPIC, RETRIEVAL_TOPIC, SIGNAL_TOPIC, StackConfig
from services.expander.config import ExpanderConfig
from services.ranker.config import RankerConfig
from services.router.config import RouterConfig
from services.trigger.config import TriggerConfig
from shared.config import ConfigError, load_config

# Mirrors relaygr.launcher (Stack._run_dir = mkdtemp(prefix="relaygr-"),
# whose random part is 8 characters): the expander's socket path must fit a unix socket address.
_RUN_DIR_NAME = "relaygr-xxxxxxxx"
_PLACEHOLDER_BOOTSTRAP = "127.0.0.1:9092"


@dataclass(frozen=True)
class ServiceConfigs:
    """What each service of a stack will run with (ranker i is rankers[i])."""

    rankers: tuple[RankerConfig, ...]
    router: RouterConfig
    trigger: TriggerConfig
    expander: ExpanderConfig | None


def one_line(exc: BaseException) -> str:
    """An error's message on one line ("invalid X:\\n  a\\n  b" -> "invalid X: a; b")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    head, rest = lines[0], lines[1:]
    return f"{head} {'; '.join(rest)}" if rest and head.endswith(":") else "; ".join(lines)


def service_configs(config: StackConfig, env: Mapping[str, str] | None = None) -> ServiceConfigs:
    """Builds every service's config from the flags the launcher passes (relaygr/launcher.py,
    Stack.start) and `env` over os.environ plus config.env (what the children inherit).
    Raises ConfigError naming the service and the setting."""
    environ = {**(os.environ if env is None else env), **config.env}
    run_dir = os.path.join(tempfile.gettempdir(), _RUN_DIR_NAME)
    socket_path = os.path.join(run_dir, "expander.sock")
    expander = None
    if config.expander:
        expander = load_config(ExpanderConfig, ["--socket-path", socket_path, "--arena-bytes",
                                                str(config.arena_bytes)], environ)  # fmt: skip
    rankers = []
    for i in range(config.rankers):
        argv = ["--device", config.device, "--device-index", str(i if config.device == "cuda" else 0),
                "--preset", config.preset, "--hbm-budget-mb", str(config.hbm_budget_mb), *config.ranker_args]  # fmt: skip
        if config.expander:
            argv += ["--host-tier", "true", "--expander-socket-path", socket_path]
        rankers.append(load_config(RankerConfig, argv, environ))
    targets = ",".join(f"127.0.0.1:{50051 + i}" for i in range(config.rankers))
    common = ["--bootstrap", config.kafka_bootstrap or _PLACEHOLDER_BOOTSTRAP, "--rankers", targets,
              "--signal-topic", SIGNAL_TOPIC, "--dlq-topic", DLQ_TOPIC, "--topic-partitions", str(config.partitions)]  # fmt: skip
    router = load_config(
        RouterConfig, [*common, "--placement", config.placement, *config.router_args], environ
    )
    trigger = load_config(TriggerConfig, [*common, "--retrieval-topic", RETRIEVAL_TOPIC, "--policy",
                                          config.trigger_policy, "--slo-ms", str(config.slo_ms), "--preset",
                                          config.preset, *config.trigger_args], environ)  # fmt: skip
    return ServiceConfigs(tuple(rankers), router, trigger, expander)


def check_devices(device: str, count: int, per_device: int = 1) -> None:
    """With device "cuda", ranker i runs on GPU i // per_device: the GPUs `count` rankers need
    must be visible. Imports torch only then (a second or two). Raises ConfigError."""
    if device != "cuda":
        return
    from kernels.device import visible_devices

    needed = -(-count // per_device)
    visible = visible_devices("cuda")
    if visible < needed:
        layout = "GPU i" if per_device == 1 else f"GPU i // {per_device}"
        raise ConfigError(
            f"--device cuda runs ranker i on {layout}: {count} ranker(s) need {needed} GPU(s), torch sees {visible}"
        )


def check_stack(config: StackConfig, env: Mapping[str, str] | None = None) -> ServiceConfigs:
    """Everything `Stack(config).start()` would reject, checked without starting anything: the
    stack's own rules, every service's config, the devices. Raises ConfigError (use one_line)."""
    try:
        config.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    configs = service_configs(config, env)
    check_devices(config.device, config.rankers, config.rankers_per_device)
    return configs
