"""Where a psi copy's time goes between its request and its caller being told it is done.

A call that reloads its psi from host DRAM waited 17 ms for it on average on an H200 (L4096, h3b:
`cache_ms` of dram_reload calls, 38 ms at p99), for a copy of ~2.5 ms; every call over the SLO at
237.5 req/s was such a call. The stages, per copy, by kind of copy ("reload", "demote", "copy"):

  issue        queued on the device loop until the loop issued it (the loop was launching,
               waiting for a batch's scores, ...);
  device_wait  issued until its copy stream could start it (a reload's stream first waits for the
               compute queued ahead of it: its block comes from the compute stream's pool); timed
               for reloads only (a timing event more per copy), 0 elsewhere and off CUDA;
  copy         the copy itself (device time; off CUDA its wall time);
  settle       done on the device until the loop saw it and told the caller.

    relaygr_ranker_copy_stage_seconds_total{work="...", stage="..."}
    relaygr_ranker_copies_timed_total{work="..."}

The caller's own time before the request (the host tier's lookup RPC) is not in here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

STAGES = ("issue", "device_wait", "copy", "settle")


class CopyStages:
    """Cumulative seconds by (work, stage) and copies timed by work. Written by the device loop,
    read by the metrics thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[tuple[str, str], float] = {}
        self._copies: dict[str, int] = {}

    def add(self, work: str, issue_s: float, device_wait_s: float, copy_s: float, settle_s: float) -> None:
        """One copy's stages (negative readings, from clocks read in another order, count as 0)."""
        with self._lock:
            for stage, seconds in zip(STAGES, (issue_s, device_wait_s, copy_s, settle_s), strict=True):
                self._seconds[work, stage] = self._seconds.get((work, stage), 0.0) + max(0.0, seconds)
            self._copies[work] = self._copies.get(work, 0) + 1

    def snapshot(self) -> tuple[dict[tuple[str, str], float], dict[str, int]]:
        with self._lock:
            return dict(self._seconds), dict(self._copies)

    def mean_ms(self, work: str) -> dict[str, float]:
        """Per stage, the mean over the copies of `work` so far (ms; {} before any)."""
        seconds, copies = self.snapshot()
        n = copies.get(work, 0)
        return {stage: seconds.get((work, stage), 0.0) / n * 1e3 for stage in STAGES} if n else {}


class CopyStagesCollector(Collector):
    """Prometheus view of a CopyStages, read at scrape time."""

    def __init__(self, stages: CopyStages) -> None:
        self._stages = stages

    def collect(self) -> Iterator[CounterMetricFamily]:
        seconds, copies = self._stages.snapshot()
        by_stage = CounterMetricFamily(
            "relaygr_ranker_copy_stage_seconds",
            "psi copies: seconds by kind of copy and stage (queued, waiting on the device, copying, "
            "until the caller was told)",
            labels=["work", "stage"],
        )
        for (work, stage), value in sorted(seconds.items()):
            by_stage.add_metric([work, stage], value)
        yield by_stage
        timed = CounterMetricFamily(
            "relaygr_ranker_copies_timed", "psi copies timed by stage", labels=["work"]
        )
        for work, n in sorted(copies.items()):
            timed.add_metric([work], n)
        yield timed
