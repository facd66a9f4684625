"""The router's placement-key scanner (services/router/passthrough.py) against the protobuf parser
itself: the same values wherever the parser reads the same bytes, MalformedMessage only for bytes
the parser rejects too (never a request a ranker would accept)."""

from __future__ import annotations

import random

import pytest
from google.protobuf.message import DecodeError
from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.ranker.wire import by_reference
from services.router.passthrough import MalformedMessage, preinfer_key, rank_by_reference, rank_key
from shared.fingerprint import prefix_fingerprint
from shared.protos import ranker_pb2 as pb

U64 = (1 << 64) - 1
uint64s = st.one_of(st.sampled_from([0, 1, 127, 128, (1 << 63) - 1, 1 << 63, U64]), st.integers(0, U64))
int64s = st.one_of(
    st.sampled_from([0, -1, 1, -(1 << 63), (1 << 63) - 1]), st.integers(-(1 << 63), (1 << 63) - 1)
)


def varint(value: int) -> bytes:
    value &= U64
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(field: int, wire: int) -> bytes:
    return varint(field << 3 | wire)


def length_delimited(field: int, payload: bytes) -> bytes:
    return tag(field, 2) + varint(len(payload)) + payload


def prefix_message(user_id: int, version: int, tokens: int = 5) -> pb.UserPrefix:
    return pb.UserPrefix(
        user_id=user_id,
        prefix_version=version,
        profile_le=bytes(range(8)) * 2,
        long_term=pb.Behaviors(items_le=b"\x01" * 8 * tokens, actions_le=b"\x02" * 4 * tokens,
                               timestamps_le=b"\x03" * 8 * tokens),
    )  # fmt: skip


def rank_message(user_id: int, version: int, request_id: str = "r-1") -> pb.RankRequest:
    return pb.RankRequest(
        request_id=request_id,
        user_id=user_id,
        prefix_version=version,
        prefix=prefix_message(user_id, version),
        recent=pb.Behaviors(items_le=b"\x07" * 16, actions_le=b"\x01" * 8, timestamps_le=b"\x09" * 16),
        candidates_le=b"\x05" * 8 * 3,
        query_time=1_700_000_000,
    )


def parsed_rank(data: bytes) -> tuple[int, int] | None:
    """What the protobuf parser (the ranker's) makes of the bytes; None if it rejects them."""
    try:
        msg = pb.RankRequest.FromString(data)
    except DecodeError:
        return None
    return msg.user_id, msg.prefix_version


def parsed_preinfer(data: bytes) -> tuple[int, int, int] | None:
    try:
        msg = pb.PreInferRequest.FromString(data)
    except DecodeError:
        return None
    if not msg.HasField("prefix"):  # a prefetch by reference names its user and version itself
        return msg.user_id, msg.prefix_version, msg.lease_deadline_unix_ms
    return msg.prefix.user_id, msg.prefix.prefix_version, msg.lease_deadline_unix_ms


def scanned(scan, data: bytes):
    try:
        return scan(data)
    except MalformedMessage:
        return None


def top_level_fields(data: bytes) -> list[bytes]:
    """The serialized top-level fields of a message our generated classes wrote (no groups)."""
    fields, pos = [], 0
    while pos < len(data):
        start = pos
        key, pos = read_varint(data, pos)
        wire = key & 7
        if wire == 0:
            _, pos = read_varint(data, pos)
        elif wire == 2:
            size, pos = read_varint(data, pos)
            pos += size
        else:
            pos += {1: 8, 5: 4}[wire]
        fields.append(data[start:pos])
    return fields


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


# ---------------------------------------------------------------------- well-formed messages


@settings(max_examples=300, deadline=None)
@given(user_id=uint64s, version=uint64s, request_id=st.text(max_size=40), prefix_user=uint64s)
def test_rank_key_reads_what_the_generated_class_wrote(user_id, version, request_id, prefix_user):
    msg = rank_message(user_id, version, request_id)
    msg.prefix.user_id = prefix_user  # a nested field with the same number is not the request's
    assert rank_key(msg.SerializeToString()) == (user_id, version)


