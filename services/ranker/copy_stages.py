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
  settle       done on the device until the caller was told: by the copy watcher for reloads
               on CUDA (copy_watch.py), else when the loop next polled its copies.

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

# A ranking call's reload from host DRAM, from its miss to the call resuming with psi
# (services/ranker/relay_cache.py), by stage:
#   spawn    the reload decided until its task ran on the event loop;
#   acquire  the expander's acquire round trip (the arena lease on the psi's bytes);
#   copy     the copy, as the engine ran it (split further by the copy stages above);
#   store    the copy done until psi was in the cache and its waiters told;
#   wake     told until the waiting call ran again.
RELOAD_PATH_STAGES = ("spawn", "acquire", "copy", "store", "wake")


class CopyStages:
    """Cumulative seconds by (work, stage) and copies timed by work. Written by the device loop,
    read by the metrics thread. `stages`: the stage names, in the order add() takes them."""

    def __init__(self, stages: tuple[str, ...] = STAGES) -> None:
        self.stages = stages
        self._lock = threading.Lock()
        self._seconds: dict[tuple[str, str], float] = {}
        self._copies: dict[str, int] = {}

    def add(self, work: str, *seconds_by_stage: float) -> None:
        """One copy's seconds in each stage, in `stages` order (negative readings, from clocks
        read in another order, count as 0)."""
        if len(seconds_by_stage) != len(self.stages):
            raise ValueError(f"{len(self.stages)} stages, {len(seconds_by_stage)} readings")
        with self._lock:
            for stage, seconds in zip(self.stages, seconds_by_stage, strict=True):
                self._seconds[work, stage] = self._seconds.get((work, stage), 0.0) + max(0.0, seconds)
            self._copies[work] = self._copies.get(work, 0) + 1

    def snapshot(self) -> tuple[dict[tuple[str, str], float], dict[str, int]]:
        with self._lock:
            return dict(self._seconds), dict(self._copies)

    def mean_ms(self, work: str) -> dict[str, float]:
        """Per stage, the mean over the copies of `work` so far (ms; {} before any)."""
        seconds, copies = self.snapshot()
        n = copies.get(work, 0)
        return {stage: seconds.get((work, stage), 0.0) / n * 1e3 for stage in self.stages} if n else {}


class CopyStagesCollector(Collector):
    """Prometheus view of a CopyStages, read at scrape time: `<seconds_name>_total{work,stage}`
    and `<timed_name>_total{work}` (by default the copy stages' names)."""

    def __init__(
        self,
        stages: CopyStages,
        seconds_name: str = "relaygr_ranker_copy_stage_seconds",
        timed_name: str = "relaygr_ranker_copies_timed",
        what: str = "psi copies",
    ) -> None:
        self._stages = stages
        self._seconds_name = seconds_name
        self._timed_name = timed_name
        self._what = what

    def collect(self) -> Iterator[CounterMetricFamily]:
        seconds, copies = self._stages.snapshot()
        by_stage = CounterMetricFamily(
            self._seconds_name,
            f"{self._what}: seconds by kind and stage ({', '.join(self._stages.stages)})",
            labels=["work", "stage"],
        )
        for (work, stage), value in sorted(seconds.items()):
            by_stage.add_metric([work, stage], value)
        yield by_stage
        timed = CounterMetricFamily(self._timed_name, f"{self._what} timed by stage", labels=["work"])
        for work, n in sorted(copies.items()):
            timed.add_metric([work], n)
        yield timed
