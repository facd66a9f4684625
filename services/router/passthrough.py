"""Placement keys read straight from serialized requests, so the router forwards Rank and PreInfer
as the bytes it received (no parse, no re-serialise) and still knows where each call goes.

A small top-level protobuf wire-format scanner: it walks the fields of one message, skipping
every payload it does not need (varints, fixed 32/64-bit values, length-delimited fields, groups)
in O(number of fields), whatever the size of the prefix the request carries. It follows the
protobuf parser's (upb) rules wherever they decide what a field's value is:

* the last occurrence of a scalar field wins; several occurrences of a message field merge (so
  the last occurrence of each of its scalar fields wins);
* a field whose wire type is not its declared one is an unknown field: skipped, not an error;
* uint64 varints are taken modulo 2**64 (up to 10 bytes), int64 as two's complement.

Structural errors raise `MalformedMessage` (the router answers INVALID_ARGUMENT): a truncated
varint or field, a varint longer than 10 bytes, a tag or a length longer than 5 bytes or beyond
32 bits, field number 0 (outside groups), wire type 6 or 7, a length that runs past the end, an
unmatched or missing end-group, groups nested deeper than the parser's limit (100). Everything below the fields read here (nested messages, UTF-8 of
strings, the token values) is left to the ranker, which parses and validates the whole request;
the prefix's token arrays are only hashed, as bytes, to name its psi by content
(`rank_by_reference`).
"""

from __future__ import annotations

from shared.fingerprint import prefix_fingerprint

__all__ = ["MalformedMessage", "preinfer_key", "rank_by_reference", "rank_key"]

_MASK64 = (1 << 64) - 1
_SIGN64 = 1 << 63
# upb's default nesting limit (messages and groups): 100 nested groups parse, 101 do not.
_MAX_DEPTH = 100

_VARINT, _FIXED64, _LEN, _START_GROUP, _END_GROUP, _FIXED32 = range(6)


class MalformedMessage(ValueError):
    """The bytes are not a well-formed protobuf message (at the wire-format level)."""


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value modulo 2**64, position after it) of the varint at `pos`."""
    result = 0
    shift = 0
    start = pos
    while pos < end:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _MASK64, pos
        shift += 7
        if shift == 70:
            raise MalformedMessage(f"varint at byte {start} is longer than 10 bytes")
    raise MalformedMessage(f"truncated varint at byte {start}")


def _short_varint(data: bytes, pos: int, end: int, what: str) -> tuple[int, int]:
    """A tag or a length: at most 5 bytes and below 2**32, as the parser requires."""
    result = 0
    start = pos
    for shift in (0, 7, 14, 21, 28):
        if pos >= end:
            raise MalformedMessage(f"truncated {what} at byte {start}")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            if result >> 32:
                raise MalformedMessage(f"{what} at byte {start} does not fit in 32 bits")
            return result, pos
    raise MalformedMessage(f"{what} at byte {start} is longer than 5 bytes")


def _scan(
    data: bytes,
    pos: int,
    end: int,
    depth: int,
    wanted: dict[int, int],
    values: list[int],
    spans: dict[int, list[tuple[int, int, int]]] | None = None,
) -> None:
    """Walks the fields of the message in data[pos:end]. A varint field whose tag (field number
    << 3 | wire type) is a key of `wanted` is stored in values[wanted[tag]], so the last
    occurrence wins and a field sent with another wire type (another tag) is skipped, as the
    parser does. A length-delimited field whose tag is a key of `spans` is appended there as
    (field start, payload start, payload end), in order. `depth` is how many more levels of
    groups may nest.

    One loop, no generator: this runs on every routed call."""
    while pos < end:
        start = pos
        tag = data[pos]
        if tag < 0x80:  # fields 1-15: one-byte tags, the common case
            pos += 1
        else:
            tag, pos = _short_varint(data, pos, end, "tag")
        wire = tag & 7
        if wire == _VARINT and tag >= 8:
            value, pos = _varint(data, pos, end)
            slot = wanted.get(tag)
            if slot is not None:
                values[slot] = value
        elif wire == _LEN and tag >= 8:
            size, pos = _short_varint(data, pos, end, "length")
            if size > end - pos:
                raise MalformedMessage(
                    f"field {tag >> 3}: length {size} runs past the end ({end - pos} bytes left)"
                )
            if spans is not None:
                found = spans.get(tag)
                if found is not None:
                    found.append((start, pos, pos + size))
            pos += size
        else:  # fixed-width values, groups, and every error
            if tag < 8:
                raise MalformedMessage(f"field number 0 at byte {start}")
            pos = _field_end(data, start, end, depth)


def _field_end(data: bytes, pos: int, end: int, depth: int) -> int:
    """The position after the single field (tag and payload) that starts at `pos`. Field number 0
    is the caller's to reject: the parser refuses it in a message, not inside a skipped group."""
    start = pos
    tag, pos = _short_varint(data, pos, end, "tag")
    field, wire = tag >> 3, tag & 7
    if wire == _VARINT:
        return _varint(data, pos, end)[1]
    if wire == _LEN:
        size, pos = _short_varint(data, pos, end, "length")
        if size > end - pos:
            raise MalformedMessage(f"field {field}: length {size} runs past the end ({end - pos} bytes left)")
        return pos + size
    if wire in (_FIXED64, _FIXED32):
        width = 8 if wire == _FIXED64 else 4
        if width > end - pos:
            raise MalformedMessage(f"field {field}: truncated fixed{width * 8} value at byte {start}")
        return pos + width
    if wire == _START_GROUP:
        return _skip_group(data, pos, end, field, depth - 1)
    if wire == _END_GROUP:
        raise MalformedMessage(f"end of group {field} at byte {start} without its start")
    raise MalformedMessage(f"field {field}: invalid wire type {wire} at byte {start}")


