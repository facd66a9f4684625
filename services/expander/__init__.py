"""The memory-aware expander: a per-host daemon keeping demoted psi in one shared host-DRAM arena.

Rankers demote a user's psi into the arena (reserve, copy, commit) and reload it when the user
returns (acquire, copy, release); only offsets and lengths cross the control socket. Modules:
`store` (the entry state machine), `allocator` (page-aligned first fit), `arena` (memfd mapping),
`protocol` (framing and validation), `server` (the daemon), `client` (the rankers' async client).
Run the daemon with `python -m services.expander --help`.
"""

from services.expander.arena import ArenaMapping
from services.expander.client import ExpanderClient, ExpanderError, ExpanderRefused, ExpanderUnavailable
from services.expander.config import ExpanderConfig
from services.expander.store import Acquired, EntryInfo, EntryKey, EntryState, Reservation, StoreStats

__all__ = [
    "Acquired",
    "ArenaMapping",
    "EntryInfo",
    "EntryKey",
    "EntryState",
    "ExpanderClient",
    "ExpanderConfig",
    "ExpanderError",
    "ExpanderRefused",
    "ExpanderUnavailable",
    "Reservation",
    "StoreStats",
]
