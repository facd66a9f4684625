"""A gate the test controls around a model's pre-inference: the engine runs the real chunks, but
pre-inference pauses before the chunk steps the test names until the test opens them. Tests then
know that psi is still being produced (or that a given step is next) instead of assuming it from
a sleep or a prefix length.

Steps are the engine's calls of `HSTURanker.preinfer_chunks` (one batch of chunks each), counted
from 0 on this model. The pause happens inside the engine's step, on the device thread: nothing
else runs on the device meanwhile, but the event loop does (ranking calls arrive, join, take
over). A pause that is never opened gives up after `timeout_s` and records it in `timed_out`, so a
failing test fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import pytest

from services.ranker.model import HSTURanker, PrefixChunk


class PreinferGate:
    def __init__(
        self,
        model: HSTURanker,
        monkeypatch: pytest.MonkeyPatch,
        pause_before: Iterable[int] = (0,),
        timeout_s: float = 30.0,
    ) -> None:
        self.timeout_s = timeout_s
        self.timed_out: list[int] = []
        self.chunks: list[tuple[int, int]] = []  # (start, end) of every chunk run, in order
        self.users: list[int] = []  # the user of each of them
        self._reached = {step: threading.Event() for step in pause_before}
        self._opened = {step: threading.Event() for step in pause_before}
        real = model.preinfer_chunks
        steps = itertools.count()

        def gated(chunks: Sequence[PrefixChunk]) -> None:
            self._pause(next(steps))
            real(chunks)
            self.chunks.extend((c.start, c.end) for c in chunks)
            self.users.extend(c.prefix.user_id for c in chunks)

        monkeypatch.setattr(model, "preinfer_chunks", gated)

    def _pause(self, step: int) -> None:
        if step not in self._opened:
            return
        self._reached[step].set()
        if not self._opened[step].wait(self.timeout_s):
            self.timed_out.append(step)

    def reached(self, step: int) -> bool:
        """Whether a pre-inference has come to the pause before `step` (steps before it done)."""
        return self._reached[step].is_set()

    async def wait_reached(self, step: int, timeout_s: float = 30.0) -> None:
        """Waits (without blocking the event loop) until a pre-inference pauses before `step`."""
        if not await asyncio.to_thread(self._reached[step].wait, timeout_s):
            raise AssertionError(f"no pre-inference reached step {step} within {timeout_s} s")

    def open(self, step: int | None = None) -> None:
        """Lets pre-inference past the pause before `step` (every pause when None)."""
        for key, event in self._opened.items():
            if step is None or key == step:
                event.set()

    def __enter__(self) -> PreinferGate:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.open()  # never leave the engine paused behind a test
