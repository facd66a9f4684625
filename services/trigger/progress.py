"""Which records this trigger has already handled: processing is idempotent per (partition, offset).

A record handled but not yet covered by a committed offset comes again after a failed commit and
a rebalance (at-least-once delivery). Its decision, counters and output were made the first time:
handling it again would count it twice, account its pre-inference twice on the ledger and the
offered load, and send its signal twice. So every record handled since the last successful
commit of its partition is remembered here, by (partition, offset) and an identity (timestamp,
key, value size) that tells it from a different record at the same offset (a memory-only broker
that restarted numbers its records from 0 again). Pure: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

_Identity = tuple[int, bytes | None, int]


def _identity(record: Any) -> _Identity:
    value = record.value
    return (record.timestamp, record.key, -1 if value is None else len(value))


class Processed:
    """Records handled and not yet committed, oldest first, at most `max_entries` (beyond that the
    oldest are forgotten: delivery is at-least-once, this only stops the usual duplicates)."""

    def __init__(self, max_entries: int = 200_000) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be > 0")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[Any, int], _Identity] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def seen(self, tp: Any, record: Any) -> bool:
        """True if this very record (same partition, offset and identity) was handled already."""
        return self._entries.get((tp, record.offset)) == _identity(record)

    def add(self, tp: Any, record: Any) -> None:
        self._entries[(tp, record.offset)] = _identity(record)
        self._entries.move_to_end((tp, record.offset))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def committed(self, tp: Any, offset: int) -> None:
        """The partition's committed offset is now `offset`: records before it never come again."""
        for key in [k for k in self._entries if k[0] == tp and k[1] < offset]:
            del self._entries[key]