@settings(max_examples=300, deadline=None)
@given(user_id=uint64s, version=uint64s, lease=int64s, request_id=st.text(max_size=40))
@example(user_id=0, version=0, lease=0, request_id="")  # every field at its default: nothing on the wire
def test_preinfer_key_reads_what_the_generated_class_wrote(user_id, version, lease, request_id):
    msg = pb.PreInferRequest(
        request_id=request_id, prefix=prefix_message(user_id, version), lease_deadline_unix_ms=lease
    )
    assert preinfer_key(msg.SerializeToString()) == (user_id, version, lease)


@settings(max_examples=200, deadline=None)
@given(user_id=uint64s, version=uint64s, lease=int64s)
def test_preinfer_key_of_a_prefetch_by_reference(user_id, version, lease):
    msg = pb.PreInferRequest(request_id="p", prefetch_only=True, user_id=user_id, prefix_version=version,
                             prefix_ref=pb.PrefixRef(length=9, fingerprint=5), lease_deadline_unix_ms=lease)  # fmt: skip
    assert preinfer_key(msg.SerializeToString()) == (user_id, version, lease)
    # A message with a prefix: the prefix's ids, whatever the top-level fields say.
    msg.prefix.CopyFrom(prefix_message(3, 4))
    assert preinfer_key(msg.SerializeToString()) == parsed_preinfer(msg.SerializeToString()) == (3, 4, lease)


def test_an_empty_message_is_all_defaults():
    assert rank_key(b"") == (0, 0)
    assert preinfer_key(b"") == (0, 0, 0)
    assert preinfer_key(pb.PreInferRequest(prefix=pb.UserPrefix()).SerializeToString()) == (0, 0, 0)


@settings(max_examples=200, deadline=None)
@given(user_id=uint64s, version=uint64s, lease=int64s, seed=st.integers(0, 2**32))
def test_fields_in_any_order(user_id, version, lease, seed):
    rng = random.Random(seed)
    rank_fields = top_level_fields(rank_message(user_id, version).SerializeToString())
    rng.shuffle(rank_fields)
    shuffled = b"".join(rank_fields)
    assert rank_key(shuffled) == parsed_rank(shuffled) == (user_id, version)
    pre = pb.PreInferRequest(
        request_id="p", prefix=prefix_message(user_id, version), lease_deadline_unix_ms=lease
    )
    pre_fields = top_level_fields(pre.SerializeToString())
    rng.shuffle(pre_fields)
    prefix_fields = top_level_fields(prefix_message(user_id, version).SerializeToString())
    rng.shuffle(prefix_fields)
    # The prefix's own fields shuffled too.
    shuffled = b"".join(
        length_delimited(2, b"".join(prefix_fields)) if f.startswith(b"\x12") else f for f in pre_fields
    )
    assert preinfer_key(shuffled) == parsed_preinfer(shuffled) == (user_id, version, lease)


@settings(max_examples=200, deadline=None)
@given(first=st.tuples(uint64s, uint64s, int64s), second=st.tuples(uint64s, uint64s, int64s))
def test_repeated_occurrences_last_wins_and_prefixes_merge(first, second):
    # Concatenated messages parse as one, merged: each scalar's last occurrence wins (proto3 does
    # not write a field at its default 0, so the second message's zeros leave the first's values).
    a = rank_message(first[0], first[1]).SerializeToString()
    b = rank_message(second[0], second[1]).SerializeToString()
    expected = (second[0] or first[0], second[1] or first[1])
    assert rank_key(a + b) == parsed_rank(a + b) == expected
    explicit = tag(2, 0) + varint(first[0]) + tag(2, 0) + varint(second[0]) + tag(3, 0) + varint(0)
    assert rank_key(explicit) == parsed_rank(explicit) == (second[0], 0)
    # Two occurrences of the prefix message merge field by field.
    head = length_delimited(2, tag(1, 0) + varint(first[0]) + tag(2, 0) + varint(first[1]))
    tail = length_delimited(2, tag(2, 0) + varint(second[1]))
    lease = tag(3, 0) + varint(first[2]) + tag(3, 0) + varint(second[2])
    data = head + lease + tail
    assert preinfer_key(data) == parsed_preinfer(data) == (first[0], second[1], second[2])


