"""The validation rules of a user's prefix (and of any run of behaviours) as it comes off the wire,
with numpy alone: no tensors are built, so a service that only needs to know whether a prefix is
valid (the router, for a pre-infer signal) does not load torch.

The rules (the ranker's, who turns the same arrays into tensors: services/ranker/wire.py):
  * every array a whole number of little-endian values (int64; actions int32), within the
    per-request token limits (RequestLimits: profile tokens, long-term prefix tokens);
  * a run of behaviours has as many actions and timestamps as items;
  * item ids, actions, profile ids and timestamps are non-negative; a timestamp is below
    MAX_TIMESTAMP (epoch seconds).
A prefix that breaks one raises WireError naming the field, a per-request error (INVALID_ARGUMENT
for a call, the DLQ for a signal), never a fatal one.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from shared.protos import ranker_pb2 as pb
from shared.wire import I32, I64, MAX_TIMESTAMP, RequestLimits, WireError, decode, require_non_negative

__all__ = ["BehaviorArrays", "PrefixArrays", "check_behaviors", "check_prefix"]


class BehaviorArrays(NamedTuple):
    """A validated run of behaviours: equal lengths, int64 copies (writable, as torch wants)."""

    items: npt.NDArray[np.int64]
    actions: npt.NDArray[np.int64]
    timestamps: npt.NDArray[np.int64]


class PrefixArrays(NamedTuple):
    """A validated prefix's token arrays: profile ids and long-term behaviours."""

    profile: npt.NDArray[np.int64]
    long_term: BehaviorArrays

    @property
    def length(self) -> int:
        """Tokens in the prefix: profile tokens plus behaviours."""
        return len(self.profile) + len(self.long_term.items)


def check_behaviors(msg: pb.Behaviors, name: str, max_len: int) -> BehaviorArrays:
    """The arrays of `msg` (fields named `name`.items, ...) after every rule above; raises
    WireError for the first rule broken."""
    items = decode(msg.items_le, I64, f"{name}.items", max_len)
    actions = decode(msg.actions_le, I32, f"{name}.actions", max_len)
    timestamps = decode(msg.timestamps_le, I64, f"{name}.timestamps", max_len)
    if not len(items) == len(actions) == len(timestamps):
        raise WireError(
            f"{name}: {len(items)} items, {len(actions)} actions and {len(timestamps)} timestamps must match"
        )
    require_non_negative(items, f"{name}.items")
    require_non_negative(actions, f"{name}.actions")
    require_non_negative(timestamps, f"{name}.timestamps", MAX_TIMESTAMP)
    return BehaviorArrays(items, actions, timestamps)


def check_prefix(msg: pb.UserPrefix, limits: RequestLimits) -> PrefixArrays:
    """The token arrays of `msg` (fields named prefix.profile, prefix.long_term.items, ...) after
    every rule above; raises WireError for the first rule broken. The ids (user, version) are any
    uint64: whether they match a request's is the caller's rule."""
    profile = decode(msg.profile_le, I64, "prefix.profile", limits.max_profile_tokens)
    require_non_negative(profile, "prefix.profile")
    long_term = check_behaviors(msg.long_term, "prefix.long_term", limits.max_prefix_tokens)
    return PrefixArrays(profile, long_term)


def check_prefix_ref(ref: pb.PrefixRef, limits: RequestLimits, require_fingerprint: bool = True) -> None:
    """A prefix named instead of carried (PrefixRef): a possible length and, unless
    `require_fingerprint` is off, a fingerprint (0, the unset value, names no content: a ranking
    call by reference may send it and simply matches no psi). Raises WireError."""
    if not 0 < ref.length <= limits.max_profile_tokens + limits.max_prefix_tokens:
        raise WireError(f"prefix_ref.length: {ref.length} is not a possible prefix length")
    if require_fingerprint and not ref.fingerprint:
        raise WireError("prefix_ref.fingerprint is required")
