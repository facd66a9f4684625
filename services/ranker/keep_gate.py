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
cost is unknown.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KeepGate:
    sample_every: int = 8  # closed: one user in this many still keeps psi (1: always keep)
    min_kept: int = 128  # kept before the gate may close
    memory: float = 1024.0  # kept psi the reuse averages over (exponential decay)
    _kept: float = 0.0
    _reads: float = 0.0
    _measured: int = 0

    def __post_init__(self) -> None:
        if self.sample_every < 1 or self.min_kept < 0 or self.memory < 1:
            raise ValueError("sample_every and memory >= 1, min_kept >= 0")

    def kept(self) -> None:
        """One full ranking's psi entered the cache."""
        decay = 1.0 - 1.0 / self.memory
        self._kept = self._kept * decay + 1.0
        self._reads *= decay
        self._measured += 1

    def read(self) -> None:
        """One later call read a psi a full ranking kept (a hit, or a join of its production)."""
        self._reads += 1.0

    @property
    def reuse(self) -> float | None:
        """Calls that read a kept psi per psi kept, over about the last `memory` kept; None
        before `min_kept` were measured."""
        if self._measured < max(self.min_kept, 1):
            return None
        return self._reads / self._kept

    def earns(self, saving_ms: float | None, keep_ms: float | None) -> bool:
        """Whether keeping psi whose reads save `saving_ms` of device time each pays for the
        `keep_ms` of host time keeping it costs, at the measured reuse."""
        r = self.reuse
        if r is None or saving_ms is None or keep_ms is None:
            return True
        return r * saving_ms >= keep_ms

    def admits(self, user_id: int, saving_ms: float | None, keep_ms: float | None) -> bool:
        """Whether this full ranking keeps psi: keeping earns, or the user is one of the sample."""
        return self.earns(saving_ms, keep_ms) or user_id % self.sample_every == 0