def test_unknown_fields_of_every_wire_type_are_skipped():
    unknown = (
        tag(100, 0) + varint(U64)  # varint
        + tag(101, 1) + b"\x10" * 8  # fixed64 (bytes that look like a user_id tag)
        + length_delimited(102, tag(2, 0) + varint(999))  # a nested "user_id" inside
        + tag(103, 3) + tag(2, 0) + varint(888) + tag(104, 3) + tag(104, 4) + tag(103, 4)  # nested groups
        + tag(105, 5) + b"\x18" * 4  # fixed32
        + tag(1 << 28, 0) + varint(1)  # a large field number (5-byte tag)
    )  # fmt: skip
    fields = top_level_fields(rank_message(42, 7).SerializeToString())
    for at in range(len(fields) + 1):  # before, between and after the known fields
        data = b"".join(fields[:at]) + unknown + b"".join(fields[at:])
        assert rank_key(data) == parsed_rank(data) == (42, 7)
    pre = pb.PreInferRequest(request_id="x", prefix=prefix_message(42, 7), lease_deadline_unix_ms=-3)
    data = unknown + pre.SerializeToString() + unknown
    assert preinfer_key(data) == parsed_preinfer(data) == (42, 7, -3)


def test_a_known_field_with_another_wire_type_is_an_unknown_field():
    # As in protobuf: user_id sent length-delimited or fixed64 is skipped, not read, not an error.
    for wrong in (length_delimited(2, varint(5)), tag(2, 1) + b"\x05" + bytes(7), tag(2, 5) + b"\x05\0\0\0"):
        data = tag(2, 0) + varint(9) + wrong + tag(3, 0) + varint(4)
        assert rank_key(data) == parsed_rank(data) == (9, 4)
    data = tag(2, 0) + varint(11) + tag(3, 0) + varint(1)  # a varint where PreInfer expects its prefix
    assert preinfer_key(data) == parsed_preinfer(data) == (0, 0, 1)


def test_varint_edges_match_the_parser():
    cases = {
        "ten bytes, 2**64 - 1": b"\xff" * 9 + b"\x01",
        "ten bytes, bits beyond 64 dropped": b"\xff" * 9 + b"\x7f",
        "ten bytes, value 0 (non-canonical)": b"\x80" * 9 + b"\x00",
        "two bytes, value 1 (non-canonical)": b"\x81\x00",
    }
    for name, raw in cases.items():
        data = tag(2, 0) + raw
        assert rank_key(data) == parsed_rank(data), name
    data = tag(2, 0) + b"\xff" * 10 + b"\x01"  # eleven bytes
    assert parsed_rank(data) is None
    with pytest.raises(MalformedMessage, match="longer than 10 bytes"):
        rank_key(data)


# ---------------------------------------------------------------------- malformed bytes


