"""Where a user's psi was pre-inferred: user -> (prefix version, content fingerprint, instance,
lease deadline).

The router records an entry when a ranker accepts a PreInfer it forwarded. For that user's ranking
request the entry takes precedence over the hash while the lease has not passed (the caller also
checks that the instance is still healthy), so the request finds its psi even if membership or
loads changed between the signal and the ranking call. The entry names psi by content too
(`fingerprint`, as the ranker computed it from the PreInfer's tokens): the router sends a ranking
call by reference only when its own prefix has that fingerprint (passthrough.rank_by_reference),
so a call whose tokens differ under the same prefix version goes whole, and is ranked from them.

Pure bookkeeping, driven from one asyncio loop (not thread-safe), with the clock passed in:

* `lookup` has no side effects (it neither refreshes nor reorders nor removes anything);
* the map is bounded: recording past `max_entries` evicts the oldest-recorded entries;
* expired entries are dropped by `expire(now)` (and never returned by `lookup`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["Residency", "ResidencyMap"]


@dataclass(frozen=True)
class Residency:
    user_id: int
    prefix_version: int
    fingerprint: int  # psi's content digest (shared/fingerprint.py), from the PreInferReply
    instance: str
    deadline: float  # the caller's clock (the router: time.monotonic())


class ResidencyMap:
    """One entry per user (the latest recorded pre-inference), at most `max_entries`."""

    def __init__(self, max_entries: int = 100_000) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be > 0")
        self.max_entries = max_entries
        self._entries: OrderedDict[int, Residency] = OrderedDict()  # oldest recorded first
        # (deadline, user) in deadline order; stale pairs (user re-recorded or evicted) are
        # skipped lazily and the heap is rebuilt when they dominate.
        self._deadlines: list[tuple[float, int]] = []
        self.evicted = 0  # entries dropped for space before their deadline (a sizing signal)

    def __len__(self) -> int:
        return len(self._entries)

    def record(
        self,
        user_id: int,
        prefix_version: int,
        instance: str,
        deadline: float,
        now: float,
        *,
        fingerprint: int,
    ) -> None:
        """Records (or replaces) the user's entry: psi of content `fingerprint` on `instance`. An
        already-expired deadline records nothing (and drops the user's older entry)."""
        if deadline <= now:
            self._entries.pop(user_id, None)
            return
        self._entries.pop(user_id, None)
        self._entries[user_id] = Residency(user_id, prefix_version, fingerprint, instance, deadline)
        heapq.heappush(self._deadlines, (deadline, user_id))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.evicted += 1
        if len(self._deadlines) > 2 * len(self._entries) + 64:
            self._deadlines = [(e.deadline, e.user_id) for e in self._entries.values()]
            heapq.heapify(self._deadlines)

    def lookup(self, user_id: int, prefix_version: int, now: float) -> Residency | None:
        """The user's live entry for exactly this prefix version, else None (whatever the content:
        placement follows the user's psi; the caller checks a reference against `fingerprint`).
        No side effects."""
        entry = self._entries.get(user_id)
        if entry is None or entry.prefix_version != prefix_version or entry.deadline <= now:
            return None
        return entry

    def forget(self, user_id: int, instance: str | None = None) -> None:
        """Drops the user's entry (only if it names `instance`, when given)."""
        entry = self._entries.get(user_id)
        if entry is not None and (instance is None or entry.instance == instance):
            del self._entries[user_id]

    def expire(self, now: float) -> int:
        """Drops every entry whose deadline has passed; returns how many were dropped."""
        dropped = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, user_id = heapq.heappop(self._deadlines)
            entry = self._entries.get(user_id)
            if entry is not None and entry.deadline == deadline:
                del self._entries[user_id]
                dropped += 1
        return dropped