def _skip_group(data: bytes, pos: int, end: int, field: int, depth: int) -> int:
    """The position after the end-group tag that closes group `field` (opened just before `pos`)."""
    if depth < 0:
        raise MalformedMessage(f"groups nested deeper than {_MAX_DEPTH}")
    while pos < end:
        tag, after = _short_varint(data, pos, end, "tag")
        if tag & 7 == _END_GROUP:
            if tag >> 3 != field:
                raise MalformedMessage(f"group {field} closed by the end of group {tag >> 3}")
            return after
        pos = _field_end(data, pos, end, depth)
    raise MalformedMessage(f"group {field} is not closed")


# Tags (field number << 3 | wire type) of the fields read, from shared/protos/ranker.proto.
_RANK_KEY = {2 << 3 | _VARINT: 0, 3 << 3 | _VARINT: 1}  # RankRequest.user_id, .prefix_version
_PREINFER_PREFIX = 2 << 3 | _LEN  # PreInferRequest.prefix (UserPrefix)
# PreInferRequest.lease_deadline_unix_ms, .user_id, .prefix_version (the last two: by reference)
_PREINFER_TOP = {3 << 3 | _VARINT: 0, 5 << 3 | _VARINT: 1, 6 << 3 | _VARINT: 2}
_PREFIX_KEY = {1 << 3 | _VARINT: 0, 2 << 3 | _VARINT: 1}  # UserPrefix.user_id, .prefix_version


def rank_key(data: bytes) -> tuple[int, int]:
    """(user_id, prefix_version) of a serialized relaygr.v1.RankRequest (fields 2 and 3, uint64).
    Raises MalformedMessage for bytes that are not a protobuf message."""
    key = [0, 0]
    _scan(data, 0, len(data), _MAX_DEPTH, _RANK_KEY, key)
    return key[0], key[1]


def preinfer_key(data: bytes) -> tuple[int, int, int]:
    """(user id, prefix version, lease_deadline_unix_ms) of a serialized
    relaygr.v1.PreInferRequest: those of its prefix when it carries one (UserPrefix is field 2,
    its user_id and prefix_version fields 1 and 2, uint64), else its own fields 5 and 6 (a
    prefetch by reference); the lease is field 3 (int64). Raises MalformedMessage."""
    top = [0, 0, 0]
    prefixes: dict[int, list[tuple[int, int, int]]] = {_PREINFER_PREFIX: []}
    _scan(data, 0, len(data), _MAX_DEPTH, _PREINFER_TOP, top, prefixes)
    spans = prefixes[_PREINFER_PREFIX]
    key = [0, 0] if spans else [top[1], top[2]]
    for _, a, b in spans:  # occurrences of a message field merge: each scalar's last one wins
        _scan(data, a, b, _MAX_DEPTH - 1, _PREFIX_KEY, key)
    signed = top[0] - (1 << 64) if top[0] & _SIGN64 else top[0]
    return key[0], key[1], signed


