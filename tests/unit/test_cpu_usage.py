"""relaygr.cpu_usage: per-thread CPU time from /proc, and the usage over an interval."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from relaygr import cpu_usage


def _fake_proc(root: Path, pid: int, threads: dict[int, tuple[str, int, int]]) -> None:
    for tid, (name, utime, stime) in threads.items():
        task = root / str(pid) / "task" / str(tid)
        task.mkdir(parents=True)
        # A name with a space and a parenthesis: fields are counted after the last ')'.
        fields = ["S", "1", "1", "1", "0", "-1", "4194560", "0", "0", "0", "0", str(utime), str(stime)]
        (task / "stat").write_text(f"{tid} ({name}) " + " ".join(fields + ["0"] * 30) + "\n")
        (task / "comm").write_text(name + "\n")


def test_threads_cpu_s_reads_utime_plus_stime(tmp_path: Path) -> None:
    ticks = cpu_usage._TICKS_PER_S
    _fake_proc(tmp_path, 7, {7: ("python3", 3 * ticks, ticks), 8: ("a (b) c", ticks // 2, 0)})
    got = cpu_usage.threads_cpu_s(7, tmp_path)
    assert got == {"python3/7": pytest.approx(4.0), "a (b) c/8": pytest.approx(0.5, abs=1 / ticks)}


def test_a_process_that_is_gone_reads_empty(tmp_path: Path) -> None:
    assert cpu_usage.threads_cpu_s(12345, tmp_path) == {}


def test_usage_per_process_and_busiest_thread() -> None:
    before = {"ranker_0": {"main/1": 10.0, "engine/2": 5.0}, "router": {"main/3": 1.0}}
    after = {"ranker_0": {"main/1": 12.0, "engine/2": 8.0, "new/9": 0.5}, "router": {"main/3": 1.5}}
    got = cpu_usage.usage(before, after, seconds=4.0)
    assert got == {
        "cpu_cores_ranker_0": pytest.approx((2.0 + 3.0 + 0.5) / 4),  # a thread born since counts from 0
        "cpu_top_thread_ranker_0": pytest.approx(3.0 / 4),
        "cpu_cores_router": pytest.approx(0.5 / 4),
        "cpu_top_thread_router": pytest.approx(0.5 / 4),
    }
    assert cpu_usage.usage(before, after, seconds=0.0) == {}
    assert cpu_usage.busiest_threads(before, after, 4.0)["ranker_0"][0] == ("engine/2", 0.75)
    # With the pids: each process's main thread (thread id = pid), not its busiest.
    with_main = cpu_usage.usage(before, after, 4.0, pids={"ranker_0": 1, "router": 3, "gone": 5})
    assert with_main["cpu_main_thread_ranker_0"] == pytest.approx(2.0 / 4)
    assert with_main["cpu_main_thread_router"] == pytest.approx(0.5 / 4)
    assert "cpu_main_thread_gone" not in with_main
    assert cpu_usage.usage(before, after, 4.0, pids={"ranker_0": 77}).keys() == got.keys()  # no such thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_spinning_thread_shows_as_the_busiest() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=spin, name="spinner")
    spinner.start()
    try:
        pids = {"me": __import__("os").getpid()}
        before = cpu_usage.snapshot(pids)
        started = time.perf_counter()
        time.sleep(0.5)
        after = cpu_usage.snapshot(pids)
        got = cpu_usage.usage(before, after, time.perf_counter() - started)
        top = cpu_usage.busiest_threads(before, after, time.perf_counter() - started, top=1)
    finally:
        stop.set()
        spinner.join()
    assert got["cpu_top_thread_me"] > 0.3  # a loaded 2-core CI machine still gives it a good share
    # Python 3.12 leaves the OS thread name (comm) as the process's: the thread id tells them apart.
    assert top["me"][0][0].endswith(f"/{spinner.native_id}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_named_thread_reads_back_by_its_name() -> None:
    from shared.lifecycle import name_os_thread

    seen: list[str] = []

    def run() -> None:
        name_os_thread("relaygr-engine-and-more")  # cut to the OS's 15 bytes
        seen.extend(cpu_usage.threads_cpu_s(__import__("os").getpid()))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert f"relaygr-engine-/{worker.native_id}" in seen
