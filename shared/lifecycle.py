"""Process lifecycle shared by every service: the entry point (`run_service`), process helpers, and
`Lifecycle`, the one start / serve / stop-intake / drain / close sequence every service runs."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import os
import signal
import sys
from collections.abc import Callable, Collection, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from shared.config import ConfigError, load_config
from shared.logging import configure_logging, get_logger

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_TIMERSLACK = 29
_PR_GET_TIMERSLACK = 30


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


def name_os_thread(name: str) -> None:
    """Gives the calling thread `name` in the OS's view (Linux: /proc/<pid>/task/<tid>/comm, top,
    py-spy; 15 bytes at most), which Python 3.12's threading does not do: a per-thread CPU
    reading can then tell the device thread from the event loop. No-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def set_timer_slack(ns: int) -> bool:
    """The calling thread's timer slack, in ns (Linux; threads it starts later inherit it): how late
    the kernel may end a timed wait to batch wake-ups, 50 us by default. A thread that wants the
    interpreter waits on a timed condition for the switch interval before asking the holder to let
    go; at a 0.05 ms interval the default slack can double that wait. 0 restores the default.
    Returns whether it was set (False elsewhere than Linux, or when the kernel refused)."""
    if ns < 0:
        raise ValueError("a timer slack is >= 0 ns")
    if not sys.platform.startswith("linux"):
        return False
    try:
        return (
            int(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0)) == 0
        )
    except (OSError, AttributeError):
        return False


def timer_slack_ns() -> int | None:
    """The calling thread's timer slack in ns (None elsewhere than Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        value = int(ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0))
    except (OSError, AttributeError):
        return None
    return value if value >= 0 else None


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
    name: str, config_cls: type[T], serve: Callable[[T], int | None], argv: Sequence[str] | None
) -> int:
    """A service's `main`: configuration (exit 2 with every problem listed when it is invalid),
    JSON logging, then `serve` until it returns (it handles SIGTERM / SIGINT itself). Returns the
    exit status `serve` returned (a `Lifecycle.run` status), 0 when it returned None."""
    die_with_parent()
    try:
        config = load_config(
            config_cls, sys.argv[1:] if argv is None else argv, prog=f"python -m services.{name}"
        )
    except ConfigError as exc:
        print(f"relaygr {name}: {exc}", file=sys.stderr)
        return 2
    configure_logging(name, getattr(config, "log_level", "info"))
    return serve(config) or 0


# ---------------------------------------------------------------------------------------------
# One lifecycle for every service: start, serve, stop intake, drain, close.


class ServiceHooks(Protocol):
    """What a service gives its `Lifecycle`. Each hook is awaited at most once, in this order:
    start, stop_intake, drain, close (close also after a failed start, to undo what it did)."""

    async def start(self) -> None:
        """Binds ports, connects clients, spawns background tasks; raises when the service cannot
        serve (the process then exits 1)."""

    async def stop_intake(self) -> None:
        """Takes no new work from now on (health NOT_SERVING, consumers stop fetching)."""

    async def drain(self) -> None:
        """Finishes the work in hand (in-flight calls, the consumer's current batch). Bounded by
        the lifecycle's grace period: cancelled when it runs past it."""

    async def close(self) -> None:
        """Releases everything start acquired; must not raise for a half-done start."""


class Lifecycle:
    """Runs one service the way a supervisor expects (modelled on Temporal's worker): serve until
    SIGTERM / SIGINT or `request_stop`, or until the first failure of a background task; then stop
    intake, drain the work in hand (at most `grace_s`), cancel the background tasks and close.

    `run` returns the process's exit status: 0 when asked to stop, 1 when the start or a background
    task failed, so that a supervisor restarts the service instead of it limping on without, say,
    its lease-expiry loop. A background task that returns while the service is serving is a
    failure too: background tasks run for the service's life."""

    def __init__(self, name: str, grace_s: float = 5.0) -> None:
        if grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        self.name = name
        self.grace_s = grace_s
        self.failure: str | None = None  # the first failure, if any (what run's exit status 1 means)
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._stop: asyncio.Event | None = None  # made inside the running loop
        self._stopping = False
        self._log = get_logger(f"{name}.lifecycle")

    @property
    def stopping(self) -> bool:
        """True from the moment a stop was requested or a task failed."""
        return self._stopping

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Starts a named background task that lives as long as the service. Names are unique."""
        if name in self._tasks and not self._tasks[name].done():
            coro.close()
            raise ValueError(f"a background task named {name!r} is already running")
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}-{name}")
        task.add_done_callback(functools.partial(self._task_done, name))
        self._tasks[name] = task
        return task

    def request_stop(self, reason: str) -> None:
        """Asks `run` to stop serving (idempotent; safe from a signal handler)."""
        if not self._stopping:
            self._log.info("service_stopping", service=self.name, reason=reason)
        self._stopping = True
        if self._stop is not None:
            self._stop.set()

    def fail(self, reason: str) -> None:
        """Records a fatal failure (the first one wins) and stops the service with exit status 1."""
        if self.failure is None:
            self.failure = reason
            self._log.error("service_failed", service=self.name, reason=reason)
        self.request_stop(reason)

    def _task_done(self, name: str, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            if not self._stopping:
                self.fail(f"background task {name} was cancelled")
            return
        exc = task.exception()
        if exc is not None:
            self.fail(f"background task {name} failed: {exc!r}")
        elif not self._stopping:
            self.fail(f"background task {name} returned while the service was serving")

    async def run(self, hooks: ServiceHooks, install_signals: bool = True) -> int:
        """Starts the service and serves until stopped; returns the exit status (see the class)."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self._stopping:  # asked to stop before run
            self._stop.set()
        handled: list[signal.Signals] = []
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(
                    NotImplementedError, RuntimeError, ValueError
                ):  # not the main thread
                    loop.add_signal_handler(sig, self.request_stop, sig.name)
                    handled.append(sig)
        try:
            try:
                await hooks.start()
            except Exception as exc:
                self.fail(f"start failed: {exc!r}")
            else:
                await self._stop.wait()
                await self._wind_down(hooks)
        finally:
            self._stopping = True
            await self._cancel_tasks()
            try:
                await hooks.close()
            except Exception as exc:  # close must not hide why we stopped; it is still a failure
                self.fail(f"close failed: {exc!r}")
            for sig in handled:
                loop.remove_signal_handler(sig)
        self._log.info("service_stopped", service=self.name, failure=self.failure)
        return 0 if self.failure is None else 1

    async def _wind_down(self, hooks: ServiceHooks) -> None:
        try:
            await hooks.stop_intake()
        except Exception as exc:
            self.fail(f"stop_intake failed: {exc!r}")
        try:
            await asyncio.wait_for(hooks.drain(), self.grace_s)
        except TimeoutError:
            self._log.warning("drain_timed_out", service=self.name, grace_s=self.grace_s)
        except Exception as exc:
            self.fail(f"drain failed: {exc!r}")

    async def _cancel_tasks(self) -> None:
        tasks = [t for t in self._tasks.values() if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
