"""The queued ranking calls, kept in the orders the scheduler reads them, so that planning a step
costs the same whatever the backlog. Pure: no torch, no threads, no clock of its own.

Why: the scheduler used to be handed every queued call at every step and sorted, filtered and
costed all of them. On an H200 (mix, k14b, relay at 375 req/s) a 2 s burst left ~240 calls
queued; planning then took the device loop's thread 4.7 s of the point's ~25 (3.5 s of CPU;
~1 s at the rates either side), the instance drained at 234-310 req/s where it serves 420 when
its queue is short, and the backlog never cleared: 870 calls refused, P99 1.5 s. The baseline
collapsed the same way at its first miss (k14a, 375 req/s). A backlog must drain at the rate the
device serves, so a step's planning may not grow with it:

  * calls are held sorted by (deadline, arrival, enqueue order): earliest deadline first is a
    walk from the front;
  * live calls and doomed ones (predicted to finish past their `due_by` even if started now:
    IterationScheduler.doomed) are held apart. A call found doomed moves to the doomed order
    and stays there while the step costs stay as they were: for fixed costs doom only comes
    with time, so each call is found doomed once, not re-costed at every step behind a backlog
    of hopeless ones (when the costs change, the earliest doomed calls are judged again);
  * `window` gives the scheduler the earliest live calls, at most `limit` (or the earliest
    doomed ones when no call is live), and says whether more are queued behind them;
  * calls not started by their `start_by` are found by a heap (`overdue`), not by a scan.
Adding and removing a call costs O(log n) comparisons (and a memmove of the order's list).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduler imports this module
    from services.ranker.scheduler import RankItem

__all__ = ["RankQueue", "Window"]

# (deadline, submitted, enqueue order, id): the order ties as a stable sort of the calls in the
# order they were queued would; the id (never compared: the enqueue order is unique) finds the call.
_Key = tuple[float, float, int, int]


@dataclass(frozen=True)
class Window:
    """The calls a step is planned from, earliest deadline first. `doomed`: they are doomed ones
    (no call is live); `more`: calls of the same standing are queued behind them."""

    calls: list[RankItem]
    doomed: bool
    more: bool


class RankQueue:
    """Queued ranking calls by id (see the module docstring). Not thread-safe: the engine holds
    its lock around every use."""

    def __init__(self, items: Iterable[RankItem] = ()) -> None:
        self._order = itertools.count()
        self._items: dict[int, RankItem] = {}
        self._keys: dict[int, _Key] = {}
        self._doomed_ids: set[int] = set()
        self._doomed: list[_Key] = []
        self._start_by: list[tuple[float, int]] = []  # a heap; entries of removed calls linger
        self._live: list[_Key] = sorted(self._insert(item) for item in items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._items

    def __iter__(self) -> Iterator[RankItem]:
        return iter(self._items.values())

    def add(self, item: RankItem) -> None:
        """Queues a call (ValueError if its id is queued already)."""
        key = self._insert(item)
        self._live.insert(bisect.bisect_left(self._live, key), key)

    def remove(self, call_id: int) -> RankItem | None:
        """Takes a call out of the queue; None if it is not queued."""
        item = self._items.pop(call_id, None)
        if item is None:
            return None
        key = self._keys.pop(call_id)
        order = self._doomed if call_id in self._doomed_ids else self._live
        self._doomed_ids.discard(call_id)
        del order[bisect.bisect_left(order, key)]
        return item

    def clear(self) -> None:
        self._items.clear()
        self._keys.clear()
        self._doomed_ids.clear()
        self._live.clear()
        self._doomed.clear()
        self._start_by.clear()

    def overdue(self, now: float) -> list[RankItem]:
        """Removes and returns the calls whose `start_by` is before `now`."""
        gone: list[RankItem] = []
        heap = self._start_by
        while heap and heap[0][0] < now:
            start_by, call_id = heapq.heappop(heap)
            item = self._items.get(call_id)
            if item is not None and item.start_by == start_by:
                self.remove(call_id)
                gone.append(item)
        return gone

    def window(self, limit: int, is_doomed: Callable[[RankItem], bool], recheck: bool = False) -> Window:
        """The earliest-deadline live calls, at most `limit`: those found doomed on the way are
        moved to the doomed order. With no live call left, the earliest doomed ones. `recheck`
        (the step costs changed since the last window): the earliest `limit` doomed calls are
        judged again first, and those no longer doomed go back to the live order (a call found
        doomed while the costs were overestimated, e.g. before the fit had measured a batch,
        would otherwise wait behind every live call until its start_by)."""
        calls: list[RankItem] = []
        live, items = self._live, self._items
        if recheck:
            for key in [k for k in self._doomed[:limit] if not is_doomed(items[k[3]])]:
                del self._doomed[bisect.bisect_left(self._doomed, key)]
                self._doomed_ids.discard(key[3])
                live.insert(bisect.bisect_left(live, key), key)
        i = 0
        while i < len(live) and len(calls) < limit:
            key = live[i]
            item = items[key[3]]
            if is_doomed(item):
                del live[i]
                self._doomed.insert(bisect.bisect_left(self._doomed, key), key)
                self._doomed_ids.add(item.id)
                continue
            calls.append(item)
            i += 1
        if calls:
            return Window(calls, doomed=False, more=i < len(live))
        doomed = [items[k[3]] for k in self._doomed[:limit]]
        return Window(doomed, doomed=True, more=len(self._doomed) > limit)

    # ------------------------------------------------------------------ internals

    def _insert(self, item: RankItem) -> _Key:
        if item.id in self._items:
            raise ValueError(f"call {item.id} is queued already")
        key = (item.deadline, item.submitted, next(self._order), item.id)
        self._items[item.id] = item
        self._keys[item.id] = key
        if item.start_by != float("inf"):
            heapq.heappush(self._start_by, (item.start_by, item.id))
        return key
