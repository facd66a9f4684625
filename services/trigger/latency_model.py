"""Predicted full-ranking latency of a request, calibrated from the rankers' own measurements.

Full ranking of n tokens costs about a + b*n + c*n^2 ms on an instance (projections are linear in
n, attention quadratic). The coefficients are refitted by least squares from the batches each
ranker reports in Stats (LatencySample: tokens per request, compute ms), so the model follows the
real device, batch behaviour and load; samples far off a first fit, relative to its prediction,
are dropped before the final one (stalls, contention bursts). Before any sample exists it uses the
model's FLOPs at an assumed device rate. A request also waits behind the instance's queue:
`predict` adds queue_depth x the latency of an average queued request.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.modelspec import ModelSpec

OUTLIER_MEDIANS = 3.0  # a sample is an outlier beyond this many median relative residuals ...
MIN_OUTLIER_RATIO = 0.5  # ... and beyond +-50% of the prediction
GROSS_OUTLIER_RATIO = 4.0  # off a robust first fit by more than 4x its prediction: dropped first
# Every non-empty subset of the terms (intercept, linear, quadratic), for the non-negative fit.
_TERM_SUBSETS = [list(t) for k in (1, 2, 3) for t in itertools.combinations(range(3), k)]


@dataclass(frozen=True)
class Sample:
    tokens: int  # tokens computed per request (full ranking: prefix + suffix)
    compute_ms: float


# A fit on fewer samples than this is redone on every new one whatever refit_interval_s says:
# it is cheap then, and it is what new samples change most (a trigger that had just calibrated on
# a ranker's warm-up and waited a second to refit judged a 20-token request by that first fit,
# under CI load: the integration test of risk admission failed on it).
REFIT_EVERY_SAMPLE_BELOW = 32


@dataclass
class LatencyModel:
    spec: ModelSpec
    assumed_tflops: float
    window: int = 512
    _samples: collections.deque[Sample] = field(default_factory=collections.deque)
    _coef: tuple[float, float, float] | None = None
    kept: int = 0  # samples the last fit used (the rest were judged outliers)
    prior_scale: float = 1.0  # measured / FLOPs prior, from the samples before calibration
    # Once calibrated, refit at most this often (seconds; 0: on every new sample). A refit with
    # its outlier passes is ~50 least-squares solves: run on every Stats poll it held the
    # trigger's event loop 20-35 ms at a time on a GPU host, delaying the signals behind it.
    refit_interval_s: float = 0.0
    _fitted_at: float = float("-inf")

    def __post_init__(self) -> None:
        self._samples = collections.deque(maxlen=self.window)

    @property
    def measured(self) -> bool:
        """True once any sample arrived (the prior is scaled to them from then on)."""
        return bool(self._samples)

    @property
    def sample_count(self) -> int:
        """Samples held (the window's)."""
        return len(self._samples)

    @property
    def calibrated(self) -> bool:
        return self._coef is not None

    def observe(self, samples: list[Sample]) -> None:
        """Adds measured full-ranking samples and refits (needs >= 3 distinct lengths). Until then
        the FLOPs prior is scaled to the samples there are (a ranker reports the full ranking it
        measures at warm-up): the assumed device rate can be off by 10x either way (a CPU at its
        first request, a GPU whose time is host-bound), and a request far over the SLO must not
        be judged safe because the prior was optimistic."""
        fresh = [s for s in samples if s.tokens > 0 and s.compute_ms > 0]
        if not fresh:
            return  # nothing new: the fit stands (refitting costs milliseconds per Stats poll)
        self._samples.extend(fresh)
        lengths = {s.tokens for s in self._samples}
        if len(lengths) < 3:
            if self._samples:
                # The median: the majority's scale (a regime that changed is followed; the trigger
                # does not price pre-inference by the first few samples, which can be compiles).
                ratios = sorted(s.compute_ms / self._flops_ms(s.tokens) for s in self._samples)
                self.prior_scale = ratios[len(ratios) // 2]
            return
        now = time.monotonic()
        if (
            self._coef is not None
            and len(self._samples) >= REFIT_EVERY_SAMPLE_BELOW
            and now - self._fitted_at < self.refit_interval_s
        ):
            return  # kept in the window: the next refit counts them
        self._fitted_at = now
        n = np.array([s.tokens for s in self._samples], dtype=np.float64)
        y = np.array([s.compute_ms for s in self._samples], dtype=np.float64)
        # Gross outliers first, judged against a robust fit (least absolute deviations): a
        # least-squares fit was dragged by a few stalls seconds long among ~10 ms samples (a fresh
        # ranker's first compiles), every residual then looked alike, none was judged an outlier,
        # and the model predicted 20-200x the real cost: the trigger, pricing pre-inference by it,
        # stopped admitting any, so no new sample ever corrected it (a GPU run on the length mix).
        # (Only when some sample is off the least-squares fit by more than its prediction: the
        # robust fit costs several least-squares ones, and timing noise alone stays within that.)
        coef = self._fit(n, y)
        if self._max_relative_residual(n, y, coef) > 1.0:
            sane = self._within(n, y, self._fit_lad(n, y), GROSS_OUTLIER_RATIO)
            if sane.sum() >= 3 and len(set(n[sane].tolist())) >= 3 and not sane.all():
                n, y = n[sane], y[sane]
                coef = self._fit(n, y)
        # One refit without outliers (a stalled batch, a burst of contention): they would drag
        # every prediction up and make the trigger admit requests that are not at risk. Residuals
        # are judged relative to the prediction: timing noise grows with the batch's cost, and an
        # absolute bound set by the many short requests would discard the few long ones, the very
        # measurements the at-risk decision rests on.
        keep = self._within(n, y, coef, MIN_OUTLIER_RATIO)
        self.kept = int(keep.sum())
        if self.kept >= 3 and not keep.all() and len(set(n[keep].tolist())) >= 3:
            coef = self._fit(n[keep], y[keep])
        else:
            self.kept = len(y)
        self._coef = coef

    @staticmethod
    def _within(
        n: np.ndarray, y: np.ndarray, coef: tuple[float, float, float], min_ratio: float
    ) -> np.ndarray:
        """The samples that are not outliers of this fit: within OUTLIER_MEDIANS median relative
        residuals, or within `min_ratio` of the prediction (never an outlier: with a near-perfect
        fit the median residual is ~0 and any jitter would otherwise count)."""
        a, b, c = coef
        predicted = np.maximum(a + b * n + c * n * n, 1e-3)
        relative = np.abs(y - predicted) / predicted
        return relative <= max(OUTLIER_MEDIANS * float(np.median(relative)), min_ratio)

    @staticmethod
    def _max_relative_residual(n: np.ndarray, y: np.ndarray, coef: tuple[float, float, float]) -> float:
        a, b, c = coef
        predicted = np.maximum(a + b * n + c * n * n, 1e-3)
        return float(np.max(np.abs(y - predicted) / predicted))

    @classmethod
    def _fit_lad(cls, n: np.ndarray, y: np.ndarray, iterations: int = 5) -> tuple[float, float, float]:
        """Least absolute deviations, coefficients >= 0, by iteratively reweighted least squares
        (weights 1 / |residual|): a fit through the bulk of the samples that a minority of
        arbitrarily large ones cannot move far."""
        coef = cls._fit(n, y)
        floor = max(1e-6, 1e-3 * float(np.median(np.abs(y))))  # keeps exact fits' weights finite
        for _ in range(iterations):
            a, b, c = coef
            residual = np.abs(y - (a + b * n + c * n * n))
            coef = cls._fit(n, y, 1.0 / np.maximum(residual, floor))
        return coef

    @staticmethod
    def _fit(n: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> tuple[float, float, float]:
        """Least squares with every coefficient >= 0 (a negative one would predict impossible
        speed-ups somewhere). Exact for three terms: the constrained optimum is the unconstrained
        fit on some subset of the terms, so the best feasible subset fit is it. Clamping a
        negative coefficient of the full fit instead leaves the others fitted to compensate for
        it, e.g. an intercept inflated several times over when the linear term came out negative."""
        design = np.stack([np.ones_like(n), n, n * n], axis=1)
        w = np.ones_like(y) if weights is None else weights
        root = np.sqrt(w)
        best: tuple[float, tuple[float, float, float]] | None = None
        for terms in _TERM_SUBSETS:
            solved, *_ = np.linalg.lstsq(design[:, terms] * root[:, None], y * root, rcond=None)
            if (solved < 0).any():
                continue
            coef = [0.0, 0.0, 0.0]
            for term, value in zip(terms, solved, strict=True):
                coef[term] = float(value)
            sse = float(np.sum(w * (design @ np.array(coef) - y) ** 2))
            if best is None or sse < best[0]:
                best = (sse, (coef[0], coef[1], coef[2]))
        assert best is not None  # the intercept alone (the mean of positive samples) is feasible
        return best[1]

    def full_ms(self, tokens: int) -> float:
        """Predicted compute of one full ranking of `tokens` tokens on an idle instance."""
        if self._coef is not None:
            a, b, c = self._coef
            return a + b * tokens + c * tokens * tokens
        return self._flops_ms(tokens) * self.prior_scale

    def _flops_ms(self, tokens: int) -> float:
        """The prior: the model's FLOPs at the assumed device rate."""
        s = self.spec
        attention = s.num_layers * s.num_heads * 2 * s.head_dim * tokens * tokens
        return (max(tokens, 1) * s.linear_flops_per_token() + attention) / (self.assumed_tflops * 1e12) * 1e3

    def predict(self, tokens: int, queue_depth: int = 0, queued_tokens: int = 0) -> float:
        """Latency of a full ranking: its compute plus the queue ahead of it."""
        wait = queue_depth * self.full_ms(queued_tokens) if queue_depth else 0.0
        return self.full_ms(tokens) + wait

    def min_tokens_over(self, ms: float, limit: int = 1 << 24) -> int | None:
        """The fewest tokens whose predicted full ranking exceeds `ms` (None: none up to `limit`).
        full_ms never decreases with length (coefficients >= 0), so a bisection finds it."""
        if self.full_ms(limit) <= ms:
            return None
        lo, hi = 0, limit  # full_ms(lo) <= ms < full_ms(hi), unless lo = 0 is already over
        if self.full_ms(0) > ms:
            return 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.full_ms(mid) > ms:
                hi = mid
            else:
                lo = mid
        return hi

    def describe(self) -> dict[str, Any]:
        """The model's state, for logs: fitted or not, coefficients, samples used."""
        coef = None if self._coef is None else [float(f"{v:.6g}") for v in self._coef]
        return {
            "calibrated": self.calibrated,
            "prior_scale": round(self.prior_scale, 4),
            "coef_ms": coef,
            "samples": len(self._samples),
            "kept": self.kept,
        }
