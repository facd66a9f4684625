"""Packing of bulk token arrays on the wire, and the request limits every edge enforces.

Arrays travel as little-endian bytes (see shared/protos/ranker.proto); decoding is a zero-copy
numpy view, validated for length and range. Errors are per-request (WireError), never fatal.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shared.protos import ranker_pb2 as pb

I64 = np.dtype("<i8")
I32 = np.dtype("<i4")
MAX_TIMESTAMP = 1 << 40  # epoch seconds; anything larger is garbage, not a date


class WireError(ValueError):
    """A malformed or out-of-bounds request or event (the caller gets INVALID_ARGUMENT / the DLQ)."""


@dataclass(frozen=True)
class RequestLimits:
    max_profile_tokens: int = 256
    max_prefix_tokens: int = 65_536
    max_recent_tokens: int = 4_096
    max_candidates: int = 2_048


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


def require_non_negative(values: npt.NDArray[np.int64], field: str, upper: int | None = None) -> None:
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
