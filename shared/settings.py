"""Settings that two or more services must agree on, each defined once (shared/config.py states the
naming rule) and embedded in every config that reads it, plus the modes (enums) more than one
service uses.

Each function returns a fresh dataclass field (a field object belongs to the one class it was
declared in), so the variable, default, help and validation live here and nowhere else:

    @dataclass(frozen=True)
    class RouterConfig:
        default_lease_ms: float = settings.default_lease_ms()

Who reads what: the expander's socket path (expander, ranker); leases (ranker, router, expander,
trigger); topics (router, trigger; the launcher creates them); the model preset (ranker, trigger);
the prefix limit (ranker, router); the bounded-load parameters (router, trigger).
"""

from __future__ import annotations

import enum
import os
from typing import Any

from shared.config import non_negative, one_of, positive, setting
from shared.modelspec import PRESETS

DEFAULT_RETRIEVAL_TOPIC = "relaygr.retrieval"
DEFAULT_SIGNAL_TOPIC = "relaygr.preinfer-signals"
DEFAULT_DLQ_TOPIC = "relaygr.dlq"
DEFAULT_LEASE_MS = 2000.0
DEFAULT_MAX_LEASE_MS = 30_000.0
# sockaddr_un.sun_path holds 108 bytes including the NUL; the fd socket appends ".fd".
MAX_SOCKET_PATH_BYTES = 107 - len(".fd")


class LogLevel(enum.StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


def log_level(service: str) -> Any:
    """The service's own log level, RELAYGR_<SERVICE>_LOG_LEVEL (RELAYGR_LOG_LEVEL is refused)."""
    return setting(LogLevel.INFO, env=f"RELAYGR_{service.upper()}_LOG_LEVEL", help="log level",
                   renamed_from="RELAYGR_LOG_LEVEL")  # fmt: skip


# --------------------------------------------------------------------------- expander socket


def default_expander_socket_path() -> str:
    """$XDG_RUNTIME_DIR/expander.sock, else /tmp/relaygr-<uid>/expander.sock (per user)."""
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/relaygr-{os.getuid()}", "expander.sock")


def socket_path_problem(value: str) -> str | None:
    if not os.path.isabs(value):
        return "must be an absolute path"
    if len(os.fsencode(value)) > MAX_SOCKET_PATH_BYTES:
        return f"must be at most {MAX_SOCKET_PATH_BYTES} bytes (unix socket path limit, with '.fd' appended)"
    return None


def expander_socket_path() -> Any:
    """The expander's control socket: where the daemon listens and where rankers connect."""
    return setting(
        default_expander_socket_path(),
        env="RELAYGR_EXPANDER_SOCKET_PATH",
        help="the expander's control socket (its fd socket is this path + '.fd'): the daemon listens "
        "there (creating its directory 0700), rankers with a host tier connect there",
        check=socket_path_problem,
        renamed_from="RELAYGR_EXPANDER_SOCKET",
    )


# --------------------------------------------------------------------------- leases


def default_lease_ms(renamed_from: str) -> Any:
    """Lease of a PreInfer that names no deadline: the ranker keeps psi that long, the router
    remembers its residency that long (they must agree, hence one variable)."""
    return setting(DEFAULT_LEASE_MS, env="RELAYGR_DEFAULT_LEASE_MS",
                   help="lease of pre-inferred psi when a PreInfer names no deadline (rankers keep it, "
                   "routers remember where it is)", check=positive, renamed_from=renamed_from)  # fmt: skip


def max_lease_ms(renamed_from: str | tuple[str, ...] = ()) -> Any:
    """The longest lease anything is held for: rankers cap granted leases at it, the expander caps
    its pins, the trigger caps what its ledger reserves for an admitted pre-inference."""
    return setting(DEFAULT_MAX_LEASE_MS, env="RELAYGR_MAX_LEASE_MS",
                   help="longest lease: rankers grant no longer one, the expander pins no longer, the "
                   "trigger's ledger reserves an admitted psi's bytes no longer", check=positive,
                   renamed_from=renamed_from)  # fmt: skip


# --------------------------------------------------------------------------- topics


def retrieval_topic() -> Any:
    return setting(DEFAULT_RETRIEVAL_TOPIC, env="RELAYGR_RETRIEVAL_TOPIC", help="retrieval events topic")


def signal_topic() -> Any:
    return setting(DEFAULT_SIGNAL_TOPIC, env="RELAYGR_SIGNAL_TOPIC", help="pre-infer signals topic")


def dlq_topic() -> Any:
    return setting(DEFAULT_DLQ_TOPIC, env="RELAYGR_DLQ_TOPIC", help="dead-letter topic")


def topic_partitions() -> Any:
    return setting(8, env="RELAYGR_TOPIC_PARTITIONS", help="partitions of the topics a service creates",
                   check=positive)  # fmt: skip


# --------------------------------------------------------------------------- model and placement


def model_preset() -> Any:
    """The model's preset: the rankers build it, the trigger estimates its cost from it."""
    return setting("tiny", env="RELAYGR_MODEL_PRESET", help=f"model preset ({', '.join(PRESETS)})",
                   check=one_of(*PRESETS))  # fmt: skip


def max_prefix_tokens() -> Any:
    """The longest prefix accepted: the router must not pass signals the rankers would reject."""
    return setting(65536, env="RELAYGR_MAX_PREFIX_TOKENS", help="longest accepted prefix (routers and rankers)",
                   check=positive)  # fmt: skip


def load_factor() -> Any:
    """Bounded-load hashing: placement agrees across routers and the trigger only with one value."""
    return setting(0.25, env="RELAYGR_LOAD_FACTOR",
                   help="bounded load: an instance above (1 + this) x mean load is tried last (routers "
                   "and the trigger)", check=non_negative)  # fmt: skip


def load_slack() -> Any:
    # Loads are queue depths (small integers): without an absolute allowance one queued call on an
    # otherwise idle fleet makes an instance "overloaded" and moves its users off their psi.
    return setting(4.0, env="RELAYGR_LOAD_SLACK",
                   help="bounded load: absolute load allowed above (1 + load_factor) x mean before users "
                   "move (routers and the trigger)", check=non_negative)  # fmt: skip
