"""Which pass completes a ranking call that takes over a started pre-inference. Pure: no torch,
no clock.

A call whose pre-inference has built some chunks, but whose rest does not fit one step, takes it
over (scheduler.Relay.TAKE_OVER). Two passes can complete it, both exact, both leaving complete
psi in the pre-inference's block:
  * partial: read the built chunks, compute the rest of the prefix and the suffix eagerly
    (HSTURanker.rank_partial);
  * full: replay the full family's CUDA graph over the whole sequence, rewriting the built
    chunks' K/V with the same values (Engine._launch_takeover_full, as for a take-over of a
    pre-inference not started).
The partial pass computes fewer tokens, but it is an eager pass: its host launch is most of its
time. On an H200 (k13a, the ML-100K mix, prefixes of 10-12k tokens whose first graph step had
built 80-90%) partial passes took 11-27 ms, launch 8-28 ms, where a full ranking of the same
length replays in ~11 ms with ~2-3 ms of launch; the engine thread, busy with each, held every
ranking call behind it: the same calls, replayed at 337.5 req/s, took 30 ms more on average
than the baseline's in the 100 ms after one such take-over, the relay's worst window
(`python -m bench.calls RELAY --against BASELINE`). At 16384
tokens (k12b) partial passes took 11-14 ms against 19.5 for a full ranking: there they pay.
The graph's pass spends the built chunks' device time for nothing: it is counted as unused
pre-inference time (relaygr_ranker_unused_psi_device_seconds), not as another unused psi.

So the choice is measured: each partial pass's time against what the engine's ranking fit
predicts for full rankings of the same calls (an exponentially weighted ratio); a take-over
replays the full graph while partial passes measure dearer (ratio above 1). One take-over in
`sample_every` still runs partial so that the ratio stays measured (a lock-in otherwise: the
graph chosen forever on one dear sample). Before any partial pass is measured: partial (the
behaviour before this choice existed)."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["TakeoverPass", "TakeoverPassCollector", "TakeoverPolicy"]


class TakeoverPolicy(enum.StrEnum):
    MEASURED = "measured"  # the full graph while partial passes measure dearer (module docstring)
    PARTIAL = "partial"  # always the eager partial pass where chunks are built


class TakeoverPass:
    """The measured choice between the partial pass and the full graph (module docstring)."""

    def __init__(
        self, policy: TakeoverPolicy = TakeoverPolicy.MEASURED, sample_every: int = 8, memory: float = 8.0
    ) -> None:
        if sample_every < 1 or memory < 1:
            raise ValueError("sample_every and memory must be >= 1")
        self.policy = policy
        self.sample_every = sample_every
        self._keep = 1.0 - 1.0 / memory
        self._partial_s = 0.0
        self._full_s = 0.0
        self._asked = 0
        self.passes = {"partial": 0, "full": 0}  # take-overs of started pre-inferences, by pass

    def observe(self, partial_s: float, full_s: float) -> None:
        """A partial pass measured `partial_s` seconds where full rankings of the same calls are
        predicted to take `full_s`."""
        if not (partial_s > 0 and full_s > 0 and math.isfinite(partial_s) and math.isfinite(full_s)):
            return
        self._partial_s = self._partial_s * self._keep + partial_s
        self._full_s = self._full_s * self._keep + full_s

    @property
    def ratio(self) -> float:
        """Measured partial time over predicted full time (NaN before any partial pass)."""
        return self._partial_s / self._full_s if self._full_s > 0 else math.nan

    def wants_full(self) -> bool:
        """Whether this take-over (of a started pre-inference) should replay the full graph:
        partial passes measure dearer than full rankings of their calls (ratio above 1), except
        one take-over in `sample_every`. The caller reports the pass that ran (`ran`)."""
        self._asked += 1
        return (
            self.policy is TakeoverPolicy.MEASURED
            and self.ratio > 1.0  # False while NaN
            and self._asked % self.sample_every != 0
        )

    def ran(self, full: bool) -> None:
        """Counts a take-over of a started pre-inference under the pass that completed it."""
        self.passes["full" if full else "partial"] += 1


class TakeoverPassCollector(Collector):
    """Prometheus view of a TakeoverPass, read at scrape time."""

    def __init__(self, choice: TakeoverPass) -> None:
        self._choice = choice

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        passes = CounterMetricFamily(
            "relaygr_ranker_takeover_passes",
            "take-overs of started pre-inferences by the pass that completed them (partial: the "
            "eager pass over the rest; full: the full ranking's graph over the whole sequence)",
            labels=["pass"],
        )
        for name, count in dict(self._choice.passes).items():
            passes.add_metric([name], count)
        yield passes
        yield GaugeMetricFamily(
            "relaygr_ranker_partial_cost_ratio",
            "partial passes' measured time over the predicted time of full rankings of the same "
            "calls (above 1: take-overs replay the full graph; NaN until measured)",
            value=self._choice.ratio,
        )
