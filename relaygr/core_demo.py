"""The relay-race core on the CPU: full inference vs pre-infer + cached ranking, same scores.

A handful of users with long histories; for each, score the candidates in full, then pre-infer
the prefix and score against psi. Prints per-user timings (the median of a few repetitions) and
the max |score difference|. Cached ranking does a fraction of full inference's work, so a
speed-up below 1 can only mean that something else had the CPU during the timing: the printout
says so, with the load average, instead of presenting it as a result.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch

from relaygr.synthetic import Shape, batch
from services.ranker.model import HSTURanker
from shared.modelspec import preset

T = TypeVar("T")
REPEATS = 5  # timings per call: their median is printed (one slow run does not set it)


@dataclass(frozen=True)
class CoreDemoRow:
    user: int
    prefix_len: int
    full_ms: float
    preinfer_ms: float
    cached_ms: float
    max_abs_diff: float

    @property
    def speedup(self) -> float:
        return self.full_ms / self.cached_ms


def _timed(fn: Callable[[], T], repeats: int = REPEATS) -> tuple[T, float]:
    """fn's result and the median of `repeats` timings of it (ms)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return out, statistics.median(times)


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
        key = model.psi_key(p.user_id, p.prefix_version, p.fingerprint.digest)
        (cached,), cached_ms = _timed(partial(model.rank_cached, [s], [psi], [key]))
        rows.append(
            CoreDemoRow(p.user_id, p.length, full_ms, pre_ms, cached_ms, float((full - cached).abs().max()))
        )
    return rows


def contention_remark(rows: list[CoreDemoRow], load: tuple[float, float, float] | None = None) -> str | None:
    """A remark when some speed-up is below 1 (None otherwise): the cached call computes a fraction
    of the full one's tokens, so it was slowed by other work on the CPU, not by the method.
    `load` is the 1/5/15-minute load average (default: this machine's)."""
    slow = [r for r in rows if r.speedup < 1]
    if not slow:
        return None
    load1, _, _ = os.getloadavg() if load is None else load
    users = ", ".join(f"{r.user} ({r.speedup:.2f}x)" for r in slow)
    return (
        f"note: speed-up below 1 for user(s) {users}: ranking against psi computes far fewer tokens than "
        f"full inference, so other work was taking the CPU while it was timed (load average {load1:.1f} "
        f"on {os.cpu_count()} CPUs); these timings show contention, not the method: rerun on an idle machine"
    )


def print_core_demo(rows: list[CoreDemoRow]) -> None:
    print("relay-race core, tiny model on the CPU (float32): full vs pre-infer + cached ranking")
    print(
        f"{'user':>4} {'prefix':>7} {'full ms':>9} {'preinfer ms':>12} {'cached ms':>10} {'speed-up':>9} {'max |diff|':>11}"
    )
    for r in rows:
        print(
            f"{r.user:>4} {r.prefix_len:>7} {r.full_ms:>9.2f} {r.preinfer_ms:>12.2f} {r.cached_ms:>10.2f} "
            f"{r.speedup:>8.1f}x {r.max_abs_diff:>11.2e}"
        )
    print(f"(each timing: the median of {REPEATS} runs)")
    print(f"max |score(cached) - score(full)| over all users: {max(r.max_abs_diff for r in rows):.2e}")
    remark = contention_remark(rows)
    if remark is not None:
        print(remark)
