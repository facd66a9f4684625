"""Whether the host tier earns its copies: consumed psi is copied to host DRAM while the copies pay
for themselves, and only a sample of it otherwise. Pure: no I/O, no clock.

A demotion costs the ranker's host time (issuing a copy of psi on the device loop, the expander's
reserve and commit on the event loop) and copy bandwidth; it pays only when the psi is reloaded
later instead of recomputed. Measured on one H200 (k11a, k11b, 2026-11-29; HBM 120 GB, a 64 GiB
arena on a host of 125 GiB, every psi copied as HBM needed its room):
  * the length mix: ~2000 demotions a point, 0-5 reloads: the arena holds less than HBM, and a
    user back after HBM dropped them was rarely back soon enough to be in DRAM;
  * every prefix 4096 tokens: 5-11% of the demotions were reloaded, each saving ~1.6-2 ms of
    device time, while issuing one copy cost the device loop 0.28-0.35 ms of host time, and both
    configurations were bound by the ranker's host (misses with the device 56-74% busy).
So the gate weighs, per candidate, the measured yield (reloads per demotion, recent) times the
device time a reload saves for that psi against the host time one copy costs, and copies the
candidate when the product pays. When it does not, it still copies one candidate in
`sample_every` (by user id: the same users each time), so that the yield keeps being measured
and the gate opens again when the workload changes (users coming back later, a larger arena).
Until `min_demotions` copies were measured the gate is open: the tier is assumed to pay.

Either cost unknown (nothing measured yet) keeps the gate open. The yield counts every reload
from host DRAM (a call's own, or a prefetch ahead of it) against every demotion.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DemotionGate:
    sample_every: int = 8  # closed: one candidate in this many is still copied (1: always copy)
    min_demotions: int = 256  # measured before the gate may close
    memory: float = 1024.0  # demotions the yield averages over (exponential decay)
    _demotions: float = 0.0
    _reloads: float = 0.0
    _measured: int = 0

    def __post_init__(self) -> None:
        if self.sample_every < 1 or self.min_demotions < 0 or self.memory < 1:
            raise ValueError("sample_every and memory >= 1, min_demotions >= 0")

    def demoted(self) -> None:
        """One psi copied to host DRAM."""
        keep = 1.0 - 1.0 / self.memory
        self._demotions = self._demotions * keep + 1.0
        self._reloads *= keep
        self._measured += 1

    def reloaded(self) -> None:
        """One psi brought back from host DRAM (instead of recomputed)."""
        self._reloads += 1.0

    @property
    def reload_yield(self) -> float | None:
        """Reloads per demotion over about the last `memory` demotions; None before
        `min_demotions` were measured."""
        if self._measured < max(self.min_demotions, 1):
            return None
        return self._reloads / self._demotions

    def earns(self, saving_ms: float | None, copy_ms: float | None) -> bool:
        """Whether copying psi whose reload saves `saving_ms` of device time pays for the
        `copy_ms` of host time a copy costs, at the measured yield."""
        y = self.reload_yield
        if y is None or saving_ms is None or copy_ms is None:
            return True
        return y * saving_ms >= copy_ms

    def admits(self, user_id: int, saving_ms: float | None, copy_ms: float | None) -> bool:
        """Whether to copy this candidate: the tier earns its copies, or it is one of the sample."""
        return self.earns(saving_ms, copy_ms) or user_id % self.sample_every == 0
