"""A gate the test controls around a model's pre-inference: the engine runs the real layers, but
each pre-inference pauses before the layers the test names until the test opens them. Tests then
know that psi is still being produced (or that a given layer is next) instead of assuming it from
a sleep or a prefix length.

The pause happens inside the engine's step, on whichever thread runs pre-inference (the
pre-inference thread by default, the device thread with inline pre-inference). A pause that is
never opened gives up after `timeout_s` and records it in `timed_out`, so a failing test fails
instead of hanging.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator, Iterable, Sequence
from typing import Any

import pytest

from services.ranker.model import HSTURanker
from services.ranker.psi import Psi
from services.ranker.sequences import UserPrefix


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
        self._reached = {layer: threading.Event() for layer in pause_before}
        self._opened = {layer: threading.Event() for layer in pause_before}
        real = model.preinfer_steps

        def gated(prefixes: Sequence[UserPrefix]) -> Generator[int, None, list[Psi]]:
            steps = real(prefixes)
            layer = 0
            while True:
                self._pause(layer)
                try:
                    yield next(steps)
                except StopIteration as done:
                    result: list[Psi] = done.value
                    return result
                layer += 1

        monkeypatch.setattr(model, "preinfer_steps", gated)

    def _pause(self, layer: int) -> None:
        if layer not in self._opened:
            return
        self._reached[layer].set()
        if not self._opened[layer].wait(self.timeout_s):
            self.timed_out.append(layer)

    def reached(self, layer: int) -> bool:
        """Whether a pre-inference has come to the pause before `layer` (layers before it done)."""
        return self._reached[layer].is_set()

    async def wait_reached(self, layer: int, timeout_s: float = 30.0) -> None:
        """Waits (without blocking the event loop) until a pre-inference pauses before `layer`."""
        if not await asyncio.to_thread(self._reached[layer].wait, timeout_s):
            raise AssertionError(f"no pre-inference reached layer {layer} within {timeout_s} s")

    def open(self, layer: int | None = None) -> None:
        """Lets pre-inference past the pause before `layer` (every pause when None)."""
        for key, event in self._opened.items():
            if layer is None or key == layer:
                event.set()

    def __enter__(self) -> PreinferGate:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.open()  # never leave the engine paused behind a test
