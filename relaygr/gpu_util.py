"""The GPUs' utilisation over a benchmark point, as the driver counts it (nvidia-smi).

The rankers' own busy time (services/ranker/device_time.py) is what each process's events
bracket: where two processes share a GPU (rankers_per_device 2, with or without MPS) their busy
times add up, and overlapping work is counted twice (h5a: "busy 1.10" at L4096). nvidia-smi's
`utilization.gpu` is the share of each sample period in which one or more kernels ran, from any
process: the union, the one clock that says whether the GPU itself is full.

One `nvidia-smi --query-gpu ... --loop-ms=N` process samples while a point runs (line-buffered
through stdbuf where there is one, its lines read as they come, stopped with SIGINT as its loop
expects). Where there is no nvidia-smi (the CPU, an NPU host) nothing is sampled.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from collections import defaultdict

COMMAND = "nvidia-smi"


def parse_samples(text: str) -> dict[int, list[float]]:
    """nvidia-smi's `index, utilization.gpu` CSV lines (no header, no units) as fractions per
    GPU index; lines that are not two numbers ("[N/A]", a warning) are skipped."""
    out: dict[int, list[float]] = defaultdict(list)
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 2:
            continue
        try:
            index, percent = int(fields[0]), float(fields[1])
        except ValueError:
            continue
        if 0.0 <= percent <= 100.0:
            out[index].append(percent / 100.0)
    return dict(out)


def physical_index(cuda_index: int, visible: str | None = None) -> int:
    """The nvidia-smi index of CUDA device `cuda_index` in a process that sees CUDA_VISIBLE_DEVICES
    `visible` (this process's when None): the list's entry where it names GPUs by number."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if not visible:
        return cuda_index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if cuda_index < len(entries) and entries[cuda_index].isdigit():
        return int(entries[cuda_index])
    return cuda_index  # UUIDs or MIG names: not mapped


class GpuUtilization:
    """Samples every GPU's utilisation while started (a context manager, or start / stop)."""

    def __init__(self, interval_ms: int = 100, command: str = COMMAND) -> None:
        if interval_ms < 10:
            raise ValueError("interval_ms must be >= 10")
        self.interval_ms = interval_ms
        self._command = command
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._lines: list[str] = []

    def start(self) -> bool:
        """Starts sampling; False where there is no nvidia-smi to run."""
        binary = shutil.which(self._command)
        if binary is None or self._proc is not None:
            return binary is not None
        argv = [binary, "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits",
                f"--loop-ms={self.interval_ms}"]  # fmt: skip
        stdbuf = shutil.which("stdbuf")
        if stdbuf is not None:  # a pipe would otherwise get nvidia-smi's output in 4 KiB blocks
            argv = [stdbuf, "-oL", *argv]
        self._lines = []
        self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, args=(self._proc,), name="gpu-util", daemon=True)
        self._reader.start()
        return True

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._lines.append(line)

    def stop(self) -> dict[int, float]:
        """Stops sampling: the mean utilisation (0-1) per GPU index over the samples ({} if none)."""
        proc, self._proc = self._proc, None
        reader, self._reader = self._reader, None
        if proc is None:
            return {}
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # nvidia-smi's loop ends on Ctrl-C
            try:
                proc.wait(timeout=3.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if reader is not None:
            reader.join(timeout=3.0)
        return {i: sum(v) / len(v) for i, v in parse_samples("".join(self._lines)).items() if v}

    def __enter__(self) -> GpuUtilization:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
