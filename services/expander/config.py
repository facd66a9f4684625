"""ExpanderConfig: the daemon's settings (flags over RELAYGR_EXPANDER_* env vars over defaults).

The socket path and the longest lease are shared settings (shared/settings.py): the rankers read
the same RELAYGR_EXPANDER_SOCKET_PATH to connect, and RELAYGR_MAX_LEASE_MS bounds leases everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared import settings
from shared.config import ConfigError, port_number, positive, setting
from shared.expander.presence import DEFAULT_SLOTS
from shared.settings import LogLevel, socket_path_problem

PAGE = 4096


# Left to the rest of the host (rankers, their pinned staging, the OS) whatever the fraction says.
MIN_HOST_HEADROOM_BYTES = 4 << 30


def _arena_bytes(value: int) -> str | None:
    if value < 0 or value % PAGE:
        return f"must be 0 (a fraction of the host's memory) or a positive multiple of {PAGE}"
    return None


def _presence_slots(value: int) -> str | None:
    if not 0 <= value <= 1 << 28:
        return "must be in [0, 2^28]"
    return None


def _arena_fraction(value: float) -> str | None:
    if not 0 < value <= 0.9:
        return "must be in (0, 0.9]"
    return None


def mem_available_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Memory available to a new workload here: the kernel's MemAvailable, capped by this
    cgroup's (v2) limit less its usage where one is set (in a container /proc/meminfo describes
    the whole host, and an arena sized from it would meet the container's OOM killer). None
    where neither can be read (not Linux)."""
    available = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        available = None
    try:
        with open(os.path.join(cgroup, "memory.max")) as f:
            limit = f.read().strip()
        with open(os.path.join(cgroup, "memory.current")) as f:
            used = int(f.read().strip())
    except (OSError, ValueError):
        return available
    if limit == "max":
        return available
    room = max(int(limit) - used, 0)
    return room if available is None else min(available, room)


@dataclass(frozen=True)
class ExpanderConfig:
    socket_path: str = settings.expander_socket_path()
    arena_bytes: int = setting(
        0, env="RELAYGR_EXPANDER_ARENA_BYTES",
        help="host DRAM arena size in bytes (0: RELAYGR_EXPANDER_ARENA_FRACTION of the memory available at "
        "start-up)", check=_arena_bytes,
    )  # fmt: skip
    arena_fraction: float = setting(
        0.5, env="RELAYGR_EXPANDER_ARENA_FRACTION",
        help="with no arena size given: this share of the host's available memory (MemAvailable), "
        f"leaving at least {MIN_HOST_HEADROOM_BYTES >> 30} GiB to the rest of the host", check=_arena_fraction,
    )  # fmt: skip
    # As long as the trigger's reuse window (RELAYGR_TRIGGER_REUSE_WINDOW_S): the trigger admits a
    # pre-inference counting on the calls that come back within it, and a returning user's psi
    # that DRAM dropped sooner is recomputed. Space is reclaimed by LRU eviction, not by the TTL.
    ttl_s: float = setting(
        600.0, env="RELAYGR_EXPANDER_TTL_S", help="idle lifetime of an unpinned psi entry", check=positive
    )
    max_lease_ms: float = settings.max_lease_ms(renamed_from="RELAYGR_EXPANDER_MAX_LEASE_S")
    presence_slots: int = setting(
        DEFAULT_SLOTS, env="RELAYGR_EXPANDER_PRESENCE_SLOTS",
        help="slots of the index of held keys that rankers read before asking for a psi (2 bytes each; "
        "0: no index, every lookup is a round trip)", check=_presence_slots,
    )  # fmt: skip
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
            (_arena_fraction, self.arena_fraction, "arena_fraction"),
            (_presence_slots, self.presence_slots, "presence_slots"),
            (positive, self.ttl_s, "ttl_s"),
            (positive, self.max_lease_ms, "max_lease_ms"),
            (port_number, self.metrics_port, "metrics_port"),
        ]
        for check, value, name in checks:
            problem = check(value)
            if problem:
                raise ConfigError(f"invalid ExpanderConfig: {name} = {value!r}: {problem}")
        self.sized_arena_bytes(mem_available_bytes())  # an arena this host cannot hold: say so now

    def sized_arena_bytes(self, available: int | None) -> int:
        """The arena's size on a host with `available` bytes of memory available (None: unknown).
        Raises ConfigError where it cannot be served: a configured size over what is available
        (prefaulting it would end in the OOM killer, not in an error), or no size given and none
        derivable."""
        if self.arena_bytes:
            if available is not None and self.arena_bytes > available:
                raise ConfigError(
                    f"RELAYGR_EXPANDER_ARENA_BYTES = {self.arena_bytes} is more than the host has available "
                    f"({available} bytes): lower it, or leave it at 0 to take a fraction of what is there"
                )
            return self.arena_bytes
        if available is None:
            raise ConfigError(
                "the host's available memory is unreadable (/proc/meminfo): set RELAYGR_EXPANDER_ARENA_BYTES"
            )
        wanted = min(int(available * self.arena_fraction), available - MIN_HOST_HEADROOM_BYTES)
        sized = wanted // PAGE * PAGE
        if sized <= 0:
            raise ConfigError(
                f"{available} bytes available leave no arena after {MIN_HOST_HEADROOM_BYTES} bytes of headroom: "
                "set RELAYGR_EXPANDER_ARENA_BYTES"
            )
        return sized

    @property
    def max_lease_s(self) -> float:
        """The longest write/read lease a client may ask for, in the store's unit."""
        return self.max_lease_ms / 1e3

    @property
    def fd_socket_path(self) -> str:
        return self.socket_path + ".fd"
