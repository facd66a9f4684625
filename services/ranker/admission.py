"""Admission control for Rank: a bound on the ranking calls one instance holds (queued + running),
derived from the throughput the instance actually delivers. Pure: no I/O, the clock is passed in.

Little's law: calls in flight = throughput x time in flight. An instance serving `mu` calls/s
that holds n calls finishes a new one after about (n + 1) / mu. So a call is refused at once
(the caller, or the router, can try elsewhere) instead of waiting in a queue it would time out in:
  * deadline  when (n + 1) / mu exceeds `deadline_fraction` of the call's remaining deadline (the
              rest is margin: mu is an average, batches and prefix lengths vary);
  * limit     when n reaches mu x target_s, whatever the deadline: the bound on calls held (and
              on their memory) for callers with long deadlines or none.
The deadline check is what refuses under overload (callers set deadlines, the router passes them
on); the limit keeps queues bounded. A burst that fits its callers' deadlines is admitted: the
target is seconds of queued work, not a latency goal, since an instance that serves 3 calls/s
(long prefixes on a busy CPU) must still take 8 calls from callers who wait a minute.

`mu` is measured, not modelled: completed calls per second of *busy* time (time with at least
one call in flight), exponentially weighted over the last `window_s` of busy time. Measuring
realized completions catches what a model of the engine's batch times misses (GIL and CPU
contention, pre-inference sharing the device, time spent outside the engine). Busy time, not wall
time, so that a lightly loaded instance does not read its low arrival rate as low capacity; for
the same reason idle time does not age the estimate (an instance idle for an hour still knows its
rate). A latency-gradient limit (service time vs. its minimum) is not used because a ranking
call's cost varies ~100x with its path (an HBM hit vs. a full recompute of a long prefix): a burst
of long prefixes is not congestion.

The estimate starts from a prior worth `prior_calls` completed calls at `prior_rps`; it decays
like every measurement. A prior
rather than "no limit until measured": an instance that starts out overloaded never completes a
call within its callers' deadlines, and without a prior it would never get a first measurement;
with one, busy time without completions drives the estimate (and the limit) down.

Both checks are O(1), and neither refuses while nothing is in flight (an idle instance cannot shed
load by refusing, and its next call is what updates an estimate that may be stale: without it an
instance that measured itself slow in a transient would refuse every call for ever). With
target_s = 0 admission is off but for the hard cap `max_limit` (throughput is still measured).

`shedding()` is true for `shed_s` after a refusal: the ranker then refuses pre-inference too.
Pre-inference competes with ranking for the same device, and the psi it would produce is for a
ranking call that is itself likely to be refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionConfig:
    target_s: float = 5.0  # limit = measured calls/s x this; 0: no adaptive admission
    deadline_fraction: float = 0.5  # admitted only if expected time in flight <= this x deadline left
    min_limit: int = 1
    max_limit: int = 256  # the hard cap, adaptive or not
    prior_rps: float = 16.0  # calls/s assumed before any is measured
    window_s: float = 2.0  # time constant of the throughput estimate
    prior_calls: float = 8.0  # weight of the prior estimate, in completed calls
    shed_s: float = 1.0  # how long after a refusal `shedding()` holds; 0: never

    def __post_init__(self) -> None:
        if self.target_s < 0:
            raise ValueError("target_s must be >= 0")
        if not 0 < self.deadline_fraction <= 1:
            raise ValueError("deadline_fraction must be within (0, 1]")
        if not 1 <= self.min_limit <= self.max_limit:
            raise ValueError("min_limit must be >= 1 and <= max_limit")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")
        if self.prior_rps <= 0:
            raise ValueError("prior_rps must be > 0")
        if self.prior_calls < 0:
            raise ValueError("prior_calls must be >= 0")
        if self.shed_s < 0:
            raise ValueError("shed_s must be >= 0")


@dataclass(frozen=True)
class Refusal:
    """Why a call was not admitted: `kind` is "limit" or "deadline" (a metric label), `reason`
    the RESOURCE_EXHAUSTED detail."""

    kind: str
    reason: str


class AdmissionLimiter:
    """Counts ranking calls in flight and decides admission. Not thread-safe: use it from the
    event loop only. Every `try_acquire` that returns None must be paired with one `release`."""

    def __init__(self, config: AdmissionConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self._clock = clock
        self.inflight = 0
        self.admitted = 0
        self.refused = {"limit": 0, "deadline": 0}
        self._done = 0.0  # served calls, exponentially weighted
        self._busy_s = 0.0  # busy seconds, same weighting
        if config.target_s > 0 and config.prior_calls > 0:
            self._done = config.prior_calls
            self._busy_s = config.prior_calls / config.prior_rps
        self._last = clock()
        self._refused_at = float("-inf")

    # ------------------------------------------------------------------ measurement

    def _advance(self) -> None:
        """Accounts the interval since the last event: busy when a call was in flight, and then
        the weighted counts decay over it (busy time gains the exact integral of the weight)."""
        now = self._clock()
        dt = max(0.0, now - self._last)
        self._last = now
        if dt == 0.0 or self.inflight == 0:
            return
        decay = math.exp(-dt / self.config.window_s)
        self._done *= decay
        self._busy_s = self._busy_s * decay + self.config.window_s * (1.0 - decay)

    @property
    def throughput(self) -> float | None:
        """Measured calls/s while busy, as of the last admission or release (the prior until
        calls complete); None when there is neither."""
        if self._busy_s <= 0.0:
            return None
        return self._done / self._busy_s

    @property
    def limit(self) -> int:
        c = self.config
        if c.target_s == 0:
            return c.max_limit
        mu = self.throughput
        if mu is None:  # no prior (prior_calls = 0) and nothing measured yet
            mu = c.prior_rps
        # ceil: one call past the exact bound costs at most one service time over the target,
        # while rounding down could keep the engine from ever forming a batch of two.
        return max(c.min_limit, min(c.max_limit, math.ceil(mu * c.target_s)))

    def shedding(self) -> bool:
        """A call was refused within the last shed_s: the instance is overloaded."""
        return self._clock() - self._refused_at < self.config.shed_s

    # ------------------------------------------------------------------ admission

    def try_acquire(self, remaining_s: float | None = None) -> Refusal | None:
        """Admits a call (None; it now counts as in flight) or says why not. `remaining_s` is the
        call's remaining deadline, None when it has none."""
        self._advance()
        limit = self.limit
        if self.inflight >= limit:
            self.refused["limit"] += 1
            self._refused_at = self._last
            return Refusal("limit", f"overloaded: {self.inflight} ranking calls in flight, limit {limit}")
        mu = self.throughput
        if remaining_s is not None and mu is not None and self.config.target_s > 0 and self.inflight > 0:
            expected_s = (self.inflight + 1) / mu
            if expected_s > self.config.deadline_fraction * remaining_s:
                self.refused["deadline"] += 1
                self._refused_at = self._last
                return Refusal(
                    "deadline",
                    f"overloaded: {self.inflight} ranking calls in flight at {mu:.1f} calls/s, ~{expected_s * 1e3:.0f} "
                    f"ms to answer, the call has {max(remaining_s, 0.0) * 1e3:.0f} ms left",
                )
        self.inflight += 1
        self.admitted += 1
        return None

    def release(self, served: bool) -> None:
        """An admitted call left. `served`: it was answered with scores (only those count as
        throughput; a call cancelled or failed half-way took busy time and delivered nothing)."""
        if self.inflight <= 0:
            raise RuntimeError("release without a matching try_acquire")
        self._advance()
        self.inflight -= 1
        if served:
            self._done += 1.0
