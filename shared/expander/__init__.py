"""The expander's contract: what a client of the per-host expander daemon needs, and what the
daemon (services/expander) shares with its clients. No torch (ArenaMapping.tensor imports it on
first use) and nothing of the daemon's own.

Modules: `entries` (the values the daemon reports: keys, leases, stats), `protocol` (framing and
validation of the control socket's messages; both sides use it), `mapping` (the fd handshake and
the client's mapping of the arena), `client` (the rankers' async client).
"""

from shared.expander.client import ExpanderClient, ExpanderError, ExpanderRefused, ExpanderUnavailable
from shared.expander.entries import Acquired, EntryInfo, EntryKey, EntryState, Reservation, StoreStats
from shared.expander.mapping import ArenaHandshakeError, ArenaMapping

__all__ = [
    "Acquired",
    "ArenaHandshakeError",
    "ArenaMapping",
    "EntryInfo",
    "EntryKey",
    "EntryState",
    "ExpanderClient",
    "ExpanderError",
    "ExpanderRefused",
    "ExpanderUnavailable",
    "Reservation",
    "StoreStats",
]
