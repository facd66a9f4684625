"""A gate that acts while what its actions bring back pays for them, and on a sample otherwise.
Pure: no I/O, no clock. The mechanism of the demotion gate (demotion_gate.py: copies to host
DRAM, paid back by reloads) and the keep gate (keep_gate.py: psi kept by full rankings, paid
back by later calls reading it); each module says why, with the measurements.

Each opportunity to act is counted (`admits` asks once per candidate), each action (`acted`),
and each time one pays back (`returned`); actions and returns are exponentially weighted sums
over about the last `memory` opportunities, and their ratio is the returns per action. Counted
in opportunities, not actions, a closed gate (acting on one opportunity in `sample_every`)
forgets as fast as an open one; counted in actions it reached `sample_every` times further back.
At 16384 tokens (k20b, 2 x H200, 2026-11-30) the demotion gate, closed at a search's low rates
by copies of psi whose users never came back, still copied only 160 of 447 candidates at 42
req/s. Forgetting by opportunities it reopened there (k21b): 2.3-4.7% of its copies came back,
enough at the ~0.4 ms a copy it then priced, while a copy cost the ranker 2.2-3.4 ms of CPU
(demotion_gate.py: what the price now counts).

An action whose every return saves `saving_ms` of device time pays when returns per action x
saving_ms >= `cost_ms`, the host time the action costs. When it does not, one user in
`sample_every` (by user id: the same users each time) still gets it, so that the returns keep
being measured and the gate opens again when the workload changes. Until `min_actions` were
counted, or while either figure is unknown, the gate is open.
"""

from __future__ import annotations


class YieldGate:
    def __init__(self, sample_every: int = 8, min_actions: int = 128, memory: float = 1024.0) -> None:
        if sample_every < 1 or min_actions < 0 or memory < 1:
            raise ValueError("sample_every and memory >= 1, min_actions >= 0")
        self.sample_every = sample_every  # closed: one user in this many still gets the action
        self.min_actions = min_actions  # counted before the gate may close
        self.memory = memory  # opportunities the sums reach back over (exponential decay)
        self._actions = 0.0
        self._returns = 0.0
        self._counted = 0

    def considered(self) -> None:
        """One opportunity to act (`admits` counts it): older actions and returns weigh less."""
        decay = 1.0 - 1.0 / self.memory
        self._actions *= decay
        self._returns *= decay

    def acted(self) -> None:
        """One action taken."""
        self._actions += 1.0
        self._counted += 1

    def returned(self) -> None:
        """One action paid back."""
        self._returns += 1.0

    @property
    def returns_per_action(self) -> float | None:
        """Returns per action over about the last `memory` opportunities; None before `min_actions`
        (or while no action is left in the window)."""
        if self._counted < max(self.min_actions, 1) or self._actions <= 0.0:
            return None
        return self._returns / self._actions

    def earns(self, saving_ms: float | None, cost_ms: float | None) -> bool:
        """Whether an action whose returns save `saving_ms` each pays for its `cost_ms`."""
        r = self.returns_per_action
        if r is None or saving_ms is None or cost_ms is None:
            return True
        return r * saving_ms >= cost_ms

    def admits(self, user_id: int, saving_ms: float | None, cost_ms: float | None) -> bool:
        """Whether to act on this opportunity (counted as one): the action earns, or the user is one
        of the sample."""
        self.considered()
        return self.earns(saving_ms, cost_ms) or user_id % self.sample_every == 0
