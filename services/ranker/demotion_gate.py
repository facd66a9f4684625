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
    configurations were bound by the ranker's host (misses with the device 56-74% busy);
  * every prefix 16384 tokens (k21b, 2 x H200, 2026-11-30; one call): copying every candidate
    (~300 more copies a point than the gate made) raised P99 by 4-9 ms at 22.5-33.75 req/s for
    ~2% of calls served by a reload; the ranker spent 2.2-3.4 ms of CPU a copy, of which the
    device loop's issue was ~0.4. A copy's price now counts the event loop's own steps too
    (RelayCache.host_ms_per_demotion, task_cpu.py).
So the gate weighs, per candidate, the measured yield (reloads per demotion, recent) times the
device time a reload saves for that psi against the host time one copy costs, and copies the
candidate when the product pays. When it does not, it still copies one candidate in
`sample_every` (by user id: the same users each time), so that the yield keeps being measured
and the gate opens again when the workload changes (users coming back later, a larger arena).
Until `min_demotions` copies were measured the gate is open: the tier is assumed to pay.

Either cost unknown (nothing measured yet) keeps the gate open. The yield counts every reload
from host DRAM (a call's own, or a prefetch ahead of it) against every demotion. The mechanism is
yield_gate.py's (shared with the keep gate).
"""

from __future__ import annotations

from services.ranker.yield_gate import YieldGate


class DemotionGate(YieldGate):
    """Copies to host DRAM (actions), paid back by reloads (returns)."""

    def __init__(self, sample_every: int = 8, min_demotions: int = 256, memory: float = 1024.0) -> None:
        super().__init__(sample_every, min_demotions, memory)

    def demoted(self) -> None:
        """One psi copied to host DRAM."""
        self.acted()

    def reloaded(self) -> None:
        """One psi brought back from host DRAM (instead of recomputed)."""
        self.returned()

    @property
    def reload_yield(self) -> float | None:
        """Reloads per demotion, recent; None before `min_demotions` were measured."""
        return self.returns_per_action
