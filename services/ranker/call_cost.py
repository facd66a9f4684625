"""What a ranking call costs the engine: seconds predicted from the tokens it computes, fitted to
the ranker's own measured batches. Pure: no I/O, no torch.

A ranking batch runs its users' sequences concatenated without padding, so its time is

    seconds = per_batch + per_token x tokens + per_pair x pairs

`tokens` are the tokens computed (a call against psi computes its suffix; a full recompute its
prefix and suffix), `pairs` the (prefix token, computed token) pairs that attention visits in a
full recompute (prefix x (prefix + suffix) for one call; the engine reports a batch's longest
prefix x its tokens, a bound). The quadratic term is what makes a long full recompute cost ~100 x a
short one on a CPU: measured here (tiny preset, 2-core VM), 2k tokens 0.45 s, 4k 2.3 s, 6k 5.6 s.

The coefficients are an exponentially weighted least-squares fit over the engine's recent batches
(`BatchSample`: tokens, longest prefix, compute time), minimising *relative* error so that 3 ms
batches against psi weigh as much as 2 s recomputes. Before any batch is measured the prior
holds: per-batch and per-token costs worth `prior_batches` batches, which fade as batches are
measured. The prior has no quadratic cost (it is learnt from measurements only): a prior that
overstated it would refuse long calls before one was ever measured. Coefficients are kept
non-negative (a negative one is fixed at 0 and the rest refitted).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# Regressors are scaled to similar magnitudes: [1, tokens / 1e3, pairs / 1e6].
_SCALES = (1.0, 1e-3, 1e-6)
_SCALE = np.array(_SCALES)
# Relative error, with a floor so that near-zero batches do not dominate the fit.
_FLOOR_S = 1e-3
# A weight that never decays on the prior's pseudo-batches: the fit stays defined (and pulled
# towards the prior) along directions that the measurements do not vary in.
_RIDGE_BATCHES = 1e-6


class Batch(Protocol):
    """One measured ranking batch (services.ranker.engine.BatchSample satisfies it)."""

    @property
    def full(self) -> bool: ...
    @property
    def tokens(self) -> int: ...
    @property
    def prefix_len(self) -> int: ...
    @property
    def compute_ms(self) -> float: ...
    @property
    def seq(self) -> int: ...


@dataclass(frozen=True)
class CallWork:
    """A ranking call's predicted engine work: `tokens` computed and attention `pairs`."""

    tokens: int
    pairs: int
    full: bool

    @classmethod
    def of(cls, prefix_tokens: int, suffix_tokens: int, against_psi: bool) -> CallWork:
        if prefix_tokens < 0 or suffix_tokens < 0:
            raise ValueError("token counts must be >= 0")
        if against_psi:
            return cls(suffix_tokens, 0, False)
        total = prefix_tokens + suffix_tokens
        return cls(total, prefix_tokens * total, True)

    def describe(self) -> str:
        return f"{self.tokens} tokens {'in full' if self.full else 'against psi'}"


@dataclass(frozen=True)
class Coefficients:
    per_batch_s: float
    per_token_s: float
    per_pair_s: float

    def seconds(self, tokens: int, pairs: int) -> float:
        return self.per_batch_s + self.per_token_s * tokens + self.per_pair_s * pairs


@dataclass(frozen=True)
class CostPrior:
    per_batch_s: float = 1e-3
    per_token_s: float = 10e-6
    # 0 unless measured (Engine.calibrate_steps): a quadratic cost assumed, not measured, would
    # refuse long calls before one was ever run.
    per_pair_s: float = 0.0
    pairs_measured: bool = False  # per_pair_s was measured (0 included): the fit holds to it too
    batches: float = 2.0  # its weight, in measured batches
    memory_batches: float = 128.0  # a batch's weight halves after ~0.7 x this many newer ones

    def __post_init__(self) -> None:
        if self.per_batch_s < 0 or self.per_token_s < 0 or self.per_pair_s < 0:
            raise ValueError("prior costs must be >= 0")
        if self.per_batch_s + self.per_token_s <= 0:
            raise ValueError("prior costs must not both be 0")
        if self.batches < 0:
            raise ValueError("prior batches must be >= 0")
        if self.memory_batches < 1:
            raise ValueError("memory_batches must be >= 1")


# Solving the fit costs ~0.1-0.2 ms of Python and numpy; on every batch it was 5% of the engine
# thread's samples on an H200 (py-spy, relay-nospare at 200 req/s), on the loop that must launch
# the next batch before the device runs dry. The first batches move the fit most and are solved
# each; after them every _SOLVE_EVERY-th, a lag of a few batches in a memory of ~128.
_SOLVE_EACH_FIRST = 64
_SOLVE_EVERY = 8


