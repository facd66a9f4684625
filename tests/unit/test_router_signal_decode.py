"""The router's reading of pre-infer signals (services/router/signals.py decode_signal): a signal
carries its prefix, or, prefetch-only, names it; anything else is malformed, with the reason."""

from __future__ import annotations

import time

import pytest

from services.router.signals import MalformedSignal, decode_signal
from shared.protos import events_pb2 as ev
from shared.protos import ranker_pb2 as pb
from shared.wire import RequestLimits, prefix_message

LIMITS = RequestLimits()


def carried() -> ev.PreInferSignal:
    return ev.PreInferSignal(schema_version=1, request_id="s1", signal_time_unix_ms=int(time.time() * 1e3),
                             prefix=prefix_message(7, 2, [1, 2], [10, 11, 12], [0, 1, 0], [5, 6, 7]))  # fmt: skip


def named() -> ev.PreInferSignal:
    return ev.PreInferSignal(schema_version=1, request_id="s2", prefetch_only=True, user_id=7, prefix_version=2,
                             prefix_ref=pb.PrefixRef(length=5, fingerprint=0xABC))  # fmt: skip


def test_a_signal_carries_its_prefix_or_prefetch_only_names_it():
    assert decode_signal(carried().SerializeToString(), LIMITS).prefix.user_id == 7
    signal = decode_signal(named().SerializeToString(), LIMITS)
    assert (signal.user_id, signal.prefix_ref.fingerprint) == (7, 0xABC)
    prefetch = carried()
    prefetch.prefetch_only = True  # a prefetch may carry its prefix too
    assert decode_signal(prefetch.SerializeToString(), LIMITS).prefetch_only


def _broken(change) -> bytes:
    signal = named()
    change(signal)
    return signal.SerializeToString()


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (_broken(lambda s: setattr(s, "prefetch_only", False)), "only a prefetch-only signal may name"),
        (_broken(lambda s: s.prefix.CopyFrom(carried().prefix)), "carries its prefix or names it, not both"),
        (_broken(lambda s: setattr(s.prefix_ref, "length", 0)), "not a possible prefix length"),
        (_broken(lambda s: setattr(s.prefix_ref, "length", 10**9)), "not a possible prefix length"),
        (_broken(lambda s: setattr(s.prefix_ref, "fingerprint", 0)), "fingerprint is required"),
        (ev.PreInferSignal(schema_version=1, request_id="s3").SerializeToString(), "prefix is required"),
    ],
)
def test_a_malformed_signal_says_why(value, reason):
    with pytest.raises(MalformedSignal, match=reason):
        decode_signal(value, LIMITS)
