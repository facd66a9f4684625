"""Packing of bulk token arrays on the wire, and the limits every edge enforces (in one place).

Arrays travel as little-endian bytes (see shared/protos/ranker.proto); decoding is a zero-copy
numpy view, validated for length and range. Errors are per-request (WireError), never fatal.

Limits, end to end (README "Limits"):
  * tokens per request: RequestLimits (profile, long-term prefix, recent, candidates);
  * the token arrays of the largest prefix: RequestLimits.max_prefix_wire_bytes (1,312,768 bytes
    by default: 8 per profile token, 8 + 4 + 8 per behaviour);
  * Kafka records: DEFAULT_MAX_RECORD_BYTES, the max.message.bytes of the topics the services
    create, and what they assume of a topic whose broker reports none (Tansu). It holds a retrieval
    event, and the pre-infer signal made from it, at the token limits with room to spare;
  * a dead letter is the original record plus DEAD_LETTER_HEADROOM_BYTES of headers at most, so
    the producers' max_request_size is the record limit plus that headroom.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from shared.protos import ranker_pb2 as pb

I64 = np.dtype("<i8")
I32 = np.dtype("<i4")
MAX_TIMESTAMP = 1 << 40  # epoch seconds; anything larger is garbage, not a date
# Bytes per token of the prefix arrays: a profile token is one int64; a behaviour an int64 item,
# an int32 action and an int64 timestamp.
PROFILE_TOKEN_BYTES = 8
BEHAVIOUR_TOKEN_BYTES = 8 + 4 + 8
# The largest Kafka record on the project's topics when the broker does not say (4 MiB: three
# times the largest valid retrieval event; Kafka's own default, 1 MiB, is smaller than that event).
DEFAULT_MAX_RECORD_BYTES = 4 << 20
# What a dead letter adds to the original record: its headers (reason, source topic, partition,
# offset, service, time; the reason is cut at MAX_REASON_BYTES) and the record's framing.
DEAD_LETTER_HEADROOM_BYTES = 16 << 10
MAX_REASON_BYTES = 2048
# A ranker's (or router's) Stats list the ranking deadlines of at most this many of the
# pre-inferences it holds, the earliest (StatsReply.preinfer_due_in_ms).
MAX_PREINFER_DUES = 256


class WireError(ValueError):
    """A malformed or out-of-bounds request or event (the caller gets INVALID_ARGUMENT / the DLQ)."""


@dataclass(frozen=True)
class RequestLimits:
    """Tokens per request, enforced by every edge that decodes a prefix or a suffix."""

    max_profile_tokens: int = 256
    max_prefix_tokens: int = 65_536
    max_recent_tokens: int = 4_096
    max_candidates: int = 2_048

    @property
    def max_prefix_wire_bytes(self) -> int:
        """Bytes of the token arrays of the largest prefix these limits accept."""
        return self.max_profile_tokens * PROFILE_TOKEN_BYTES + self.max_prefix_tokens * BEHAVIOUR_TOKEN_BYTES


def encode(values: npt.ArrayLike, dtype: np.dtype = I64) -> bytes:
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def decode(raw: bytes, dtype: np.dtype, field: str, max_len: int) -> npt.NDArray[np.int64]:
    """bytes -> int64 array; raises WireError for a ragged length or too many values."""
    if len(raw) % dtype.itemsize:
        raise WireError(f"{field}: {len(raw)} bytes is not a whole number of {dtype.itemsize}-byte values")
    n = len(raw) // dtype.itemsize
    if n > max_len:
        raise WireError(f"{field}: {n} values exceeds the limit of {max_len}")
    return np.frombuffer(raw, dtype=dtype).astype(np.int64)  # a writable copy (torch wants one)


def require_non_negative(
    values: npt.NDArray[np.signedinteger[Any]], field: str, upper: int | None = None
) -> None:
    if values.size and int(values.min()) < 0:
        raise WireError(f"{field}: values must be non-negative")
    if upper is not None and values.size and int(values.max()) >= upper:
        raise WireError(f"{field}: values must be below {upper}")


def behaviors_message(
    items: npt.ArrayLike, actions: npt.ArrayLike, timestamps: npt.ArrayLike
) -> pb.Behaviors:
    return pb.Behaviors(
        items_le=encode(items), actions_le=encode(actions, I32), timestamps_le=encode(timestamps)
    )


def prefix_message(
    user_id: int,
    prefix_version: int,
    profile: npt.ArrayLike,
    items: npt.ArrayLike,
    actions: npt.ArrayLike,
    timestamps: npt.ArrayLike,
) -> pb.UserPrefix:
    return pb.UserPrefix(
        user_id=user_id,
        prefix_version=prefix_version,
        profile_le=encode(profile),
        long_term=behaviors_message(items, actions, timestamps),
    )
