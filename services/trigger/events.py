"""Retrieval events in: decoding and full validation, each failure with a precise reason.

Every event is validated whole, whatever the admission decision then says, with the checks the
ranker applies to a prefix (shared/wire.py: ragged arrays, token limits, negative ids, timestamps
outside [0, MAX_TIMESTAMP)) plus the event's own: schema version, ids, prefix_len, deadline, and
the record key, which must be the user id in decimal ASCII (the key is what keeps one user's
events in order on one partition). The token arrays are checked as zero-copy numpy views; the
trigger never builds tensors.

An `EventError`'s message is the dead-letter reason. A value that protobuf refuses gets the byte
offset and field where its wire format breaks (`locate_wire_fault`): upb's DecodeError says only
"Wire format was corrupt".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from shared.protos import events_pb2 as ev
from shared.protos import ranker_pb2 as pb
from shared.wire import I32, I64, MAX_TIMESTAMP, RequestLimits, WireError, require_non_negative

SCHEMA_VERSION = 1
MAX_TIMESTAMP_MS = MAX_TIMESTAMP * 1000
# A PreInferSignal's fields besides the prefix, the request id and the instance name: tags,
# lengths and varints (schema_version, signal time, lease deadline, prefetch flag) take at most
# this many bytes.
SIGNAL_FIELDS_OVERHEAD_BYTES = 64


class EventError(ValueError):
    """A retrieval record that cannot be acted on; the message is the dead-letter reason."""


@dataclass(frozen=True)
class EventMeta:
    """What the trigger reads of a retrieval event (it never builds the token tensors)."""

    request_id: str
    user_id: int
    prefix_version: int
    prefix_len: int
    ranking_deadline_unix_ms: int


def parse_event(raw: bytes | None, limits: RequestLimits) -> tuple[EventMeta, ev.RetrievalEvent]:
    """Decodes and fully validates a retrieval event's value. Raises EventError with the reason."""
    if raw is None:
        raise EventError("tombstone: the record has no value (null)")
    if not raw:
        raise EventError("empty value: 0 bytes is not a RetrievalEvent")
    event = ev.RetrievalEvent()
    try:
        event.ParseFromString(raw)
    except DecodeError:
        raise EventError(
            f"not a RetrievalEvent: {locate_wire_fault(raw, ev.RetrievalEvent.DESCRIPTOR)}"
        ) from None
    except Exception as exc:  # anything else protobuf may raise on garbage
        raise EventError(f"not a RetrievalEvent: {type(exc).__name__}: {exc}") from None
    if event.schema_version != SCHEMA_VERSION:
        raise EventError(f"unsupported schema_version {event.schema_version} (expected {SCHEMA_VERSION})")
    if not event.request_id:
        raise EventError("request_id is required")
    if not event.HasField("prefix"):
        raise EventError("prefix is required")
    p = event.prefix
    if p.user_id != event.user_id or p.prefix_version != event.prefix_version:
        raise EventError(
            f"prefix.user_id / prefix_version ({p.user_id} / {p.prefix_version}) must equal the event's "
            f"({event.user_id} / {event.prefix_version})"
        )
    try:
        tokens = _check_prefix(p, limits)
    except WireError as exc:
        raise EventError(str(exc)) from None
    if event.prefix_len != tokens:
        raise EventError(f"prefix_len {event.prefix_len} does not match the prefix ({tokens} tokens)")
    if not 0 <= event.event_time_unix_ms < MAX_TIMESTAMP_MS:
        raise EventError(f"event_time_unix_ms {event.event_time_unix_ms} is out of range")
    if event.ranking_deadline_unix_ms <= 0:
        raise EventError("ranking_deadline_unix_ms is required")
    if event.ranking_deadline_unix_ms >= MAX_TIMESTAMP_MS:
        raise EventError(f"ranking_deadline_unix_ms {event.ranking_deadline_unix_ms} is out of range")
    meta = EventMeta(event.request_id, event.user_id, event.prefix_version, event.prefix_len,
                     event.ranking_deadline_unix_ms)  # fmt: skip
    return meta, event


def check_key(key: bytes | None, user_id: int) -> None:
    """The record key must be the event's user id in decimal ASCII. Raises EventError."""
    if key is None:
        raise EventError(f"null key: retrieval events are keyed by user id (expected b'{user_id}')")
    if key != str(user_id).encode():
        shown = key[:40].decode("ascii", "backslashreplace") + ("..." if len(key) > 40 else "")
        if not key.isdigit():
            raise EventError(f"key '{shown}' is not a decimal user id (the event's user_id is {user_id})")
        raise EventError(f"key '{shown}' is not the event's user_id {user_id}")


def parse_record(
    key: bytes | None, value: bytes | None, limits: RequestLimits
) -> tuple[EventMeta, ev.RetrievalEvent]:
    """A retrieval record, value and key, fully validated. Raises EventError with the reason."""
    meta, event = parse_event(value, limits)
    check_key(key, meta.user_id)
    return meta, event


# Unsigned views find every bad value with one max(): a negative id is >= 2**63 as uint64 (2**31
# as uint32), and a timestamp outside [0, MAX_TIMESTAMP) is >= MAX_TIMESTAMP either way.
_U64, _U32 = np.dtype("<u8"), np.dtype("<u4")


