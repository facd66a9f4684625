"""`relaygr up`: the whole stack from one command, and nothing left behind however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from relaygr.processes import REPO
from tests.rankers import rank_request, users

pytestmark = pytest.mark.integration


def children_of(pid: int) -> list[int]:
    """Services started by a launcher: they carry RELAYGR_DIE_WITH_PARENT=<its pid>."""
    found = []
    marker = f"RELAYGR_DIE_WITH_PARENT={pid}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().split()[2]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def start_up(*extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "relaygr.cli", "up", "--rankers", "1", *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 180
    for line in proc.stdout:
        if line.startswith("relaygr up: router on "):
            return proc, line.split("router on ")[1].split(",")[0]
        assert time.monotonic() < deadline, "relaygr up did not come up"
    raise AssertionError(f"relaygr up exited early with {proc.wait()}")


def wait_gone(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def test_up_serves_and_ctrl_c_leaves_nothing_behind():
    shm_before = set(os.listdir("/dev/shm"))
    proc, router = start_up()
    try:
        services = children_of(proc.pid)
        assert len(services) == 4  # expander, ranker, router, trigger (the broker runs under a shim)
        prefixes, suffixes = users(1, 1, prefix_len=100)
        with grpc.insecure_channel(router) as channel:
            reply = channel.unary_unary(
                "/relaygr.v1.Ranker/Rank",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=lambda b: b,
            )(rank_request(prefixes[0], suffixes[0], "up"), timeout=60)
        assert reply
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert wait_gone(services) == []
    finally:
        if proc.poll() is None:
            proc.kill()
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_killed_launcher_leaves_no_orphans():
    proc, _ = start_up("--no-expander")
    services = children_of(proc.pid)
    assert services
    proc.kill()
    proc.wait()
    assert wait_gone(services) == []
