"""The ranker's edge: protobuf messages -> validated internal inputs (and back, for clients).

Everything past this module sees only UserPrefix / RankingSuffix / Psi types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from services.ranker.sequences import Behaviors, InvalidSequenceError, RankingSuffix, UserPrefix
from shared.fingerprint import PrefixFingerprint, prefix_fingerprint
from shared.prefix_check import check_behaviors, check_prefix, check_prefix_ref
from shared.protos import ranker_pb2 as pb
from shared.wire import (
    I32,
    I64,
    MAX_TIMESTAMP,
    RequestLimits,
    WireError,
    decode,
    prefix_message,
    require_non_negative,
)


def behaviors_from_proto(msg: pb.Behaviors, name: str, max_len: int) -> Behaviors:
    items, actions, timestamps = check_behaviors(msg, name, max_len)
    return Behaviors(
        torch.from_numpy(items), torch.from_numpy(actions), torch.from_numpy(timestamps), checked=True
    )


@dataclass
class CheckedPrefix:
    """A ranking call's fallback prefix: fully validated, but turned into tensors only when a
    path reads its tokens (a full recompute, a reload that falls back to pre-inference). An HBM
    hit reads only its identity, length and content fingerprint (computed once, here at the
    edge, from the wire bytes), and skips that conversion."""

    user_id: int
    prefix_version: int
    length: int
    fingerprint: PrefixFingerprint
    _profile: npt.NDArray[np.int64] = field(repr=False)
    _long_term: tuple[npt.NDArray[np.int64], ...] = field(repr=False)
    _tensors: UserPrefix | None = field(default=None, repr=False)

    def tensors(self) -> UserPrefix:
        if self._tensors is None:
            items, actions, timestamps = (torch.from_numpy(a) for a in self._long_term)
            try:
                self._tensors = UserPrefix(
                    self.user_id,
                    self.prefix_version,
                    torch.from_numpy(self._profile),
                    Behaviors(items, actions, timestamps, checked=True),
                    self.fingerprint,
                    checked=True,
                )
            except InvalidSequenceError as exc:
                raise WireError(str(exc)) from None
        return self._tensors

    @property
    def digest(self) -> int:
        """The content half of the psi's key."""
        return self.fingerprint.digest


class PrefixRequired(Exception):
    """A call that named its prefix by reference needs the tokens: its psi is not usable here."""


@dataclass(frozen=True)
class PrefixReference:
    """A ranking call's prefix named, not carried (RankRequest.prefix_ref): enough for an HBM hit,
    an in-flight join or a reload of psi of exactly this content (`digest`, the fingerprint the
    reference carries; 0, absent, matches no psi); any path that needs the tokens raises
    PrefixRequired, which the service answers with FAILED_PRECONDITION so that the caller sends
    the prefix."""

    user_id: int
    prefix_version: int
    length: int
    digest: int

    def tensors(self) -> UserPrefix:
        raise PrefixRequired(
            f"prefix_required: psi of user {self.user_id} prefix version {self.prefix_version} is not "
            "usable on this instance; send the prefix itself"
        )


# What a ranking call brings for its fallback: the prefix, or a reference to it.
FallbackPrefix = CheckedPrefix | PrefixReference


def checked_prefix(msg: pb.UserPrefix, limits: RequestLimits) -> CheckedPrefix:
    """The rules are shared (shared/prefix_check.py, which the router also applies to signals)."""
    profile, long_term = check_prefix(msg, limits)
    lt = msg.long_term  # the wire bytes are the fingerprint's layout: hashed as they came
    fingerprint = prefix_fingerprint(msg.profile_le, lt.items_le, lt.actions_le, lt.timestamps_le)
    return CheckedPrefix(
        msg.user_id, msg.prefix_version, len(profile) + len(long_term[0]), fingerprint, profile, long_term
    )


def preinfer_prefix(req: pb.PreInferRequest, limits: RequestLimits) -> FallbackPrefix:
    """A PreInfer signal's prefix: carried (checked), or, for a prefetch only, named
    (PrefixReference: a prefetch never computes psi, so it needs no tokens). Raises WireError."""
    if req.HasField("prefix_ref"):
        if not req.prefetch_only:
            raise WireError(
                "prefix_ref: only a prefetch-only signal may name its prefix instead of carrying it"
            )
        if req.HasField("prefix"):
            raise WireError("prefix and prefix_ref: carry the prefix or name it, not both")
        check_prefix_ref(req.prefix_ref, limits)
        return PrefixReference(
            req.user_id, req.prefix_version, req.prefix_ref.length, req.prefix_ref.fingerprint
        )
    return checked_prefix(req.prefix, limits)


