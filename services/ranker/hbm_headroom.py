"""Whether the psi budget fits the accelerator beside what the ranker holds once it is warm.
Pure: the caller reads the device.

The HBM cache admits psi up to `--hbm-budget-mb` and counts bytes exactly, but the device's
caching allocator serves blocks of many sizes (a psi is its prefix length x 32 KiB in the bench
preset, rounded up to 2 MiB), so it reserves more than it hands out. When a reservation then
finds the device full, the allocator frees every cached block and retries: a synchronising stall
of the whole device, and of the event loop where a tensor is freed meanwhile. Measured on one
H200 (k15a, the length mix, `--hbm-budget-mb 120000` on a 140 GiB device): reserved 140.2 GB
against 128.9 allocated, two retries in a run, one 26 ms stall of the ranker's event loop. So
a budget must leave part of the free memory to fragmentation: `margin` of it (default 10%).

Rankers that share a device (`--device-processes N`, the launcher's rankers_per_device) each
keep their own budget: the N budgets are judged together against the free memory, which each
process reads once it is warm (the others, started beside it, are warm by then or nearly: what
they have not taken yet makes the check lenient, never strict). Four processes on one H200 with
27.5 GB each (k18e) ran the device out of memory: 4 x 26.9 GiB beside ~108 GiB free is tight.

Verdicts: `fits`; `tight` (the budget takes more than 1 - margin of the free memory: served,
with a warning that says what to lower it to); `exceeds` (more than all of it: refused at
start-up, since psi would be refused or evicted early while the budget says there is room).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

DEFAULT_MARGIN = 0.10


class Verdict(Enum):
    FITS = "fits"
    TIGHT = "tight"
    EXCEEDS = "exceeds"


@dataclass(frozen=True)
class Headroom:
    budget_bytes: int  # one process's
    free_bytes: int  # free on the device once the ranker is warm (Accelerator.free_memory_bytes)
    margin: float
    processes: int = 1  # rankers sharing the device, each with this budget

    @property
    def advised_bytes(self) -> int:
        """The largest budget a process may have that leaves `margin` of the free memory to
        fragmentation, the processes' budgets together."""
        return int(self.free_bytes * (1.0 - self.margin)) // self.processes

    @property
    def verdict(self) -> Verdict:
        total = self.budget_bytes * self.processes
        if total > self.free_bytes:
            return Verdict.EXCEEDS
        if total > int(self.free_bytes * (1.0 - self.margin)):
            return Verdict.TIGHT
        return Verdict.FITS

    def message(self) -> str:
        """One line for the operator: the figures, and what to do where the verdict is not fits."""
        gib = 2**30
        each = f" in each of {self.processes} processes on the device" if self.processes > 1 else ""
        figures = (f"psi budget {self.budget_bytes / gib:.1f} GiB{each}, {self.free_bytes / gib:.1f} GiB free on "
                   f"the device once the ranker is warm")  # fmt: skip
        advice = (f"lower --hbm-budget-mb to at most {self.advised_bytes // 2**20} (leaving "
                  f"{self.margin:.0%} of the free memory to the allocator's fragmentation)")  # fmt: skip
        if self.verdict is Verdict.EXCEEDS:
            return f"{figures}: the budget exceeds the free memory; {advice}"
        if self.verdict is Verdict.TIGHT:
            return (f"{figures}: the budget leaves under {self.margin:.0%} of it to fragmentation, and the "
                    f"allocator will stall the device to retry when it runs out; {advice}")  # fmt: skip
        return f"{figures}: fits"


def judge(budget_bytes: int, free_bytes: int, margin: float = DEFAULT_MARGIN, processes: int = 1) -> Headroom:
    """The headroom of a psi budget, in each of `processes` rankers sharing a device with
    `free_bytes` free once the ranker is warm."""
    if budget_bytes <= 0 or free_bytes < 0:
        raise ValueError("budget_bytes must be > 0 and free_bytes >= 0")
    if not 0.0 <= margin < 1.0:
        raise ValueError("margin must be in [0, 1)")
    if processes < 1:
        raise ValueError("processes must be >= 1")
    return Headroom(budget_bytes, free_bytes, margin, processes)