def test_every_truncation_agrees_with_the_parser():
    msg = rank_message(123_456_789, 3).SerializeToString()
    pre = pb.PreInferRequest(request_id="t", prefix=prefix_message(5, 6), lease_deadline_unix_ms=-9)
    pre_bytes = pre.SerializeToString()
    cut_somewhere = 0
    for cut in range(len(msg)):
        assert scanned(rank_key, msg[:cut]) == parsed_rank(msg[:cut]), cut
        cut_somewhere += scanned(rank_key, msg[:cut]) is None
    for cut in range(len(pre_bytes)):
        assert scanned(preinfer_key, pre_bytes[:cut]) == parsed_preinfer(pre_bytes[:cut]), cut
    assert cut_somewhere > len(msg) // 2  # most cuts land inside a field: the scanner saw them


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x10", "truncated varint"),
        (b"\x10\x80", "truncated varint"),
        (b"\x80", "truncated tag"),
        (b"\x16\x01", "invalid wire type 6"),
        (b"\x17\x01", "invalid wire type 7"),
        (b"\x00\x01", "field number 0"),
        (b"\x02\x00", "field number 0"),
        (b"\x22\x05\x00", "runs past the end"),
        (b"\x0a" + b"\x81\x80\x80\x80\x80\x00" + b"a", "length at byte 1 is longer than 5 bytes"),
        (b"\x90\x80\x80\x80\x80\x00\x05", "tag at byte 0 is longer than 5 bytes"),
        (b"\x90\x80\x80\x80\x70\x05", "tag at byte 0 does not fit in 32 bits"),
        (b"\x11\x00\x00", "truncated fixed64"),
        (b"\x15\x00", "truncated fixed32"),
        (b"\x4c", "without its start"),
        (b"\x4b\x08\x01", "not closed"),
        (b"\x4b\x54", "closed by the end of group 10"),
        (b"\x4b" * 101 + b"\x4c" * 101, "nested deeper than 100"),
    ],
)
def test_malformed_bytes_raise_with_a_reason_the_parser_rejects_them_too(data, reason):
    assert parsed_rank(data) is None
    with pytest.raises(MalformedMessage, match=reason):
        rank_key(data)
    assert parsed_preinfer(data) is None
    with pytest.raises(MalformedMessage, match=reason):
        preinfer_key(data)


def test_groups_nest_up_to_the_parsers_limit():
    data = b"\x4b" * 100 + b"\x4c" * 100 + tag(2, 0) + varint(8)
    assert rank_key(data) == parsed_rank(data) == (8, 0)
    # Inside the PreInfer's prefix one level is already used by the prefix message itself.
    for depth, ok in ((99, True), (100, False)):
        inner = b"\x4b" * depth + b"\x4c" * depth + tag(1, 0) + varint(8)
        data = length_delimited(2, inner)
        assert (parsed_preinfer(data) is not None) is ok
        assert (scanned(preinfer_key, data) is not None) is ok


def test_random_corruption_never_rejects_what_the_parser_accepts():
    """Byte flips, insertions and deletions in valid requests: where the scanner gives up, the
    parser does too; where both read the bytes, they read the same key."""
    rng = random.Random(1234)
    seeds = [rank_message(rng.getrandbits(64), rng.getrandbits(64)).SerializeToString() for _ in range(4)] + [
        b"\x10\x05\x18\x07",
        b"\x4b\x10\x01\x4c\x10\x02",
    ]
    pre_seeds = [
        pb.PreInferRequest(request_id="p", prefix=prefix_message(rng.getrandbits(64), 2),
                           lease_deadline_unix_ms=rng.randint(-(1 << 63), (1 << 63) - 1)).SerializeToString()
        for _ in range(4)
    ]  # fmt: skip
    outcomes = {"both read": 0, "both reject": 0, "parser only rejects": 0}
    for _ in range(3000):
        for scan, parse, pool in ((rank_key, parsed_rank, seeds), (preinfer_key, parsed_preinfer, pre_seeds)):
            data = bytearray(rng.choice(pool))
            for _ in range(rng.randint(1, 3)):
                op, at = rng.randrange(3), rng.randrange(len(data) + 1)
                if op == 0 and at < len(data):
                    data[at] = rng.choice([rng.randrange(256), 0x80, 0x00, 0x0C, 0x0B, 0x16, 0xFF])
                elif op == 1:
                    data[at:at] = bytes([rng.randrange(256)])
                elif at < len(data):
                    del data[at]
            got, want = scanned(scan, bytes(data)), parse(bytes(data))
            if got is None:
                assert want is None, bytes(data).hex()
                outcomes["both reject"] += 1
            elif want is not None:
                assert got == want, bytes(data).hex()
                outcomes["both read"] += 1
            else:  # the parser rejected something below the top level (a nested message, UTF-8)
                outcomes["parser only rejects"] += 1
    # The corruptions exercise every path (not a test that passes by never getting there).
    assert min(outcomes.values()) > 200, outcomes