def prefix_from_proto(msg: pb.UserPrefix, limits: RequestLimits) -> UserPrefix:
    return checked_prefix(msg, limits).tensors()


def suffix_from_proto(req: pb.RankRequest, limits: RequestLimits) -> RankingSuffix:
    recent = behaviors_from_proto(req.recent, "recent", limits.max_recent_tokens)
    candidates = decode(req.candidates_le, I64, "candidates", limits.max_candidates)
    require_non_negative(candidates, "candidates")
    if not len(candidates):
        raise WireError("candidates: at least one candidate is required")
    if not 0 <= req.query_time < MAX_TIMESTAMP:
        raise WireError("query_time: out of range")
    return RankingSuffix(recent, torch.from_numpy(candidates), int(req.query_time), checked=True)


def rank_inputs(req: pb.RankRequest, limits: RequestLimits) -> tuple[FallbackPrefix, RankingSuffix]:
    """Validates a RankRequest: ids, the fallback (the prefix, same user and version, or a
    reference to it), sizes. Every check runs here, whatever path the call then takes."""
    if not req.request_id:
        raise WireError("request_id is required (Rank is idempotent by request id)")
    fallback = req.WhichOneof("fallback")
    if fallback is None:
        raise WireError("prefix is required (or prefix_ref): without it a cache miss could not be ranked")
    suffix = suffix_from_proto(req, limits)
    if fallback == "prefix_ref":
        check_prefix_ref(req.prefix_ref, limits, require_fingerprint=False)
        ref = req.prefix_ref
        return PrefixReference(req.user_id, req.prefix_version, ref.length, ref.fingerprint), suffix
    if req.prefix.user_id != req.user_id or req.prefix.prefix_version != req.prefix_version:
        raise WireError("prefix.user_id / prefix_version must equal the request's")
    return checked_prefix(req.prefix, limits), suffix


def prefix_to_proto(prefix: UserPrefix) -> pb.UserPrefix:
    lt = prefix.long_term
    return prefix_message(
        prefix.user_id,
        prefix.prefix_version,
        prefix.profile.numpy(),
        lt.items.numpy(),
        lt.actions.numpy(),
        lt.timestamps.numpy(),
    )


def suffix_fields(suffix: RankingSuffix) -> dict[str, object]:
    """Keyword arguments of a RankRequest for this suffix."""
    r = suffix.recent
    return {
        "recent": pb.Behaviors(
            items_le=r.items.numpy().astype(np.int64).tobytes(),
            actions_le=r.actions.numpy().astype(I32).tobytes(),
            timestamps_le=r.timestamps.numpy().astype(np.int64).tobytes(),
        ),
        "candidates_le": suffix.candidates.numpy().astype(np.int64).tobytes(),
        "query_time": suffix.query_time,
    }


def rank_request(prefix: UserPrefix, suffix: RankingSuffix, request_id: str) -> pb.RankRequest:
    """A RankRequest carrying the prefix (the fallback) and the suffix (for clients and tools)."""
    return pb.RankRequest(
        request_id=request_id,
        user_id=prefix.user_id,
        prefix_version=prefix.prefix_version,
        prefix=prefix_to_proto(prefix),
        **suffix_fields(suffix),  # type: ignore[arg-type]
    )


def by_reference(request: pb.RankRequest) -> pb.RankRequest:
    """The same ranking call naming its prefix instead of carrying it (see PrefixRef)."""
    slim = pb.RankRequest()
    slim.CopyFrom(request)
    p, lt = request.prefix, request.prefix.long_term
    fingerprint = prefix_fingerprint(p.profile_le, lt.items_le, lt.actions_le, lt.timestamps_le)
    slim.prefix_ref.length = fingerprint.length  # a oneof: this clears `prefix`
    slim.prefix_ref.fingerprint = fingerprint.digest
    return slim


def preinfer_request(
    prefix: UserPrefix,
    request_id: str,
    lease_deadline_unix_ms: int = 0,
    prefetch_only: bool = False,
    ranking_deadline_unix_ms: int = 0,
) -> pb.PreInferRequest:
    return pb.PreInferRequest(
        request_id=request_id,
        prefix=prefix_to_proto(prefix),
        lease_deadline_unix_ms=lease_deadline_unix_ms,
        prefetch_only=prefetch_only,
        ranking_deadline_unix_ms=ranking_deadline_unix_ms,
    )
