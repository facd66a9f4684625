"""Property tests: every decoder at a service edge fails only with its own per-request error."""

from __future__ import annotations

import contextlib
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.fuzz import _valid, malformed
from services.ranker.wire import prefix_from_proto, rank_inputs
from services.trigger.service import EventError, parse_event
from shared.protos import events_pb2 as ev
from shared.protos import ranker_pb2 as pb
from shared.wire import RequestLimits, WireError

LIMITS = RequestLimits()
BASE = _valid(random.Random(0), 1)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=512))
def test_parse_event_on_random_bytes(raw):
    with contextlib.suppress(EventError):
        parse_event(raw, LIMITS)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32))
def test_parse_event_on_broken_events(seed):
    raw = malformed(random.Random(seed), BASE)
    try:
        parse_event(raw, LIMITS)
    except EventError:
        return
    raise AssertionError("a malformed event was accepted")


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=96), st.binary(max_size=96), st.binary(max_size=96), st.binary(max_size=96),
    st.integers(0, 2**64 - 1), st.integers(-(2**63), 2**63 - 1),
)  # fmt: skip
def test_rank_request_decoding(items, actions, timestamps, candidates, user, query_time):
    prefix = pb.UserPrefix(user_id=user, prefix_version=1, profile_le=items[:16],
                           long_term=pb.Behaviors(items_le=items, actions_le=actions, timestamps_le=timestamps))  # fmt: skip
    request = pb.RankRequest(request_id="r", user_id=user, prefix_version=1, prefix=prefix,
                             recent=prefix.long_term, candidates_le=candidates, query_time=query_time)  # fmt: skip
    with contextlib.suppress(WireError):
        prefix_from_proto(prefix, LIMITS)
    try:
        checked, _ = rank_inputs(request, LIMITS)
    except WireError:
        return
    # Everything is checked up front: a hit never builds the tensors, and a fallback that does
    # cannot fail then.
    assert checked.tensors().length == checked.length


def test_a_valid_event_still_parses():
    meta, event = parse_event(BASE.SerializeToString(), LIMITS)
    assert meta.user_id == 1
    assert isinstance(event, ev.RetrievalEvent)