# ---------------------------------------------------------------------- ranking by reference


def without_fallback(msg: pb.RankRequest) -> pb.RankRequest:
    out = pb.RankRequest()
    out.CopyFrom(msg)
    out.ClearField("fallback")
    return out


def digest_of(msg: pb.RankRequest) -> int:
    """The content fingerprint of the request's prefix, as the ranker computes it."""
    p, lt = msg.prefix, msg.prefix.long_term
    return prefix_fingerprint(p.profile_le, lt.items_le, lt.actions_le, lt.timestamps_le).digest


GOOD_DIGEST = digest_of(rank_message(77, 4))


def test_a_reference_replaces_the_prefix_and_keeps_everything_else():
    msg = rank_message(77, 4)
    slim = rank_by_reference(msg.SerializeToString(), digest_of(msg))
    assert slim is not None
    got = pb.RankRequest.FromString(slim)
    assert got.WhichOneof("fallback") == "prefix_ref"
    assert got.prefix_ref.length == 2 + 5  # profile (16 bytes) + long-term items (40 bytes)
    assert got.prefix_ref.fingerprint == digest_of(msg)
    assert without_fallback(got) == without_fallback(msg)
    assert slim == by_reference(msg).SerializeToString()  # what the ranker's own client makes


def test_a_prefix_with_other_tokens_than_the_resident_psi_goes_whole():
    """Finding 3 at the router: same user, prefix version and length, one token changed. The
    residency map names psi of the old tokens; a reference would let the ranker serve it."""
    old = rank_message(77, 4)
    new = rank_message(77, 4)
    items = bytearray(new.prefix.long_term.items_le)
    items[-1] ^= 1  # the last token's item id
    new.prefix.long_term.items_le = bytes(items)
    assert digest_of(new) != digest_of(old)
    assert rank_by_reference(new.SerializeToString(), digest_of(old)) is None
    for field in ("actions_le", "timestamps_le"):  # any array of the token, not only the item id
        other = rank_message(77, 4)
        changed = bytearray(getattr(other.prefix.long_term, field))
        changed[0] ^= 0x10
        setattr(other.prefix.long_term, field, bytes(changed))
        assert rank_by_reference(other.SerializeToString(), digest_of(old)) is None
    profile = rank_message(77, 4)
    profile.prefix.profile_le = profile.prefix.profile_le[:8] + bytes(8)
    assert rank_by_reference(profile.SerializeToString(), digest_of(old)) is None


def _duplicated_prefix() -> bytes:
    msg = rank_message(77, 4)
    return msg.SerializeToString() + length_delimited(4, prefix_message(77, 4).SerializeToString())


def _other_version() -> bytes:
    msg = rank_message(77, 4)
    msg.prefix.prefix_version = 5
    return msg.SerializeToString()


def _ragged_items() -> bytes:
    msg = rank_message(77, 4)
    msg.prefix.long_term.items_le = b"\x01" * 7
    return msg.SerializeToString()


def _ragged_actions() -> bytes:
    msg = rank_message(77, 4)
    msg.prefix.long_term.actions_le = b"\x02" * 21
    return msg.SerializeToString()


def _fewer_timestamps() -> bytes:
    msg = rank_message(77, 4)
    msg.prefix.long_term.timestamps_le = msg.prefix.long_term.timestamps_le[8:]
    return msg.SerializeToString()


def _two_actions() -> bytes:
    msg = rank_message(77, 4)
    extra = length_delimited(2, b"\x02" * 20)  # Behaviors.actions_le again: the parser keeps the last
    prefix = msg.prefix
    long_term = prefix.long_term.SerializeToString() + extra
    body = prefix.SerializeToString().replace(
        length_delimited(4, prefix.long_term.SerializeToString()), length_delimited(4, long_term)
    )
    msg.ClearField("prefix")
    return msg.SerializeToString() + length_delimited(4, body)


