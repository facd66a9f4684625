"""shared.stats: nearest-rank percentiles, one at a time or several from one sort."""

from __future__ import annotations

import math
import random

from shared.stats import percentile, percentiles


def test_several_percentiles_from_one_sort_equal_each_taken_alone():
    rng = random.Random(3)
    for n in (1, 2, 7, 100, 2048):
        values = [rng.uniform(0, 50) for _ in range(n)]
        qs = (0, 1, 50, 90, 99, 99.9, 100)
        assert percentiles(values, qs) == [percentile(values, q) for q in qs]


def test_nearest_rank_and_no_values():
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert percentiles([5.0, 1.0, 3.0, 2.0, 4.0], (0, 100)) == [1.0, 5.0]
    assert all(math.isnan(v) for v in percentiles([], (50, 99)))
