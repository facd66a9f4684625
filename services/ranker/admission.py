"""Admission control for Rank: a bound on the predicted work one instance holds (queued + running),
in seconds of engine time, from the costs the instance measures. Pure: no I/O, the clock is passed in.

A ranking call's cost varies ~100x with its path and length: against psi it computes its suffix
(tens of tokens, milliseconds), a full recompute its whole prefix (thousands of tokens, and
attention quadratic in them: seconds on a CPU). So calls are weighed by their predicted cost
(services/ranker/call_cost.py: per-batch, per-token and per-pair costs fitted to the engine's own
measured batches), not counted. Each call is predicted before it is decoded, from the sizes of its
fields: suffix tokens when it names its prefix by reference (the router does so when it knows
the psi resident), prefix + suffix tokens otherwise. The engine runs calls in arrival order, so a
call admitted now completes after about W + w, W the predicted work in flight and w its own.
A call is refused at once (the caller, or the router, can try elsewhere) instead of waiting in a
queue it would time out in:
  * deadline  when d x (W + w) exceeds `deadline_fraction` of the call's remaining deadline (the
              rest is margin: predictions are averages). d is the measured drain factor below.
              This holds on an idle instance too, as w alone: a call that by itself would outlive
              its deadline is refused with its reason instead of taking the engine for nothing;
  * work      when W + w exceeds `target_s` while at least `min_limit` calls are in flight: the
              bound on work held for callers with long deadlines or none (below min_limit calls
              a burst of a few batches is admitted whatever the prediction says);
  * limit     when `max_limit` calls are in flight, whatever their cost (the hard cap on calls
              held, and on their memory);
  * late      after admission, when the call is still waiting for the engine once its queue
              budget has run out (below).
The deadline check is what refuses under overload (callers set deadlines, the router passes them
on). With target_s = 0 only the hard cap applies.

An admitted call is a promise: done within `deadline_fraction` of its remaining deadline. The
promise holds only while the instance runs at the speed admission measured, and on a shared CPU
it does not: another process takes the cores and batches run 2-10 x slower for a second or more
(measured with the overload scenario, bench/faults.py: the slowest served calls had waited
300-950 ms in the engine queue behind batches that took several times their prediction). So each
admitted call also gets a queue budget, the longest it may wait for the engine and still keep the
promise at the measured speed (`Admitted.queue_budget_s`: deadline_fraction x remaining - d x w).
The engine refuses a call still waiting when its budget has run out (`late`): RESOURCE_EXHAUSTED
while the caller has half its deadline left to try elsewhere, instead of scores at the deadline.
Queueing delay stays bounded by the promise whatever the instance's speed does, as CoDel bounds a
router's queue: the queue is what a slowdown makes long, and waiting in it is what is cut.

Prediction errors: the cost model is refitted on every measured batch, so a slower instance
(CPU contention, a larger model) is seen within a few batches. The prior (before any batch is
measured) has no quadratic cost, so long calls are admitted until one has been measured. A call
refused for its own length is one the instance measured as too long for that deadline; shorter
calls keep being admitted and keep the fit current.

What batch times miss (the event loop's decoding and replies, GIL and CPU contention between the
engine threads, work admitted and then abandoned by its caller) is measured as the drain factor
d: busy seconds (time with a call in flight) per predicted second of *served* work, weighted
exponentially over the last `window_s` of busy time, starting from 1 worth `prior_s` busy
seconds. A call cancelled half-way took busy time and delivered nothing, so it raises d: an
instance whose admitted calls time out admits less. Idle time does not age it. On an idle
instance d fades towards 1 with the time spent idle (time constant `window_s`, here in wall
seconds): right after a busy spell it still says how slowly the instance drains (a call admitted
into a 2x-slow instance by a 1x prediction was measured to take 968 ms), and a stale d does not
refuse every call for ever (the next admitted call is what updates it).

`throughput` (served calls per second of busy time, exponentially weighted over `window_s` of busy
time) is reported as a metric; admission does not use it.

`shedding()` is true for `shed_s` after a refusal: the ranker then refuses pre-inference too.
Pre-inference competes with ranking for the same device, and the psi it would produce is for a
ranking call that is itself likely to be refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from services.ranker.call_cost import CallWork, CostFit, CostPrior


@dataclass(frozen=True)
class AdmissionConfig:
    target_s: float = 5.0  # bound on predicted work in flight, engine seconds; 0: hard cap only
    deadline_fraction: float = 0.5  # admitted only if predicted completion <= this x deadline left
    min_limit: int = 1  # below this many calls in flight the work bound does not refuse
    max_limit: int = 256  # the hard cap on calls in flight
    window_s: float = 2.0  # time constant of the drain factor and the throughput, in busy seconds
    prior_s: float = 1.0  # weight of the prior drain factor (1), in busy seconds
    shed_s: float = 1.0  # how long after a refusal `shedding()` holds; 0: never
    prior: CostPrior = field(default_factory=CostPrior)

    def __post_init__(self) -> None:
        if self.target_s < 0:
            raise ValueError("target_s must be >= 0")
        if not 0 < self.deadline_fraction <= 1:
            raise ValueError("deadline_fraction must be within (0, 1]")
        if not 1 <= self.min_limit <= self.max_limit:
            raise ValueError("min_limit must be >= 1 and <= max_limit")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")
        if self.prior_s < 0:
            raise ValueError("prior_s must be >= 0")
        if self.shed_s < 0:
            raise ValueError("shed_s must be >= 0")


@dataclass(frozen=True)
class Refusal:
    """Why a call was not admitted: `kind` is "limit", "work", "deadline" or "late" (a metric label),
    `reason` the RESOURCE_EXHAUSTED detail."""

    kind: str
    reason: str


@dataclass(frozen=True)
class Admitted:
    """An admitted call: hand it back to `release`. `work_s`: its predicted engine seconds.
    `queue_budget_s`: how long it may wait for the engine to start it and still complete within
    its promise (deadline_fraction of its remaining deadline) at the measured drain factor; None
    when it has no deadline or only the hard cap applies."""

    work: CallWork
    work_s: float
    queue_budget_s: float | None = None


class AdmissionLimiter:
    """Holds the ranking calls in flight and their predicted work, and decides admission. Not
    thread-safe: use it from the event loop only. Every `Admitted` from `try_acquire` must be
    passed to `release` exactly once."""

    def __init__(self, config: AdmissionConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.costs = CostFit(config.prior)
        self._clock = clock
        self.inflight = 0
        self.inflight_work_s = 0.0  # predicted engine seconds of the calls in flight
        self.admitted = 0
        self.refused = {"limit": 0, "work": 0, "deadline": 0, "late": 0}
        self._done = 0.0  # served calls, exponentially weighted
        self._busy_s = 0.0  # busy seconds, same weighting
        # The drain factor's terms: busy seconds and predicted seconds of served calls, prior first.
        self._drain_busy_s = config.prior_s
        self._drain_done_s = config.prior_s
        self._last = clock()
        self._idle_since = self._last  # when the last call in flight left
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
        self._drain_done_s *= decay
        gained = self.config.window_s * (1.0 - decay)
        self._busy_s = self._busy_s * decay + gained
        self._drain_busy_s = self._drain_busy_s * decay + gained

    @property
    def throughput(self) -> float | None:
        """Measured served calls/s while busy, as of the last admission or release; None before
        any busy time. A metric only."""
        if self._busy_s <= 0.0:
            return None
        return self._done / self._busy_s

    @property
    def drain_factor(self) -> float:
        """Measured busy seconds per predicted second of served work (1 before measurements)."""
        if self._drain_done_s <= 1e-9 * self._drain_busy_s:
            return 1e9  # busy for many windows with nothing served
        return self._drain_busy_s / self._drain_done_s

    def _applied_drain(self) -> float:
        """The drain factor a new call is judged by: d while calls are in flight; on an idle
        instance d fading towards 1 with the idle time (see the module)."""
        d = self.drain_factor
        if self.inflight:
            return d
        idle_s = max(0.0, self._last - self._idle_since)
        return 1.0 + (d - 1.0) * math.exp(-idle_s / self.config.window_s)

    @property
    def limit(self) -> int:
        """The hard cap on calls in flight."""
        return self.config.max_limit

    def shedding(self) -> bool:
        """A call was refused within the last shed_s: the instance is overloaded."""
        return self._clock() - self._refused_at < self.config.shed_s

    # ------------------------------------------------------------------ admission

    def _refuse(self, kind: str, reason: str) -> Refusal:
        self.refused[kind] += 1
        self._refused_at = self._last
        return Refusal(kind, reason)

    def try_acquire(self, work: CallWork, remaining_s: float | None = None) -> Admitted | Refusal:
        """Admits a call (it now counts as in flight) or says why not. `work`: what the call will
        compute; `remaining_s`: its remaining deadline, None when it has none."""
        self._advance()
        c = self.config
        if self.inflight >= c.max_limit:
            return self._refuse(
                "limit", f"overloaded: {self.inflight} ranking calls in flight, limit {c.max_limit}"
            )
        work_s = self.costs.seconds(work)
        budget_s: float | None = None
        if c.target_s > 0:
            drain = self._applied_drain()
            expected_s = drain * (self.inflight_work_s + work_s)
            ahead = f"{self.inflight} ranking calls in flight ({self.inflight_work_s * 1e3:.0f} ms of predicted work)"
            own = f"this call's {work.describe()} ({work_s * 1e3:.0f} ms)"
            if remaining_s is not None and expected_s > c.deadline_fraction * remaining_s:
                return self._refuse(
                    "deadline",
                    f"overloaded: {ahead} + {own}, drained at x{drain:.2f}: ~{expected_s * 1e3:.0f} ms to "
                    f"answer, the call has "
                    f"{max(remaining_s, 0.0) * 1e3:.0f} ms left",
                )
            if self.inflight >= c.min_limit and self.inflight_work_s + work_s > c.target_s:
                return self._refuse(
                    "work", f"overloaded: {ahead} + {own} exceed the bound of {c.target_s * 1e3:.0f} ms"
                )
            if remaining_s is not None:
                # >= d x W >= 0: the deadline check passed.
                budget_s = c.deadline_fraction * remaining_s - drain * work_s
        self.inflight += 1
        self.inflight_work_s += work_s
        self.admitted += 1
        return Admitted(work, work_s, budget_s)

    def late(self, admitted: Admitted, waited_s: float) -> Refusal:
        """An admitted call that waited `waited_s` for the engine, past its queue budget, and was
        not started: a refusal after the fact (counted, and `shedding()` holds). The call is
        still in flight: `release` it (served=False) as every admitted call."""
        self._advance()
        budget_ms = (admitted.queue_budget_s or 0.0) * 1e3
        return self._refuse(
            "late",
            f"overloaded: waited {waited_s * 1e3:.0f} ms for the engine, past the {budget_ms:.0f} ms "
            f"its admission allowed for {admitted.work.describe()} (the instance drains slower than "
            f"measured)",
        )

    def release(self, admitted: Admitted, served: bool) -> None:
        """An admitted call left. `served`: it was answered with scores (only those count as
        throughput; a call cancelled or failed half-way took busy time and delivered nothing)."""
        if self.inflight <= 0:
            raise RuntimeError("release without a matching try_acquire")
        self._advance()
        self.inflight -= 1
        if not self.inflight:
            self._idle_since = self._last
        # Exactly 0 when nothing is left: float sums must not drift into phantom work.
        self.inflight_work_s = max(0.0, self.inflight_work_s - admitted.work_s) if self.inflight else 0.0
        if served:
            self._done += 1.0
            self._drain_done_s += admitted.work_s
