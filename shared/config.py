"""One typed, validated configuration per service, from CLI flags over env vars over defaults.

A service declares a frozen dataclass whose fields carry `setting(...)` metadata (env var, help,
validator). `load_config(Cls, argv)` reads every field, converts it to the field's type, validates
it, and raises ConfigError listing every problem at once, so a bad start-up fails with one clear
message instead of a stack trace halfway through.

Naming rule (one for every service): a service's own setting is `RELAYGR_<SERVICE>_<SETTING>`;
a setting that two services must agree on is defined once in shared/settings.py and read by both
under one name (`RELAYGR_<SETTING>`, or the owner's name: `RELAYGR_EXPANDER_SOCKET_PATH`, which
the ranker reads too); client groups every service shares keep their prefix (`RELAYGR_KAFKA_*`,
`RELAYGR_TLS_*`, `RELAYGR_MODEL_*`). Quantities carry their unit in the name (`_MS`, `_S`,
`_BYTES`, `_MB`). A mode is an `enum.Enum` field: parsed from its value, with the choices in
`--help` and in the error. A renamed variable stays listed (`setting(..., renamed_from=...)`):
when it is set, start-up fails naming the new one, instead of silently ignoring it.

    @dataclass(frozen=True)
    class RankerConfig:
        port: int = setting(50051, env="RELAYGR_RANKER_PORT", help="gRPC port", check=port_number)
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
Check = Callable[[Any], str | None]  # returns a problem description, or None when the value is fine


class ConfigError(ValueError):
    """Start-up configuration is invalid (fatal: the service does not start)."""


class Secret:
    """A setting that must never be logged (a password). Its repr and str are masked, and so is
    everything built from them: a config's dataclass repr, a structured log field (orjson writes
    a dataclass field by field and falls back to repr for this type), a ConfigError. `reveal()`
    hands the value to the one call that needs it."""

    __slots__ = ("_value",)
    _value: str

    def __init__(self, value: str = "") -> None:
        object.__setattr__(self, "_value", value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Secret is immutable")

    def reveal(self) -> str:
        return str(self._value)

    def __bool__(self) -> bool:
        return bool(self._value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash((Secret, self._value))

    def __repr__(self) -> str:
        return "Secret('***')" if self._value else "Secret('')"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("a Secret is not serialised")

    def __copy__(self) -> Secret:
        return self  # immutable

    def __deepcopy__(self, memo: dict[int, Any]) -> Secret:
        return self  # immutable (dataclasses.asdict deep-copies field values)


def setting(
    default: Any, *, env: str, help: str, check: Check | None = None, renamed_from: str | tuple[str, ...] = ()
) -> Any:
    """A config field read from `env` (and the field's flag). `renamed_from`: the variable(s) this
    setting was read from before; load_config refuses to start while one of them is set."""
    old = (renamed_from,) if isinstance(renamed_from, str) else tuple(renamed_from)
    return dataclasses.field(
        default=default, metadata={"env": env, "help": help, "check": check, "renamed_from": old}
    )


def positive(value: float) -> str | None:
    return None if value > 0 else "must be > 0"


def non_negative(value: float) -> str | None:
    return None if value >= 0 else "must be >= 0"


def port_number(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "must be a TCP port (0-65535; 0 picks a free one)"


def one_of(*choices: str) -> Check:
    def check(value: str) -> str | None:
        return None if value in choices else f"must be one of {', '.join(choices)}"

    return check


def fraction(value: float) -> str | None:
    return None if 0 < value <= 1 else "must be within (0, 1]"


def share(value: float) -> str | None:
    """A fraction that may also be 0 (a setting that 0 turns off)."""
    return None if 0 <= value <= 1 else "must be within [0, 1]"


def choices(kind: type[enum.Enum]) -> tuple[str, ...]:
    """The values an enum-typed setting accepts, in declaration order."""
    return tuple(str(member.value) for member in kind)


def _is_enum(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, enum.Enum)


def _shown(value: Any) -> str:
    """A value as Python writes it, an enum member by its value ('info', not <LogLevel.INFO>)."""
    return repr(value.value) if isinstance(value, enum.Enum) else repr(value)


def _parse(raw: str, kind: Any) -> Any:
    origin = typing.get_origin(kind)
    if _is_enum(kind):
        for member in kind:
            if raw.strip() == str(member.value):
                return member
        raise ValueError(f"must be one of {', '.join(choices(kind))}")
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    if kind is int:
        return int(raw)
    if kind is float:
        return float(raw)
    if kind is str:
        return raw
    if kind is Secret:
        return Secret(raw)
    if origin in (tuple, Sequence) or kind is tuple:
        (item,) = typing.get_args(kind)[:1] or (str,)
        return tuple(_parse(part, item) for part in raw.split(",") if part.strip())
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if raw.strip().lower() in ("", "none"):
            return None
        return _parse(raw, args[0])
    raise TypeError(f"unsupported config type {kind}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def load_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str | None = None,
) -> T:
    """Builds cls from argv (flags), then env, then defaults. Raises ConfigError. `prog` names the
    command in --help (the class name when not given)."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    parser = argparse.ArgumentParser(
        prog=prog or cls.__name__,
        add_help=True,
        exit_on_error=False,
        allow_abbrev=False,  # a prefix of a flag is an error
    )
    for f in fields:
        kind = hints[f.name]
        listed = f"one of {' | '.join(choices(kind))}; " if _is_enum(kind) else ""
        text = (f"{f.metadata.get('help', '')} (env {f.metadata.get('env')}; {listed}"
                f"default {_shown(f.default)})")  # fmt: skip
        # argparse formats help with %: a literal one ("5-7%") made --help raise a TypeError.
        parser.add_argument(
            _flag(f.name), dest=f.name, default=None, metavar="VALUE", help=text.replace("%", "%%")
        )
    try:
        parsed, unknown = parser.parse_known_args(list(argv or []))
    except argparse.ArgumentError as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None
    if unknown:
        raise ConfigError(
            f"{cls.__name__}: unknown arguments {' '.join(unknown)} (--help lists the settings)"
        )
    values: dict[str, Any] = {}
    problems: list[str] = []
    for f in fields:
        for old in f.metadata.get("renamed_from", ()):
            if old in env:
                problems.append(f"{old} is no longer read: set {f.metadata.get('env')} instead")
        raw, source = getattr(parsed, f.name), _flag(f.name)
        if raw is None and f.metadata.get("env") in env:
            raw, source = env[f.metadata["env"]], f.metadata["env"]
        if raw is None:
            values[f.name] = f.default
        else:
            try:
                values[f.name] = _parse(raw, hints[f.name])
            except (ValueError, TypeError) as exc:
                shown = Secret(raw) if hints[f.name] is Secret else raw
                problems.append(f"{source}={shown!r}: {exc}")
                continue
        check = f.metadata.get("check")
        problem = check(values[f.name]) if check is not None and values[f.name] is not None else None
        if problem:
            problems.append(f"{f.name} ({f.metadata.get('env')}) = {_shown(values[f.name])}: {problem}")
    if problems:
        raise ConfigError(f"invalid {cls.__name__}:\n  " + "\n  ".join(problems))
    config = cls(**values)
    validate = getattr(config, "validate", None)
    if callable(validate):
        validate()
    return config


def describe(cls: type) -> list[tuple[str, str, str, str]]:
    """(flag, env var, default, help) of every setting: for docs and --help tables."""
    return [
        (_flag(f.name), str(f.metadata.get("env")), _shown(f.default), str(f.metadata.get("help", "")))
        for f in dataclasses.fields(cls)
    ]
