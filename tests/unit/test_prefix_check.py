"""shared/prefix_check.py: every rule of a prefix, with numpy alone, and the same verdict as the
ranker's edge (which builds tensors from the same arrays) on any input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.ranker.wire import prefix_from_proto
from shared.prefix_check import check_prefix
from shared.protos import ranker_pb2 as pb
from shared.wire import I32, MAX_TIMESTAMP, RequestLimits, WireError, encode, prefix_message

LIMITS = RequestLimits(max_profile_tokens=4, max_prefix_tokens=8)


def prefix(**fields: bytes) -> pb.UserPrefix:
    """A valid prefix (2 profile tokens, 3 behaviours) with some array fields replaced."""
    msg = prefix_message(7, 2, [1, 2], [10, 11, 12], [0, 1, 2], [100, 200, 300])
    for name, raw in fields.items():
        if name == "profile_le":
            msg.profile_le = raw
        else:
            setattr(msg.long_term, name, raw)
    return msg


def test_a_valid_prefix_gives_its_arrays() -> None:
    arrays = check_prefix(prefix(), LIMITS)
    assert arrays.length == 5
    assert arrays.profile.tolist() == [1, 2]
    assert arrays.long_term.items.tolist() == [10, 11, 12]
    assert arrays.long_term.actions.dtype == np.int64  # widened from the wire's int32
    assert arrays.long_term.timestamps.tolist() == [100, 200, 300]


def test_an_empty_prefix_is_valid() -> None:
    assert check_prefix(pb.UserPrefix(user_id=1), LIMITS).length == 0


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"profile_le": b"\x01\x02\x03"}, "prefix.profile: 3 bytes is not a whole number of 8-byte values"),
        ({"profile_le": encode([1] * 5)}, "prefix.profile: 5 values exceeds the limit of 4"),
        ({"profile_le": encode([-1])}, "prefix.profile: values must be non-negative"),
        ({"items_le": encode([1] * 9)}, "prefix.long_term.items: 9 values exceeds the limit of 8"),
        ({"actions_le": b"\x00" * 6}, "prefix.long_term.actions: 6 bytes is not a whole number of 4-byte"),
        ({"items_le": encode([1, 2])}, "2 items, 3 actions and 3 timestamps must match"),
        ({"items_le": encode([1, -2, 3])}, "prefix.long_term.items: values must be non-negative"),
        ({"actions_le": encode([0, -1, 0], I32)}, "prefix.long_term.actions: values must be non-negative"),
        (
            {"timestamps_le": encode([1, 2, MAX_TIMESTAMP])},
            f"timestamps: values must be below {MAX_TIMESTAMP}",
        ),
    ],
)
def test_each_rule_names_its_field(fields: dict[str, bytes], reason: str) -> None:
    with pytest.raises(WireError) as err:
        check_prefix(prefix(**fields), LIMITS)
    assert reason in str(err.value)


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=48), st.binary(max_size=80), st.binary(max_size=40), st.binary(max_size=80),
)  # fmt: skip
def test_same_verdict_as_the_rankers_edge(
    profile: bytes, items: bytes, actions: bytes, timestamps: bytes
) -> None:
    msg = pb.UserPrefix(
        user_id=3, prefix_version=1, profile_le=profile,
        long_term=pb.Behaviors(items_le=items, actions_le=actions, timestamps_le=timestamps),
    )  # fmt: skip
    verdicts: list[str] = []
    for check in (check_prefix, prefix_from_proto):
        try:
            check(msg, LIMITS)
        except WireError as exc:
            verdicts.append(str(exc))
        else:
            verdicts.append("valid")
    assert verdicts[0] == verdicts[1]
    if verdicts[0] != "valid":
        return
    arrays = check_prefix(msg, LIMITS)
    tensors = prefix_from_proto(msg, LIMITS)  # accepted here: accepted there, with the same tokens
    assert tensors.length == arrays.length
    assert tensors.profile.tolist() == arrays.profile.tolist()
    assert tensors.long_term.actions.tolist() == arrays.long_term.actions.tolist()