class CostFit:
    """Batch seconds from tokens and pairs, fitted online. Not thread-safe (event loop only)."""

    def __init__(self, prior: CostPrior) -> None:
        self.prior = prior
        self.measured = 0  # batches observed
        self._last_seq = -1
        self._decay = 1.0 - 1.0 / prior.memory_batches
        # Normal equations of the weighted fit in scaled units: A theta = b, A row-major. Python
        # floats, not numpy: a batch's update is a dozen products, which numpy's per-call
        # overhead made 12 us (every batch, on the device loop and again on the event loop).
        self._a = [0.0] * 9
        self._b = [0.0] * 3
        # The prior as pseudo-batches: an empty one and one of 1k tokens (worth `batches`, fading),
        # and, in the ridge only, 1k tokens in full at the prior's pair cost (none, unless
        # measured): no quadratic cost is assumed, and none is held against the first measured
        # one. A measured pair cost is a third pseudo-batch: without it, batches of one shape
        # (chunk steps of one size) put any residual into the pair cost, which then extrapolates
        # quadratically (a 4096-token step predicted at 42 ms that measures 4.3).
        empty, linear = (1.0, 0.0, 0.0), (1.0, 1e3, 0.0)
        linear_s = prior.per_batch_s + 1e3 * prior.per_token_s
        self._ridge_a = [0.0] * 9
        self._ridge_b = [0.0] * 3
        points = [(empty, prior.per_batch_s), (linear, linear_s)]
        full = ((1.0, 1e3, 1e6), linear_s + 1e6 * prior.per_pair_s)
        if prior.pairs_measured:
            points.append(full)
        for x, y in points:
            self._add(x, y, prior.batches / len(points))
            self._add(x, y, _RIDGE_BATCHES, ridge=True)
        self._add(*full, _RIDGE_BATCHES, ridge=True)
        self._coef = self._solve()

    # ------------------------------------------------------------------ measurement

    def _add(self, x: tuple[float, float, float], y: float, weight: float, ridge: bool = False) -> None:
        xs = (x[0] * _SCALES[0], x[1] * _SCALES[1], x[2] * _SCALES[2])
        w = weight / (y + _FLOOR_S) ** 2
        a, b = (self._ridge_a, self._ridge_b) if ridge else (self._a, self._b)
        for i in range(3):
            wx = w * xs[i]
            b[i] += wx * y
            for j in range(3):
                a[3 * i + j] += wx * xs[j]

    def observe(self, tokens: int, pairs: int, seconds: float) -> None:
        """One measured batch. Non-finite or negative measurements are ignored."""
        if not (math.isfinite(seconds) and seconds >= 0 and tokens >= 0 and pairs >= 0):
            return
        d = self._decay
        self._a = [v * d for v in self._a]
        self._b = [v * d for v in self._b]
        self._add((1.0, float(tokens), float(pairs)), seconds, 1.0)
        self.measured += 1
        if self.measured <= _SOLVE_EACH_FIRST or self.measured % _SOLVE_EVERY == 0:
            self._coef = self._solve()

    def observe_batches(self, batches: Iterable[Batch]) -> int:
        """Observes the batches not seen yet (by `seq`, increasing); returns how many."""
        fresh = [b for b in batches if b.seq > self._last_seq]
        for b in sorted(fresh, key=lambda b: b.seq):
            pairs = b.prefix_len * b.tokens if b.full else 0
            self.observe(b.tokens, pairs, b.compute_ms / 1e3)
            self._last_seq = b.seq
        return len(fresh)

    def _solve(self) -> Coefficients:
        a = np.array(self._a).reshape(3, 3) + np.array(self._ridge_a).reshape(3, 3)
        b = np.array(self._b) + np.array(self._ridge_b)
        free = [0, 1, 2]
        theta = np.zeros(3)
        while free:
            sub = np.linalg.solve(a[np.ix_(free, free)], b[free])
            if (sub >= 0).all():
                theta[:] = 0.0
                theta[free] = sub
                break
            free = [i for i, v in zip(free, sub, strict=True) if v > 0]  # fix the negative ones at 0
        coef = theta * _SCALE
        return Coefficients(float(coef[0]), float(coef[1]), float(coef[2]))

    # ------------------------------------------------------------------ prediction

    @property
    def coefficients(self) -> Coefficients:
        return self._coef

    def seconds(self, work: CallWork) -> float:
        """Predicted engine seconds for the call, run as a batch of its own (an upper bound on
        its share when batched: the per-batch cost is then shared)."""
        return self._coef.seconds(work.tokens, work.pairs)
