"""Predicted full-ranking latency of a request, calibrated from the rankers' own measurements.

Full ranking of n tokens costs about a + b*n + c*n^2 ms on an instance (projections are linear in
n, attention quadratic). The coefficients are refitted by least squares from the batches each
ranker reports in Stats (LatencySample: tokens per request, compute ms), so the model follows the
real device, batch behaviour and load. Before any sample exists it uses the model's FLOPs at an
assumed device rate. A request also waits behind the instance's queue: `predict` adds
queue_depth x the latency of an average queued request.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from shared.modelspec import ModelSpec


@dataclass(frozen=True)
class Sample:
    tokens: int  # tokens computed per request (full ranking: prefix + suffix)
    compute_ms: float


@dataclass
class LatencyModel:
    spec: ModelSpec
    assumed_tflops: float
    window: int = 512
    _samples: collections.deque[Sample] = field(default_factory=collections.deque)
    _coef: tuple[float, float, float] | None = None

    def __post_init__(self) -> None:
        self._samples = collections.deque(maxlen=self.window)

    @property
    def calibrated(self) -> bool:
        return self._coef is not None

    def observe(self, samples: list[Sample]) -> None:
        """Adds measured full-ranking samples and refits (needs >= 3 distinct lengths)."""
        self._samples.extend(s for s in samples if s.tokens > 0 and s.compute_ms > 0)
        lengths = {s.tokens for s in self._samples}
        if len(lengths) < 3:
            return
        n = np.array([s.tokens for s in self._samples], dtype=np.float64)
        y = np.array([s.compute_ms for s in self._samples], dtype=np.float64)
        coef = self._fit(n, y)
        # One refit without outliers (a stalled batch, a burst of contention): they would drag
        # every prediction up and make the trigger admit requests that are not at risk.
        residual = np.abs(y - (coef[0] + coef[1] * n + coef[2] * n * n))
        keep = residual <= 3 * max(float(np.median(residual)), 1e-3)
        if keep.sum() >= 3 and not keep.all() and len(set(n[keep].tolist())) >= 3:
            coef = self._fit(n[keep], y[keep])
        self._coef = coef

    @staticmethod
    def _fit(n: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
        design = np.stack([np.ones_like(n), n, n * n], axis=1)
        solved, *_ = np.linalg.lstsq(design, y, rcond=None)
        a, b, c = (float(v) for v in solved)
        # A negative term would predict impossible speed-ups at long lengths: clamp, refit the rest.
        if c < 0:
            linear, *_ = np.linalg.lstsq(design[:, :2], y, rcond=None)
            a, b, c = float(linear[0]), float(linear[1]), 0.0
        return max(a, 0.0), max(b, 0.0), max(c, 0.0)

    def full_ms(self, tokens: int) -> float:
        """Predicted compute of one full ranking of `tokens` tokens on an idle instance."""
        if self._coef is not None:
            a, b, c = self._coef
            return a + b * tokens + c * tokens * tokens
        s = self.spec
        attention = s.num_layers * s.num_heads * 2 * s.head_dim * tokens * tokens
        return (tokens * s.linear_flops_per_token() + attention) / (self.assumed_tflops * 1e12) * 1e3

    def predict(self, tokens: int, queue_depth: int = 0, queued_tokens: int = 0) -> float:
        """Latency of a full ranking: its compute plus the queue ahead of it."""
        wait = queue_depth * self.full_ms(queued_tokens) if queue_depth else 0.0
        return self.full_ms(tokens) + wait
