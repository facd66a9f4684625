"""Whether a full ranking keeps its prefix's psi: kept while later calls reading it pay for what
keeping it costs, and only for a sample of users otherwise. Pure: no I/O, no clock.

A full ranking that keeps psi (services/ranker/relay_cache.py, "Rankings keep psi") costs the
ranker host time a plain one does not: the psi block's allocation and the copies into it on the
device loop, the cache's admission, production and lease on the event loop. It pays only when
the user comes back and a call reads that psi instead of ranking in full again, and then by the
device time a call against psi saves over a full ranking, which shrinks with the prefix.
Measured on one H200 (k12c, 2026-11-29; the length mix, SLO 50 ms, a ranker bound by its host):
against the baseline's full rankings of the same lengths, one that kept psi took 0.8-1.0 ms more
to launch and 1.1 ms more outside the device (server_other), while a call against psi saved
0.1-0.4 ms of device time for prefixes of 512-1024 tokens, 1.1 at 2048 and 2.7 at 4096; about
0.9 calls read each kept psi. The relay met 270 req/s on the mix, the baseline 421.9.

So the gate weighs, per full ranking, the measured reuse (calls that read a kept psi, per psi
kept, recent) times the device time a call against psi saves at this prefix length against the
host time keeping one costs, and keeps psi when the product pays. When it does not, it still
keeps one user in `sample_every` (by user id: the same users each time), so that the reuse
keeps being measured and the gate opens again when the workload changes (users coming back more
often, longer prefixes). Until `min_kept` were measured the gate is open, as it is while either
cost is unknown. The mechanism is yield_gate.py's (shared with the demotion gate).
"""

from __future__ import annotations

from services.ranker.yield_gate import YieldGate


class KeepGate(YieldGate):
    """psi kept by full rankings (actions), paid back by later calls reading it (returns)."""

    def __init__(self, sample_every: int = 8, min_kept: int = 128, memory: float = 1024.0) -> None:
        super().__init__(sample_every, min_kept, memory)

    def kept(self) -> None:
        """One full ranking's psi entered the cache."""
        self.acted()

    def read(self) -> None:
        """One later call read a psi a full ranking kept (a hit, or a join of its production)."""
        self.returned()

    @property
    def reuse(self) -> float | None:
        """Calls that read a kept psi per psi kept, recent; None before `min_kept` were measured."""
        return self.returns_per_action
