"""ExpanderConfig: the daemon's settings (flags over RELAYGR_EXPANDER_* env vars over defaults)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.config import ConfigError, one_of, port_number, positive, setting

PAGE = 4096
# sockaddr_un.sun_path holds 108 bytes including the NUL; the fd socket appends ".fd".
_MAX_SOCKET_PATH = 107 - len(".fd")


def _default_socket_path() -> str:
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/relaygr-{os.getuid()}", "expander.sock")


def _socket_path(value: str) -> str | None:
    if not os.path.isabs(value):
        return "must be an absolute path"
    if len(os.fsencode(value)) > _MAX_SOCKET_PATH:
        return f"must be at most {_MAX_SOCKET_PATH} bytes (unix socket path limit, with '.fd' appended)"
    return None


def _arena_bytes(value: int) -> str | None:
    if value <= 0 or value % PAGE:
        return f"must be > 0 and a multiple of {PAGE}"
    return None


@dataclass(frozen=True)
class ExpanderConfig:
    socket_path: str = setting(
        _default_socket_path(),
        env="RELAYGR_EXPANDER_SOCKET_PATH",
        help="control socket (the fd socket is this path + '.fd'); its directory is created 0700 if missing",
        check=_socket_path,
    )
    arena_bytes: int = setting(
        1 << 30, env="RELAYGR_EXPANDER_ARENA_BYTES", help="host DRAM arena size in bytes", check=_arena_bytes
    )
    ttl_s: float = setting(
        30.0, env="RELAYGR_EXPANDER_TTL_S", help="idle lifetime of an unpinned psi entry", check=positive
    )
    max_lease_s: float = setting(
        30.0,
        env="RELAYGR_EXPANDER_MAX_LEASE_S",
        help="longest write/read lease a client may ask for",
        check=positive,
    )
    metrics_port: int = setting(
        0, env="RELAYGR_EXPANDER_METRICS_PORT", help="Prometheus /metrics port on 127.0.0.1 (0 picks one)",
        check=port_number,
    )  # fmt: skip
    log_level: str = setting(
        "info",
        env="RELAYGR_EXPANDER_LOG_LEVEL",
        help="log level",
        check=one_of("debug", "info", "warning", "error"),
    )

    def __post_init__(self) -> None:
        self.validate()  # direct construction gets the same checks as load_config

    def validate(self) -> None:
        """Cross-field checks (load_config calls it). Raises ConfigError."""
        checks: list[tuple[Callable[[Any], str | None], Any, str]] = [
            (_socket_path, self.socket_path, "socket_path"),
            (_arena_bytes, self.arena_bytes, "arena_bytes"),
            (positive, self.ttl_s, "ttl_s"),
            (positive, self.max_lease_s, "max_lease_s"),
            (port_number, self.metrics_port, "metrics_port"),
        ]
        for check, value, name in checks:
            problem = check(value)
            if problem:
                raise ConfigError(f"invalid ExpanderConfig: {name} = {value!r}: {problem}")

    @property
    def fd_socket_path(self) -> str:
        return self.socket_path + ".fd"
