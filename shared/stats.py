"""Small statistics helpers shared by services and benchmarks."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    return percentiles(values, (q,))[0]


def percentiles(values: Sequence[float], qs: Sequence[float]) -> list[float]:
    """Nearest-rank percentile for each q, sorting once (NaN each for no values)."""
    if not values:
        return [float("nan")] * len(qs)
    ordered = sorted(values)
    n = len(ordered)
    return [ordered[max(1, min(n, round(q / 100.0 * n + 0.5))) - 1] for q in qs]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")