def _check_prefix(p: pb.UserPrefix, limits: RequestLimits) -> int:
    """The ranker's checks of a prefix (services/ranker/wire.py), on views. Returns its tokens."""
    lt = p.long_term
    # (name, bytes, signed dtype, unsigned view, first bad unsigned value); each field read once:
    # upb copies a bytes field on every access.
    arrays = (("prefix.profile", p.profile_le, I64, _U64, 1 << 63),
              ("prefix.long_term.items", lt.items_le, I64, _U64, 1 << 63),
              ("prefix.long_term.actions", lt.actions_le, I32, _U32, 1 << 31),
              ("prefix.long_term.timestamps", lt.timestamps_le, I64, _U64, MAX_TIMESTAMP))  # fmt: skip
    for name, raw, dtype, _, _ in arrays:
        if len(raw) % dtype.itemsize:
            raise WireError(f"{name}: {len(raw)} bytes is not a whole number of {dtype.itemsize}-byte values")
    profile, n = len(arrays[0][1]) // 8, len(arrays[1][1]) // 8
    if profile > limits.max_profile_tokens:
        raise WireError(f"prefix.profile: {profile} values exceeds the limit of {limits.max_profile_tokens}")
    if n > limits.max_prefix_tokens:
        raise WireError(f"prefix.long_term.items: {n} values exceeds the limit of {limits.max_prefix_tokens}")
    actions, timestamps = len(arrays[2][1]) // 4, len(arrays[3][1]) // 8
    if not n == actions == timestamps:
        raise WireError(
            f"prefix.long_term: {n} items, {actions} actions and {timestamps} timestamps must match"
        )
    for name, raw, dtype, unsigned, bad in arrays:
        if raw and int(np.frombuffer(raw, dtype=unsigned).max()) >= bad:
            # Now the precise message, with the same words as the ranker's.
            view: npt.NDArray[np.signedinteger[Any]] = np.frombuffer(raw, dtype=dtype)
            require_non_negative(view, name, MAX_TIMESTAMP if name.endswith("timestamps") else None)
    return profile + n


def signal_size_bound(event: ev.RetrievalEvent, instance_name_bytes: int) -> int:
    """An upper bound on the serialized PreInferSignal made from `event` (its prefix as received,
    unknown fields included), given the longest instance name it may carry."""
    return (
        event.prefix.ByteSize()
        + len(event.request_id.encode())
        + instance_name_bytes
        + SIGNAL_FIELDS_OVERHEAD_BYTES
    )


# ---------------------------------------------------------------------- where the wire format breaks


class _Fault(Exception):
    pass


_VARINT, _FIXED64, _LEN, _START_GROUP, _END_GROUP, _FIXED32 = range(6)
_MAX_DEPTH = 100


def locate_wire_fault(raw: bytes, descriptor: Descriptor) -> str:
    """Where `raw` stops being a well-formed message of type `descriptor`, as
    "at byte N (field path): what". Walks the wire format, into the fields it knows."""
    try:
        _walk(raw, 0, len(raw), descriptor, "", 0, None)
    except _Fault as fault:
        return str(fault)
    return "the wire format is well formed, yet protobuf refused it"


def _varint(data: bytes, pos: int, end: int, where: str) -> tuple[int, int]:
    result, shift, start = 0, 0, pos
    while pos < end:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise _Fault(f"at byte {start} ({where}): varint longer than 10 bytes")
    raise _Fault(f"at byte {start} ({where}): truncated varint")


def _walk(data: bytes, pos: int, end: int, desc: Descriptor | None, path: str, depth: int,
          group: int | None) -> int:  # fmt: skip
    """Walks fields from pos to end (or to the end of `group`); returns the position after."""
    if depth > _MAX_DEPTH:
        raise _Fault(f"at byte {pos} ({path or 'message'}): nested deeper than {_MAX_DEPTH}")
    while pos < end:
        start = pos
        tag, pos = _varint(data, pos, end, f"{path or 'message'} tag")
        number, wire_type = tag >> 3, tag & 7
        field = desc.fields_by_number.get(number) if desc is not None else None
        name = f"{path}{field.name if field is not None else f'field {number}'}"
        if number == 0:
            raise _Fault(f"at byte {start} ({path or 'message'}): field number 0")
        if wire_type == _VARINT:
            _, pos = _varint(data, pos, end, name)
        elif wire_type in (_FIXED64, _FIXED32):
            width = 8 if wire_type == _FIXED64 else 4
            if pos + width > end:
                raise _Fault(
                    f"at byte {start} ({name}): {width}-byte value truncated ({end - pos} bytes left)"
                )
            pos += width
        elif wire_type == _LEN:
            length, pos = _varint(data, pos, end, f"{name} length")
            if pos + length > end:
                raise _Fault(
                    f"at byte {start} ({name}): length {length} runs past the end ({end - pos} bytes left)"
                )
            if field is not None and field.type == FieldDescriptor.TYPE_MESSAGE:
                _walk(data, pos, pos + length, field.message_type, f"{name}.", depth + 1, None)
            elif field is not None and field.type == FieldDescriptor.TYPE_STRING:
                try:
                    data[pos : pos + length].decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise _Fault(f"at byte {pos + exc.start} ({name}): invalid UTF-8") from None
            pos += length
        elif wire_type == _START_GROUP:
            pos = _walk(data, pos, end, None, f"{name}.", depth + 1, number)
        elif wire_type == _END_GROUP:
            if group != number:
                raise _Fault(f"at byte {start} ({name}): end of a group that was not started")
            return pos
        else:
            raise _Fault(f"at byte {start} ({name}): invalid wire type {wire_type}")
    if group is not None:
        raise _Fault(f"at byte {end} ({path.rstrip('.')}): group not ended")
    return pos