_RANK_PREFIX = 4 << 3 | _LEN  # RankRequest.prefix (UserPrefix), in oneof `fallback`
_RANK_PREFIX_REF = 8 << 3 | _LEN  # RankRequest.prefix_ref (PrefixRef), the same oneof
_PROFILE = 3 << 3 | _LEN  # UserPrefix.profile_le
_LONG_TERM = 4 << 3 | _LEN  # UserPrefix.long_term (Behaviors)
_ITEMS = 1 << 3 | _LEN  # Behaviors.items_le
_ACTIONS = 2 << 3 | _LEN  # Behaviors.actions_le
_TIMESTAMPS = 3 << 3 | _LEN  # Behaviors.timestamps_le
_REF_LENGTH = 1 << 3 | _VARINT  # PrefixRef.length
_REF_FINGERPRINT = 2 << 3 | _FIXED64  # PrefixRef.fingerprint


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _single(spans: list[tuple[int, int, int]], width: int) -> tuple[int, int] | None:
    """The payload of a bytes field sent at most once, holding whole `width`-byte values (absent:
    empty), else None."""
    if len(spans) > 1:
        return None
    if not spans:
        return 0, 0
    _, a, b = spans[0]
    return None if (b - a) % width else (a, b)


def rank_by_reference(data: bytes, resident_fingerprint: int) -> bytes | None:
    """The serialized RankRequest with its prefix replaced by a PrefixRef (its length and content
    fingerprint): what the router forwards to the instance its residency map says holds psi of
    `resident_fingerprint`. None when the request does not lend itself to that, and is forwarded
    as it came: its prefix's tokens are not the resident psi's (another fingerprint: the ranker
    must see them, rank them in full and count the mismatch); no prefix or already a reference;
    the prefix, its profile, its long-term behaviours or their arrays sent more than once (the
    parser would merge them); token arrays that are not whole values or disagree in length; a
    prefix of another user or version than the request's (the ranker refuses that, and must see
    it).

    The fingerprint is computed from the token bytes as they are (shared/fingerprint.py hashes
    the wire layout), the same digest the ranker computed when the PreInfer carried them. Token
    values are not validated here: those of psi were, when its PreInfer carried them, and other
    tokens never leave as a reference. Raises MalformedMessage."""
    request_key = [0, 0]
    top: dict[int, list[tuple[int, int, int]]] = {_RANK_PREFIX: [], _RANK_PREFIX_REF: []}
    _scan(data, 0, len(data), _MAX_DEPTH, _RANK_KEY, request_key, top)
    if len(top[_RANK_PREFIX]) != 1 or top[_RANK_PREFIX_REF]:
        return None
    field_start, a, b = top[_RANK_PREFIX][0]
    prefix_key = [0, 0]
    inner: dict[int, list[tuple[int, int, int]]] = {_PROFILE: [], _LONG_TERM: []}
    _scan(data, a, b, _MAX_DEPTH - 1, _PREFIX_KEY, prefix_key, inner)
    profile, long_term = inner[_PROFILE], inner[_LONG_TERM]
    if request_key != prefix_key or len(profile) > 1 or len(long_term) != 1:
        return None
    arrays: dict[int, list[tuple[int, int, int]]] = {_ITEMS: [], _ACTIONS: [], _TIMESTAMPS: []}
    _scan(data, long_term[0][1], long_term[0][2], _MAX_DEPTH - 2, {}, [], arrays)
    prof = _single(profile, 8)
    items, actions, stamps = (
        _single(arrays[t], w) for t, w in ((_ITEMS, 8), (_ACTIONS, 4), (_TIMESTAMPS, 8))
    )
    if prof is None or items is None or actions is None or stamps is None:
        return None
    n = (items[1] - items[0]) // 8
    if not n or (actions[1] - actions[0]) // 4 != n or (stamps[1] - stamps[0]) // 8 != n:
        return None
    view = memoryview(data)
    fingerprint = prefix_fingerprint(*(view[a:b] for a, b in (prof, items, actions, stamps)))
    if fingerprint.digest != resident_fingerprint:
        return None
    ref = b"".join(
        (
            bytes((_REF_LENGTH,)),
            _varint_bytes(fingerprint.length),
            bytes((_REF_FINGERPRINT,)),
            fingerprint.digest.to_bytes(8, "little"),
        )
    )
    return b"".join((data[:field_start], data[b:], bytes((_RANK_PREFIX_REF,)), _varint_bytes(len(ref)), ref))
