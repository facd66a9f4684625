"""A ranker's CPU accelerator reporting device figures it does not have (free memory, allocator
counters), for tests of what the ranker does with them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class Reporting:
    """`accel` with `free_memory_bytes()` answering `free` and `allocator_stats()` the next of
    `readings`; everything else is `accel`'s."""

    def __init__(
        self, accel: Any, free: int | None = None, readings: Iterator[dict[str, int]] | None = None
    ) -> None:
        self._accel, self._free, self._readings = accel, free, readings

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accel, name)

    def free_memory_bytes(self) -> int | None:
        return self._free

    def allocator_stats(self) -> dict[str, int]:
        return next(self._readings) if self._readings is not None else self._accel.allocator_stats()
