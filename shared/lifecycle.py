"""Process lifecycle helpers shared by every service's entry point."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import sys
from collections.abc import Callable, Collection, Sequence
from typing import TypeVar

from shared.config import ConfigError, load_config
from shared.logging import configure_logging

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """When started by the launcher (RELAYGR_DIE_WITH_PARENT=<its pid>), ask the kernel for SIGTERM
    when the launcher dies, so a killed launcher leaves no orphan services behind. Linux only;
    elsewhere, and when the variable is unset, this does nothing."""
    parent = os.environ.get("RELAYGR_DIE_WITH_PARENT")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def settle_heap() -> None:
    """Call once start-up is done (model loaded, kernels compiled, connections made): what is alive
    now lives as long as the process, so it moves out of the collector's sight (gc.freeze) and
    request-time collections only ever scan request-time objects, short pauses instead of a full
    traversal of the model's and the libraries' objects on some unlucky call."""
    gc.collect()
    gc.freeze()


def pin_process(cpus: Collection[int]) -> None:
    """Every thread of this process (those already started too) and every later one onto `cpus`."""
    os.sched_setaffinity(0, cpus)  # the calling thread: threads it starts later inherit this
    with contextlib.suppress(FileNotFoundError):  # /proc is Linux-only; so is a thread's own mask
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that has just exited
                os.sched_setaffinity(int(tid), cpus)


def run_service(
    name: str, config_cls: type[T], serve: Callable[[T], None], argv: Sequence[str] | None
) -> int:
    """A service's `main`: configuration (exit 2 with every problem listed when it is invalid),
    JSON logging, then `serve` until it returns (it handles SIGTERM / SIGINT itself)."""
    die_with_parent()
    try:
        config = load_config(config_cls, sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"relaygr {name}: {exc}", file=sys.stderr)
        return 2
    configure_logging(name, getattr(config, "log_level", "info"))
    serve(config)
    return 0