def _no_items() -> bytes:
    msg = rank_message(77, 4)
    msg.prefix.long_term.items_le = b""
    return msg.SerializeToString()


def _two_long_terms() -> bytes:
    msg = rank_message(77, 4)
    extra = length_delimited(4, pb.Behaviors(items_le=b"\x01" * 8).SerializeToString())
    prefix = msg.prefix.SerializeToString() + extra
    msg.ClearField("prefix")
    return msg.SerializeToString() + length_delimited(4, prefix)


def _already_by_reference() -> bytes:
    msg = rank_message(77, 4)
    msg.prefix_ref.length = 7
    return msg.SerializeToString()


def _no_prefix() -> bytes:
    msg = rank_message(77, 4)
    msg.ClearField("prefix")
    return msg.SerializeToString()


@pytest.mark.parametrize(
    "make",
    [
        _duplicated_prefix,
        _other_version,
        _ragged_items,
        _ragged_actions,
        _fewer_timestamps,
        _two_actions,
        _no_items,
        _two_long_terms,
        _already_by_reference,
        _no_prefix,
    ],
)
def test_requests_that_do_not_lend_themselves_to_a_reference_go_as_they_came(make):
    data = make()
    pb.RankRequest.FromString(data)  # all are requests the parser reads
    assert rank_by_reference(data, GOOD_DIGEST) is None


def test_random_corruption_never_makes_a_reference_the_parser_would_read_otherwise():
    """Mutated requests: a reference says what the request says apart from the prefix (replaced
    by its length and fingerprint, which are the parsed prefix's); a request the parser refuses
    makes a reference it refuses too; a reference is never made for another fingerprint."""
    rng = random.Random(99)
    refused = 0

    def parsed(data: bytes) -> pb.RankRequest | None:
        try:
            return pb.RankRequest.FromString(data)
        except DecodeError:
            return None

    seeds = [rank_message(rng.getrandbits(64), rng.getrandbits(64)).SerializeToString() for _ in range(4)]
    made = 0
    for _ in range(3000):
        seed = rng.choice(seeds)
        data = bytearray(seed)
        for _ in range(rng.randint(1, 2)):
            at = rng.randrange(len(data))
            data[at] = rng.choice([rng.randrange(256), 0x80, 0x00, 0x0C, 0x0B])
        data_b = bytes(data)
        original = parsed(data_b)
        # As the residency map would hold it: the fingerprint of the tokens pre-inferred (what
        # the parser reads; for bytes it refuses, the seed's, unless a token was hit).
        try:
            resident = digest_of(original if original is not None else pb.RankRequest.FromString(seed))
        except ValueError:  # ragged token arrays: no psi was ever made of them
            resident = digest_of(pb.RankRequest.FromString(seed))
        try:
            slim = rank_by_reference(data_b, resident)
            assert rank_by_reference(data_b, resident ^ 1) is None
        except MalformedMessage:
            continue
        if slim is None:
            continue
        if original is None:
            # Broken below what the router reads (a nested message, UTF-8): the ranker refuses
            # the reference just as it would have refused the request.
            assert parsed(slim) is None, data_b.hex()
            refused += 1
            continue
        got = pb.RankRequest.FromString(slim)
        assert got.WhichOneof("fallback") == "prefix_ref"
        assert without_fallback(got) == without_fallback(original)
        assert original.prefix.user_id == original.user_id
        assert original.prefix.prefix_version == original.prefix_version
        tokens = len(original.prefix.profile_le) // 8 + len(original.prefix.long_term.items_le) // 8
        assert got.prefix_ref.length == tokens
        assert got.prefix_ref.fingerprint == digest_of(original)
        made += 1
    assert made > 300  # most mutations land in the token arrays and still make a reference
    assert refused > 20
