"""How far behind the ranker's event loop runs, and whether the relay should shed the work it
may skip. Pure: the caller passes the clock and the lag.

The event loop decodes, validates and answers every call, under the interpreter lock the device
loop shares. When it falls behind, every call waits before its handler runs, and that wait is
outside anything the ranker schedules. Measured on one H200 host (k17b, the length mix, two
ranker processes per GPU under MPS, 587.5 req/s): the relay's calls waited 14.8 ms mean outside
the servicer against the baseline's 4.0 at the same rate, with the same compute, while the relay
also kept psi for 1480 full rankings (13.6% of calls then read psi) and copied 787 psi to host
DRAM (6 were reloaded) in the point: work the baseline does not do, on the resource that binds.

The lag is measured as a periodic timer's oversleep (the ranker's 50 ms housekeeping tick: how
much later than asked it woke), smoothed exponentially over `window_s`. While the smoothed lag
exceeds `threshold_ms`, the relay cache sheds its optional work (services/ranker/relay_cache.py):
full rankings keep no psi, and psi leaving HBM is not copied to DRAM. Calls still read psi that
is held, and pre-inferences the trigger admitted still run. `threshold_ms` 0: never pressed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class LoopLag:
    threshold_ms: float = 0.0
    window_s: float = 0.5
    _lag_ms: float = 0.0
    _last: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.threshold_ms < 0 or self.window_s <= 0:
            raise ValueError("threshold_ms must be >= 0 and window_s > 0")

    def observe(self, now: float, lag_ms: float) -> None:
        """One reading at `now`: the timer woke `lag_ms` later than asked."""
        lag_ms = max(0.0, lag_ms)
        if self._last is None:
            self._lag_ms = lag_ms
        else:
            weight = 1.0 - math.exp(-max(0.0, now - self._last) / self.window_s)
            self._lag_ms += weight * (lag_ms - self._lag_ms)
        self._last = now

    @property
    def lag_ms(self) -> float:
        """The smoothed lag."""
        return self._lag_ms

    def pressed(self) -> bool:
        """Whether the loop is behind by more than the threshold (never with threshold 0)."""
        return self.threshold_ms > 0 and self._lag_ms > self.threshold_ms
