"""NVIDIA MPS (Multi-Process Service) for a stack's rankers, when several share a GPU.

Two ranker processes on one GPU each get their own interpreter, which the relay needs (one
process's event loop fell behind its calls at ~240 calls/s on an H200), but without MPS their two
CUDA contexts take turns on the GPU by time slices: a full ranking's device time rose from 3.5 to
5.9 ms and the baseline lost 17% of its limit (goodput-nvidia-h200-h4c). Under MPS the processes'
kernels go through one server and may run side by side.

The daemon gets pipe and log directories of its own, under the stack's run directory, so that
only the stack's rankers (given `env`) reach it, and nothing outside the stack changes: the GPU's
compute mode and every other setting stay as they are. A CUDA process that cannot reach the
daemon runs without MPS and says nothing, hence `server_running()` to check after the rankers
have started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"


class MpsUnavailable(RuntimeError):
    """The control program is missing or would not start."""


class MpsDaemon:
    def __init__(self, run_dir: str, control: str = CONTROL) -> None:
        self.pipe_dir = os.path.join(run_dir, "mps-pipe")
        self.log_dir = os.path.join(run_dir, "mps-log")
        self._control = control
        self._started = False

    @property
    def env(self) -> dict[str, str]:
        """What a CUDA process needs in its environment to be this daemon's client."""
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}

    def client_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """`env` for a CUDA process of this daemon's: its directories added, and
        CUDA_VISIBLE_DEVICES renumbered. The daemon was started with the stack's own device list
        (e.g. CUDA_VISIBLE_DEVICES=1, one stack per GPU); its server sees those devices as 0..n-1,
        and a client's list names devices of the server's, so that "1" names none (the control
        log: "not a valid GPU ID in the MPS visible set"; torch: no CUDA GPUs). Measured on an
        H200 pair (2026-11-30): a client with the variable unset failed at torch's import too;
        one given "0" ran on the daemon's GPU."""
        client = dict(env)
        visible = client.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and visible.strip():
            count = len([d for d in visible.split(",") if d.strip()])
            client["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(count))
        client.update(self.env)
        return client

    def start(self, timeout_s: float = 30.0) -> None:
        binary = shutil.which(self._control)
        if binary is None:
            raise MpsUnavailable(f"{self._control} is not on PATH: MPS needs the NVIDIA driver's utilities")
        os.makedirs(self.pipe_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        done = subprocess.run(
            [binary, "-d"], env={**os.environ, **self.env}, capture_output=True, text=True, timeout=timeout_s
        )
        if done.returncode != 0:
            why = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
            raise MpsUnavailable(f"{self._control} -d failed: {why}")
        self._started = True

    def stop(self, timeout_s: float = 30.0) -> None:
        """Asks the daemon to quit (it ends its server once the clients are gone). Idempotent."""
        if not self._started:
            return
        self._started = False
        binary = shutil.which(self._control) or self._control
        # Best effort: should it not answer, it has no clients left and its directories go with
        # the stack's run directory.
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(
                [binary], input="quit\n", env={**os.environ, **self.env}, capture_output=True, text=True,
                timeout=timeout_s,
            )  # fmt: skip

    def server_running(self) -> bool:
        """An MPS server is up (the daemon starts one for its first client)."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv0 = (entry / "cmdline").read_bytes().split(b"\0", 1)[0]
            except OSError:
                continue
            if argv0.endswith(b"nvidia-cuda-mps-server"):
                return True
        return False
