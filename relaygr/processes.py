"""Service processes: started, awaited on their ready log line, stopped (the launcher and tests).

Every service logs JSON lines on stderr; `ServiceProcess` collects them in a thread and waits for
an event (e.g. "ranker_ready") to learn ports. Teardown always kills what is still running.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class ServiceProcess:
    """`python -m <module> <args>`; `echo` (if given) receives every stderr line as it arrives."""

    def __init__(
        self,
        module: str,
        *args: str,
        env: dict[str, str] | None = None,
        echo: Callable[[str], None] | None = None,
        name: str | None = None,
    ) -> None:
        self.module = module
        self.name = name or module.rsplit(".", 1)[-1]
        self._echo = echo
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # The child asks for SIGTERM when this process dies (shared/lifecycle.py): no orphans.
            env={**(env if env is not None else os.environ), "RELAYGR_DIE_WITH_PARENT": str(os.getpid())},
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self.log: list[dict[str, Any]] = []
        self._drainer = threading.Thread(target=self._drain, name=f"drain-{self.name}", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            self._lines.put(line)
            if self._echo is not None:
                self._echo(line.rstrip("\n"))

    def wait_event(self, event: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """The first log record with this event; AssertionError if the process exits or stays silent."""
        for record in self.log:
            if record.get("event") == event:
                return record
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None and self._lines.empty():
                    break
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = {"raw": line.rstrip()}
            self.log.append(record)
            if record.get("event") == event:
                return record
        tail = [r for r in self.log[-20:]]
        raise AssertionError(f"{self.module}: no {event!r} (exit {self.proc.poll()}); last log: {tail}")

    def records(self) -> list[dict[str, Any]]:
        """Every log record so far (drains what the reader thread collected)."""
        while True:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                return self.log
            try:
                self.log.append(json.loads(line))
            except ValueError:
                self.log.append({"raw": line.rstrip()})

    def metric(self, port: int, name: str, timeout_s: float = 5.0) -> float:
        """Sum of a Prometheus metric's samples (all label sets) from the process's /metrics."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s).read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                head, value = line.rsplit(" ", 1)
                if head == name or head.startswith(name + "{"):
                    total += float(value)
        return total

    def kill(self) -> None:
        """kill -9."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._release()

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._release()
        return int(self.proc.returncode)

    def _release(self, timeout_s: float = 5.0) -> None:
        """Closes the stderr pipe of an exited process once its reader has seen the end of it:
        left to the garbage collector, every stopped service kept one descriptor open for as
        long as anything (a Stack) referred to it. The log records already read stay readable."""
        self._drainer.join(timeout_s)
        if self._drainer.is_alive():
            return  # a descendant still holds the pipe's write end: closing would block on the reader
        if self.proc.stderr is not None and not self.proc.stderr.closed:
            self.proc.stderr.close()
