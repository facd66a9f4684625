"""Structured JSON logs for every service (structlog), one line per event on stderr."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson
import structlog


class _Stderr:
    """stderr that never raises: a service whose log reader went away (its launcher was killed)
    must still shut down cleanly, not die of BrokenPipeError halfway through."""

    def __init__(self) -> None:
        self._broken = False

    def write(self, text: str) -> int:
        if not self._broken:
            try:
                return sys.stderr.write(text)
            except (BrokenPipeError, OSError, ValueError):
                self._broken = True
        return len(text)

    def flush(self) -> None:
        if not self._broken:
            try:
                sys.stderr.flush()
            except (BrokenPipeError, OSError, ValueError):
                self._broken = True


def _dumps(obj: Any, default: Any = None) -> str:
    return orjson.dumps(obj, default=default).decode()


def configure_logging(service: str, level: str = "info") -> None:
    """Idempotent; call once at service start. Secrets must never be passed as log fields."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    sink = _Stderr()
    logging.basicConfig(stream=sink, level=numeric, format="%(message)s", force=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(serializer=_dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sink),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
