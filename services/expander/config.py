"""ExpanderConfig: the daemon's settings (flags over RELAYGR_EXPANDER_* env vars over defaults).

The socket path and the longest lease are shared settings (shared/settings.py): the rankers read
the same RELAYGR_EXPANDER_SOCKET_PATH to connect, and RELAYGR_MAX_LEASE_MS bounds leases everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared import settings
from shared.config import ConfigError, port_number, positive, setting
from shared.settings import LogLevel, socket_path_problem

PAGE = 4096


def _arena_bytes(value: int) -> str | None:
    if value <= 0 or value % PAGE:
        return f"must be > 0 and a multiple of {PAGE}"
    return None


@dataclass(frozen=True)
class ExpanderConfig:
    socket_path: str = settings.expander_socket_path()
    arena_bytes: int = setting(
        1 << 30, env="RELAYGR_EXPANDER_ARENA_BYTES", help="host DRAM arena size in bytes", check=_arena_bytes
    )
    ttl_s: float = setting(
        30.0, env="RELAYGR_EXPANDER_TTL_S", help="idle lifetime of an unpinned psi entry", check=positive
    )
    max_lease_ms: float = settings.max_lease_ms(renamed_from="RELAYGR_EXPANDER_MAX_LEASE_S")
    metrics_port: int = setting(
        0, env="RELAYGR_EXPANDER_METRICS_PORT", help="Prometheus /metrics port on 127.0.0.1 (0 picks one)",
        check=port_number,
    )  # fmt: skip
    log_level: LogLevel = settings.log_level("expander")

    def __post_init__(self) -> None:
        self.validate()  # direct construction gets the same checks as load_config

    def validate(self) -> None:
        """Cross-field checks (load_config calls it). Raises ConfigError."""
        checks: list[tuple[Callable[[Any], str | None], Any, str]] = [
            (socket_path_problem, self.socket_path, "socket_path"),
            (_arena_bytes, self.arena_bytes, "arena_bytes"),
            (positive, self.ttl_s, "ttl_s"),
            (positive, self.max_lease_ms, "max_lease_ms"),
            (port_number, self.metrics_port, "metrics_port"),
        ]
        for check, value, name in checks:
            problem = check(value)
            if problem:
                raise ConfigError(f"invalid ExpanderConfig: {name} = {value!r}: {problem}")

    @property
    def max_lease_s(self) -> float:
        """The longest write/read lease a client may ask for, in the store's unit."""
        return self.max_lease_ms / 1e3

    @property
    def fd_socket_path(self) -> str:
        return self.socket_path + ".fd"
