"""What the expander daemon says about its entries: the values its store produces and its protocol
carries, frozen, with no I/O. The daemon's store (services/expander/store.py) builds them; clients
get them back from the wire (shared/expander/protocol.py).

`meta` dicts are the store's copies (daemon side) or freshly decoded (client side): treat them as
read-only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from shared.psi_key import PsiKey

__all__ = ["Acquired", "EntryInfo", "EntryKey", "EntryState", "Reservation", "StoreStats"]

# What a psi is valid for (user, prefix version, model version, content fingerprint): the ranker's
# own key type, so the two tiers cannot drift apart.
EntryKey = PsiKey


class EntryState(enum.Enum):
    WRITING = "writing"
    READY = "ready"
    EVICTED = "evicted"
    EXPIRED = "expired"
    ABORTED = "aborted"


@dataclass(frozen=True)
class EntryInfo:
    key: EntryKey
    state: EntryState  # WRITING or READY
    offset: int
    nbytes: int
    meta: dict[str, Any]
    pins: int  # live read leases


@dataclass(frozen=True)
class Reservation:
    """A write lease: fill [offset, offset + nbytes) of the arena, then commit or abort."""

    lease_id: int
    offset: int
    nbytes: int
    lease_s: float


@dataclass(frozen=True)
class Acquired:
    """A read lease (a pin): copy [offset, offset + nbytes) out, then release."""

    lease_id: int
    offset: int
    nbytes: int
    meta: dict[str, Any]
    lease_s: float


@dataclass(frozen=True)
class StoreStats:
    capacity: int
    used_bytes: int  # aligned blocks, WRITING and READY
    free_bytes: int
    largest_free: int
    stored_bytes: int  # sum of requested nbytes of live entries
    entries: int
    ready: int
    writing: int
    pinned: int  # READY entries with at least one read lease
    read_leases: int
    reservations: int
    commits: int
    aborts: int
    evictions: int
    expirations: int  # READY entries expired by TTL
    write_expirations: int
    pin_expirations: int
    hits: int  # acquire found a READY entry
    misses: int  # acquire found nothing usable
    refused_too_large: int
    refused_no_space: int
    refused_exists: int
