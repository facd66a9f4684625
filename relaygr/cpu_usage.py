"""CPU time of our processes and of their busiest thread over a benchmark point (Linux /proc).

A Python service's request path runs under one interpreter lock: a process whose busiest thread
is near one core is saturated whatever the host's idle CPUs say, and its calls queue for the
lock. The host-wide figures (harness.host_cpu_fractions) cannot show which process that is."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_ticks(stat_line: str) -> int:
    """utime + stime of one /proc/.../stat line (fields 14 and 15; the name in parentheses may
    hold spaces and parentheses, so fields are counted after its last ')')."""
    fields = stat_line.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # fields[0] is the state, field 3 of the line


def threads_cpu_s(pid: int, proc: Path = Path("/proc")) -> dict[str, float]:
    """CPU seconds so far of each thread of `pid`, keyed `name/tid`; {} when the process is gone
    or /proc is not there. Threads that ended are not counted (their time is lost to us)."""
    out: dict[str, float] = {}
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return {}
    for task in tasks:
        try:
            line = (task / "stat").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue  # the thread ended meanwhile
        out[f"{name}/{task.name}"] = _thread_ticks(line) / _TICKS_PER_S
    return out


def snapshot(pids: Mapping[str, int], proc: Path = Path("/proc")) -> dict[str, dict[str, float]]:
    """Per process name: its threads' CPU seconds so far."""
    return {name: threads_cpu_s(pid, proc) for name, pid in pids.items()}


def usage(
    before: Mapping[str, Mapping[str, float]],
    after: Mapping[str, Mapping[str, float]],
    seconds: float,
    pids: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """Over `seconds` between two snapshots: `cpu_cores_<name>` (CPU seconds per second, all of
    its threads) and `cpu_top_thread_<name>` (its busiest thread's, at most ~1.0). A thread born
    after `before` counts from zero. With the processes' `pids`, also `cpu_main_thread_<name>`:
    its main thread's (thread id = pid), where our services run their asyncio event loop: what
    the event loop's work holds of the interpreter lock the device loop shares, which the
    capacity model (relaygr/sim.py) charges to each request."""
    if seconds <= 0:
        return {}
    out: dict[str, float] = {}
    for name, threads in after.items():
        start = before.get(name, {})
        used = {tid: max(0.0, s - start.get(tid, 0.0)) for tid, s in threads.items()}
        if not used:
            continue
        out[f"cpu_cores_{name}"] = sum(used.values()) / seconds
        out[f"cpu_top_thread_{name}"] = max(used.values()) / seconds
        pid = pids.get(name) if pids is not None else None
        main = [v for key, v in used.items() if pid is not None and key.rsplit("/", 1)[-1] == str(pid)]
        if main:
            out[f"cpu_main_thread_{name}"] = main[0] / seconds
    return out


def busiest_threads(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]], seconds: float,
    top: int = 3,
) -> dict[str, list[tuple[str, float]]]:  # fmt: skip
    """Per process: its `top` busiest threads (name/tid, cores) over the interval, for a log line."""
    out: dict[str, list[tuple[str, float]]] = {}
    for name, threads in after.items():
        start = before.get(name, {})
        ranked = sorted(((tid, (s - start.get(tid, 0.0)) / seconds) for tid, s in threads.items()),
                        key=lambda kv: -kv[1])  # fmt: skip
        out[name] = [(tid, round(cores, 3)) for tid, cores in ranked[:top]]
    return out
