"""Reload-or-recompute: the cost model that decides how a psi found in host DRAM comes back.

Both sides are measured while running: reload time from observed host->device copies (bytes /
bandwidth + a fixed overhead); recompute time from the engine's own step-cost model when the
service attaches it (`step_ms`: the device time of building psi in the chunks the scheduler
plans, from steps measured at warm-up and since), else from observed pre-inferences, fitted as
a * tokens + b * tokens^2 (projections are linear in the prefix length, attention quadratic).
Before either, the estimates come from the model's FLOPs and an assumed device rate. The step
model comes first because it is the device's cost: an observed pre-inference also waited behind
ranking steps, and at one prefix length (every prefix 4096 tokens) the fit never forms, which left
the FLOPs estimate (3 ms at an assumed 200 TFLOP/s where an H100 step measures ~6.5 ms) judging
every reload dearer than a recompute: no reload was ever served.

The copy engine is preferred even at somewhat higher latency: a reload uses the copy engine, a
recompute takes the compute that ranking calls wait for (under load) or will come for while it
runs. Idle, a reload up to `idle_copy_preference` x the recompute still wins: at L4096 on an H100
(t1, 137.5 req/s) a 4k psi's reload measured 3.4-3.5 ms against a measured saving of 3.3-3.4, and
37 returning users were ranked in full (5 ms of device time each) to save 0.1 ms of latency.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from shared.modelspec import ModelSpec

COPY_OVERHEAD_MS = 0.2  # a reload's fixed cost beside its bytes, before any was measured
BUSY_COPY_PREFERENCE = 1.5  # under load, reload while reload_ms <= this x recompute_ms


@dataclass(frozen=True)
class ReloadDecision:
    reload: bool
    reload_ms: float
    recompute_ms: float
    reason: str  # "cheaper", "copy_engine_under_load", "recompute_cheaper"


@dataclass
class CostModel:
    spec: ModelSpec
    assumed_tflops: float  # effective device rate before any pre-inference was measured
    h2d_gbps: float  # host->device bandwidth before any reload was measured
    copy_overhead_ms: float = COPY_OVERHEAD_MS
    busy_copy_preference: float = BUSY_COPY_PREFERENCE
    idle_copy_preference: float = 1.25  # idle: while reload_ms <= 1.25 x recompute_ms ("cheaper")
    _preinfers: collections.deque[tuple[int, float]] = field(
        default_factory=lambda: collections.deque(maxlen=64)
    )
    _coef: tuple[float, float] | None = None
    # The engine's predicted device time of building psi of n tokens, in seconds (set by the
    # service once the engine has measured its steps; preferred to the fits above).
    step_s: Callable[[int], float] | None = None

    def observe_reload(self, nbytes: int, ms: float) -> None:
        if nbytes > 0 and ms > self.copy_overhead_ms:
            measured = nbytes / ((ms - self.copy_overhead_ms) * 1e-3) / 1e9
            self.h2d_gbps = 0.8 * self.h2d_gbps + 0.2 * measured

    def observe_preinfer(self, tokens: int, ms: float) -> None:
        if tokens <= 0 or ms <= 0:
            return
        self._preinfers.append((tokens, ms))
        if len({t for t, _ in self._preinfers}) >= 2:
            t = np.array([p[0] for p in self._preinfers], dtype=np.float64)
            y = np.array([p[1] for p in self._preinfers], dtype=np.float64)
            (a, b), *_ = np.linalg.lstsq(np.stack([t, t * t], axis=1), y, rcond=None)
            self._coef = (max(float(a), 0.0), max(float(b), 0.0))

    def reload_ms(self, nbytes: int) -> float:
        return self.copy_overhead_ms + nbytes / (self.h2d_gbps * 1e9) * 1e3

    def recompute_ms(self, tokens: int) -> float:
        if self.step_s is not None:
            return self.step_s(tokens) * 1e3
        if self._coef is not None:
            a, b = self._coef
            return a * tokens + b * tokens * tokens
        s = self.spec
        attention = s.num_layers * s.num_heads * 2 * s.head_dim * tokens * tokens  # causal: half of 4*D
        flops = tokens * s.linear_flops_per_token() + attention
        return flops / (self.assumed_tflops * 1e12) * 1e3

    def may_reload(self, nbytes: int, saving_ms: float) -> bool:
        """Whether `choose` could ever reload `nbytes` of psi whose reload saves a call
        `saving_ms` of device time: under load, at the most it prefers the copy engine. psi for
        which it could not is not worth copying to host DRAM: no call would take it back (on one
        H200, k25b, the length mix: ~660- and ~1600-token psi, 0.6 and 1.2 ms of copy against
        0.2 and 0.8 ms saved)."""
        return self.reload_ms(nbytes) <= self.busy_copy_preference * saving_ms

    def choose(
        self, nbytes: int, tokens: int, compute_busy: bool, recompute_ms: float | None = None
    ) -> ReloadDecision:
        """Reload `nbytes` of psi or recompute its `tokens`; `recompute_ms`, when given, is the
        caller's own measure of the device time a reload saves (else the step model's)."""
        reload_ms = self.reload_ms(nbytes)
        if recompute_ms is None:
            recompute_ms = self.recompute_ms(tokens)
        if reload_ms <= self.idle_copy_preference * recompute_ms:
            return ReloadDecision(True, reload_ms, recompute_ms, "cheaper")
        if compute_busy and reload_ms <= self.busy_copy_preference * recompute_ms:
            return ReloadDecision(True, reload_ms, recompute_ms, "copy_engine_under_load")
        return ReloadDecision(False, reload_ms, recompute_ms, "recompute_cheaper")
