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

import math

from services.ranker.yield_gate import YieldGate

# While plain full batches are scarce, one user in this many is left unkept (KeepDeviceCost).
PROBE_EVERY = 16
# Plain full batches' recent share below which the probe runs.
PLAIN_SHARE_WANTED = 0.05


def probed(user_id: int, sample_every: int) -> bool:
    """Whether the user is one the probe leaves unkept: never one of the gate's sample."""
    return user_id % PROBE_EVERY == PROBE_EVERY - 1 and user_id % sample_every != 0


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


class KeepDeviceCost:
    """Device seconds a full ranking spends per prefix token it keeps, fitted online from full
    ranking batches. Pure: no I/O, no clock. Not thread-safe (the engine's settling thread only).

    Each full batch's measured seconds are fitted as `scale` x its predicted seconds (the
    engine's batch cost fit, which keeping and plain batches both feed, so it carries some of the
    keeps' cost; `scale` takes the rest of that bias) + `per_token` x the prefix tokens it kept:
    a weighted least-squares fit of two coefficients, forgetting over about `memory` batches. The
    two are told apart only where kept tokens vary against the prediction (plain and keeping
    batches, mixed ones); where every batch keeps alike the fit cannot tell, and `per_token` is
    None (unknown), as before `min_batches` of each kind were seen. While plain batches are
    scarce (`needs_plain`: every prefix long enough to keep, the gate open) the relay cache
    leaves one user in PROBE_EVERY unkept, so that the contrast exists while the gate keeps.
    Written on the engine's thread, read on the event loop: a torn read mixes two batches' sums.
    """

    def __init__(self, memory: float = 512.0, min_batches: int = 16) -> None:
        if memory < 1 or min_batches < 1:
            raise ValueError("memory and min_batches >= 1")
        self._decay = 1.0 - 1.0 / memory
        self.min_batches = min_batches
        self._sxx = self._sxk = self._skk = self._sxy = self._sky = 0.0
        self._plain = self._keeping = 0  # batches seen without and with kept tokens
        self._plain_share = 0.0  # of recent full batches, those that kept nothing

    def observe(self, predicted_s: float, seconds: float, kept_tokens: int) -> None:
        """One full ranking batch: its predicted and measured seconds, the prefix tokens it kept."""
        if not (math.isfinite(predicted_s) and math.isfinite(seconds)) or predicted_s <= 0 or seconds < 0:
            return
        d = self._decay
        # Relative errors weigh alike: each batch's equation divided by its prediction.
        x, k, y = 1.0, kept_tokens / predicted_s, seconds / predicted_s
        self._sxx = self._sxx * d + x * x
        self._sxk = self._sxk * d + x * k
        self._skk = self._skk * d + k * k
        self._sxy = self._sxy * d + x * y
        self._sky = self._sky * d + k * y
        self._plain_share = self._plain_share * d + (0.0 if kept_tokens > 0 else 1.0 - d)
        if kept_tokens > 0:
            self._keeping += 1
        else:
            self._plain += 1

    @property
    def needs_plain(self) -> bool:
        """Whether too few recent full batches kept nothing for the fit to tell keeps apart."""
        return self._plain < self.min_batches or self._plain_share < PLAIN_SHARE_WANTED

    @property
    def per_token_s(self) -> float | None:
        """Device seconds per kept prefix token (>= 0); None while the fit cannot tell."""
        if min(self._plain, self._keeping) < self.min_batches:
            return None
        det = self._sxx * self._skk - self._sxk * self._sxk
        # Kept tokens must vary beside the prediction: the determinant against its scale.
        if det <= 1e-6 * self._sxx * self._skk:
            return None
        per_token = (self._sxx * self._sky - self._sxk * self._sxy) / det
        return max(0.0, per_token)

    def ms_per_keep(self, prefix_len: int) -> float | None:
        """Device ms keeping one psi of `prefix_len` tokens costs; None while unknown."""
        per_token = self.per_token_s
        return None if per_token is None else per_token * prefix_len * 1e3
