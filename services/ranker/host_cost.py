"""What one more request costs this ranker's host: CPU seconds per request (Rank or PreInfer), over
a recent window. Pure: the caller passes the clock, the CPU seconds and the request count.

The CPU counted is the process's (every thread: the event loop decoding, validating and
answering, the device loop launching and settling, gRPC's own threads) less the device loop's
waits (waiting for scores, for work, for a batch to fill: services/ranker/loop_time.py), which
spin on the CPU while the device works. Why the trigger needs it: on one H200 at 4096 tokens
both the baseline and the relay missed the SLO with the device 56-74% busy, bound by the
ranker's host (k11a); a pre-inference signal carries the whole prefix and costs the host about
what a ranking call does, so a trigger that priced pre-inference by device time alone admitted
1627 of them at 250 req/s and the relay's limit fell from 250 to 197.5 req/s (k11e), with its
slow calls waiting outside the ranker's servicer (108 ms mean) for the host.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class HostCost:
    window_s: float = 2.0
    min_requests: int = 32  # fewer in the window: no figure (a few requests say little)
    _samples: collections.deque[tuple[float, float, int]] = field(default_factory=collections.deque)

    def observe(self, now: float, cpu_s: float, requests: int) -> None:
        """A reading: the host's CPU seconds (waits excluded) and the requests handled so far."""
        self._samples.append((now, cpu_s, requests))
        # Keep one reading at or before the window's start, to measure the whole window.
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def ms_per_request(self) -> float | None:
        """CPU ms per request between the oldest reading kept and the newest; None while fewer
        than `min_requests` requests came in between."""
        if len(self._samples) < 2:
            return None
        (_, cpu0, n0), (_, cpu1, n1) = self._samples[0], self._samples[-1]
        requests = n1 - n0
        if requests < self.min_requests:
            return None
        return max(0.0, cpu1 - cpu0) / requests * 1e3
