"""The relay-race core on the CPU: full inference vs pre-infer + cached ranking, same scores.

A handful of users with long histories; for each, score the candidates in full, then pre-infer
the prefix and score against psi. Prints per-user timings and the max |score difference|.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch

from bench.synthetic import Shape, batch
from services.ranker.model import HSTURanker
from shared.modelspec import preset

T = TypeVar("T")


@dataclass(frozen=True)
class CoreDemoRow:
    user: int
    prefix_len: int
    full_ms: float
    preinfer_ms: float
    cached_ms: float
    max_abs_diff: float


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def run_core_demo(users: int = 4, seed: int = 0, prefix_len: int = 2000) -> list[CoreDemoRow]:
    torch.manual_seed(seed)
    model = HSTURanker.from_seed(preset("tiny"), seed=seed)
    shapes = [Shape(8, prefix_len * (i + 1) // users, 32, 128) for i in range(users)]
    prefixes, suffixes = batch(seed, shapes)
    rows = []
    for p, s in zip(prefixes, suffixes, strict=True):
        model.full([p], [s])  # warm-up
        (full,), full_ms = _timed(partial(model.full, [p], [s]))
        (psi,), pre_ms = _timed(partial(model.preinfer, [p]))
        key = model.psi_key(p.user_id, p.prefix_version)
        (cached,), cached_ms = _timed(partial(model.rank_cached, [s], [psi], [key]))
        rows.append(
            CoreDemoRow(p.user_id, p.length, full_ms, pre_ms, cached_ms, float((full - cached).abs().max()))
        )
    return rows


def print_core_demo(rows: list[CoreDemoRow]) -> None:
    print("relay-race core, tiny model on the CPU (float32): full vs pre-infer + cached ranking")
    print(
        f"{'user':>4} {'prefix':>7} {'full ms':>9} {'preinfer ms':>12} {'cached ms':>10} {'speed-up':>9} {'max |diff|':>11}"
    )
    for r in rows:
        print(
            f"{r.user:>4} {r.prefix_len:>7} {r.full_ms:>9.2f} {r.preinfer_ms:>12.2f} {r.cached_ms:>10.2f} "
            f"{r.full_ms / r.cached_ms:>8.1f}x {r.max_abs_diff:>11.2e}"
        )
    print(f"max |score(cached) - score(full)| over all users: {max(r.max_abs_diff for r in rows):.2e}")
