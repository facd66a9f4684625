"""The expander's control protocol: length-prefixed JSON over a unix stream socket.

Frame: 4-byte big-endian body length, then the body, an orjson-encoded JSON object of at most
MAX_FRAME bytes. Requests are `{"op": OP, "id"?: int, ...fields}`; each gets exactly one reply, in
order: `{"ok": true, "id"?: int, ...}` or `{"ok": false, "id"?: int, "error": KIND, "reason": str}`.
Only offsets, sizes, keys and small metadata travel here; psi bytes go through the shared arena.

Ops and fields (key = {"user_id": int, "prefix_version": int >= 0, "model_version": str,
"fingerprint": uint64 (the prefix's content digest, shared/fingerprint.py)}; psi of other tokens
under the same user and prefix version is another key):

    ping                                         -> {generation}
    hello   [owner]                              -> {arena_bytes, generation, ttl_s, max_lease_s, protocol}
    lookup  key                                  -> {found, entry?}
    reserve key, nbytes > 0, lease_s > 0, [meta: object], [owner]
                                                 -> {lease_id, offset, nbytes, lease_s}
    commit  lease_id                             -> {}
    abort   lease_id                             -> {}
    acquire key, lease_s > 0, [owner]            -> {found, lease_id?, offset?, nbytes?, meta?, lease_s?}
    release lease_id                             -> {}
    stats                                        -> {stats: {...}}

Error kinds: "bad_frame" (not JSON, not an object), "frame_too_large" (the daemon replies, then
closes the connection: the rest of the stream cannot be trusted), "unknown_op", "invalid" (missing
field, wrong type, value out of range), "refused" (reserve: reason too_large / no_space / exists),
"lease" (reason unknown_lease / lease_expired / wrong_lease_kind), "internal" (a daemon bug; logged).
Nothing here ever unpickles or evaluates anything. Both sides import this module: the daemon
(services/expander/server.py) and its clients (shared/expander/client.py).
"""

from __future__ import annotations

import asyncio
import math
import struct
from dataclasses import asdict, dataclass, fields
from typing import Any

import orjson

from shared.expander.entries import Acquired, EntryInfo, EntryKey, EntryState, Reservation, StoreStats

PROTOCOL_VERSION = 2  # 2: keys carry the content fingerprint
MAX_FRAME = 64 * 1024
MAX_META_BYTES = 16 * 1024  # so that every reply carrying meta fits in one frame
MAX_STR = 256
_HEADER = struct.Struct(">I")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_UINT64_MAX = 2**64 - 1


class ProtocolError(Exception):
    """A message breaks the protocol. `kind` is the wire error kind, `reason` says what is wrong."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason


class FrameTooLarge(ProtocolError):
    def __init__(self, length: int) -> None:
        super().__init__("frame_too_large", f"frame of {length} bytes exceeds {MAX_FRAME}")


# ----- framing -----


def encode_frame(message: dict[str, Any]) -> bytes:
    """Header + orjson body. Raises ProtocolError("frame_too_large") rather than produce a frame the
    peer would reject, and TypeError if message is not JSON-serialisable."""
    body = orjson.dumps(message)
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(len(body))
    return _HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's body, or None on a clean end of stream between frames. Raises FrameTooLarge
    (after reading only the header: the caller must close), asyncio.IncompleteReadError on an end of
    stream inside a frame, and whatever the transport raises (ConnectionError...)."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME:
        raise FrameTooLarge(length)
    return await reader.readexactly(length)


def decode_message(body: bytes) -> dict[str, Any]:
    """Parses a frame body into a JSON object. Raises ProtocolError("bad_frame")."""
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError("bad_frame", f"body is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("bad_frame", f"body must be a JSON object, got {type(message).__name__}")
    return message


def ok_reply(request_id: int | None, **fields_: Any) -> dict[str, Any]:
    reply: dict[str, Any] = {"ok": True, **fields_}
    if request_id is not None:
        reply["id"] = request_id
    return reply


def error_reply(request_id: int | None, kind: str, reason: str) -> dict[str, Any]:
    reply: dict[str, Any] = {"ok": False, "error": kind, "reason": reason}
    if request_id is not None:
        reply["id"] = request_id
    return reply


# ----- requests -----


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Hello:
    owner: str


@dataclass(frozen=True)
class Lookup:
    key: EntryKey


@dataclass(frozen=True)
class Reserve:
    key: EntryKey
    nbytes: int
    meta: dict[str, Any]
    owner: str
    lease_s: float


@dataclass(frozen=True)
class Commit:
    lease_id: int


@dataclass(frozen=True)
class Abort:
    lease_id: int


@dataclass(frozen=True)
class Acquire:
    key: EntryKey
    owner: str
    lease_s: float


@dataclass(frozen=True)
class Release:
    lease_id: int


@dataclass(frozen=True)
class Stats:
    pass


Request = Ping | Hello | Lookup | Reserve | Commit | Abort | Acquire | Release | Stats
OPS: dict[str, type[Request]] = {
    "ping": Ping,
    "hello": Hello,
    "lookup": Lookup,
    "reserve": Reserve,
    "commit": Commit,
    "abort": Abort,
    "acquire": Acquire,
    "release": Release,
    "stats": Stats,
}
_ALLOWED = {
    "ping": set(),
    "hello": {"owner"},
    "lookup": {"key"},
    "reserve": {"key", "nbytes", "meta", "owner", "lease_s"},
    "commit": {"lease_id"},
    "abort": {"lease_id"},
    "acquire": {"key", "owner", "lease_s"},
    "release": {"lease_id"},
    "stats": set(),
}


def request_id(message: dict[str, Any]) -> int | None:
    """The request's "id" if it is a valid one (echoed in the reply), else None."""
    rid: Any = message.get("id")
    return rid if _is_int(rid) and _INT64_MIN <= rid <= _INT64_MAX else None


def parse_request(message: dict[str, Any], default_owner: str = "") -> Request:
    """Validates a decoded request. Raises ProtocolError("unknown_op" | "invalid")."""
    op = message.get("op")
    if not isinstance(op, str):
        raise ProtocolError("invalid", "field 'op' must be a string")
    if op not in OPS:
        raise ProtocolError("unknown_op", f"unknown op {op[:MAX_STR]!r}")
    if "id" in message and request_id(message) is None:
        raise ProtocolError("invalid", "field 'id' must be a 64-bit integer")
    extra = set(message) - _ALLOWED[op] - {"op", "id"}
    if extra:
        raise ProtocolError("invalid", f"unexpected fields for {op}: {sorted(extra)[:8]}")
    owner = _str(message, "owner", default=default_owner, allow_empty=True)
    if op == "ping":
        return Ping()
    if op == "hello":
        return Hello(owner)
    if op == "stats":
        return Stats()
    if op == "lookup":
        return Lookup(key_from_wire(message.get("key")))
    if op == "reserve":
        meta = message.get("meta", {})
        if not isinstance(meta, dict):
            raise ProtocolError("invalid", "field 'meta' must be an object")
        if len(orjson.dumps(meta)) > MAX_META_BYTES:
            raise ProtocolError("invalid", f"field 'meta' exceeds {MAX_META_BYTES} bytes encoded")
        return Reserve(
            key_from_wire(message.get("key")),
            _int(message, "nbytes", minimum=1),
            meta,
            owner,
            _positive(message, "lease_s"),
        )
    if op == "acquire":
        return Acquire(key_from_wire(message.get("key")), owner, _positive(message, "lease_s"))
    lease_id = _int(message, "lease_id", minimum=1)
    if op == "commit":
        return Commit(lease_id)
    if op == "abort":
        return Abort(lease_id)
    return Release(lease_id)


def request_to_wire(request: Request, request_id_: int | None = None) -> dict[str, Any]:
    """The wire form of a request (the client's side of parse_request)."""
    op = next(name for name, cls in OPS.items() if isinstance(request, cls))
    message: dict[str, Any] = {"op": op}
    for f in fields(request):
        value = getattr(request, f.name)
        message[f.name] = key_to_wire(value) if isinstance(value, EntryKey) else value
    if request_id_ is not None:
        message["id"] = request_id_
    return message


# ----- typed values on the wire -----


@dataclass(frozen=True)
class HelloInfo:
    arena_bytes: int
    generation: str
    ttl_s: float
    max_lease_s: float
    protocol: int


def hello_from_wire(value: dict[str, Any]) -> HelloInfo:
    """Raises ProtocolError("invalid")."""
    return HelloInfo(
        _int(value, "arena_bytes", minimum=1),
        _str(value, "generation"),
        _positive(value, "ttl_s"),
        _positive(value, "max_lease_s"),
        _int(value, "protocol", minimum=1),
    )


_KEY_FIELDS = frozenset({"user_id", "prefix_version", "model_version", "fingerprint"})


def key_to_wire(key: EntryKey) -> dict[str, Any]:
    return {
        "user_id": key.user_id,
        "prefix_version": key.prefix_version,
        "model_version": key.model_version,
        "fingerprint": key.fingerprint,
    }


def key_from_wire(value: Any) -> EntryKey:
    """Raises ProtocolError("invalid")."""
    if not isinstance(value, dict):
        raise ProtocolError("invalid", "field 'key' must be an object")
    extra = set(value) - _KEY_FIELDS
    if extra:
        raise ProtocolError("invalid", f"unexpected key fields: {sorted(extra)[:8]}")
    fingerprint: Any = value.get("fingerprint")
    if not _is_int(fingerprint) or not 0 <= fingerprint <= _UINT64_MAX:
        raise ProtocolError("invalid", "field 'key.fingerprint' must be a 64-bit unsigned integer")
    return EntryKey(
        _int(value, "user_id", where="key."),
        _int(value, "prefix_version", minimum=0, where="key."),
        _str(value, "model_version", where="key."),
        int(fingerprint),
    )


def entry_to_wire(info: EntryInfo) -> dict[str, Any]:
    return {
        "key": key_to_wire(info.key),
        "state": info.state.value,
        "offset": info.offset,
        "nbytes": info.nbytes,
        "meta": info.meta,
        "pins": info.pins,
    }


def entry_from_wire(value: Any) -> EntryInfo:
    """Raises ProtocolError("invalid")."""
    if not isinstance(value, dict):
        raise ProtocolError("invalid", "field 'entry' must be an object")
    try:
        state = EntryState(value.get("state"))
    except ValueError:
        raise ProtocolError("invalid", f"bad entry state {value.get('state')!r}") from None
    return EntryInfo(
        key_from_wire(value.get("key")),
        state,
        _int(value, "offset", minimum=0),
        _int(value, "nbytes", minimum=1),
        _obj(value, "meta"),
        _int(value, "pins", minimum=0),
    )


def reservation_to_wire(r: Reservation) -> dict[str, Any]:
    return {"lease_id": r.lease_id, "offset": r.offset, "nbytes": r.nbytes, "lease_s": r.lease_s}


def reservation_from_wire(value: dict[str, Any]) -> Reservation:
    """Raises ProtocolError("invalid")."""
    return Reservation(
        _int(value, "lease_id", minimum=1),
        _int(value, "offset", minimum=0),
        _int(value, "nbytes", minimum=1),
        _positive(value, "lease_s"),
    )


def acquired_to_wire(a: Acquired) -> dict[str, Any]:
    return {
        "lease_id": a.lease_id,
        "offset": a.offset,
        "nbytes": a.nbytes,
        "meta": a.meta,
        "lease_s": a.lease_s,
    }


def acquired_from_wire(value: dict[str, Any]) -> Acquired:
    """Raises ProtocolError("invalid")."""
    return Acquired(
        _int(value, "lease_id", minimum=1),
        _int(value, "offset", minimum=0),
        _int(value, "nbytes", minimum=1),
        _obj(value, "meta"),
        _positive(value, "lease_s"),
    )


def stats_to_wire(s: StoreStats) -> dict[str, Any]:
    return asdict(s)


def stats_from_wire(value: Any) -> StoreStats:
    """Raises ProtocolError("invalid"). Unknown extra fields are ignored (a newer daemon)."""
    if not isinstance(value, dict):
        raise ProtocolError("invalid", "field 'stats' must be an object")
    return StoreStats(**{f.name: _int(value, f.name, minimum=0) for f in fields(StoreStats)})


# ----- field validators -----


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a number


def _int(message: dict[str, Any], name: str, *, minimum: int | None = None, where: str = "") -> int:
    value: Any = message.get(name)
    if not _is_int(value) or not _INT64_MIN <= value <= _INT64_MAX:
        raise ProtocolError("invalid", f"field '{where}{name}' must be a 64-bit integer")
    if minimum is not None and value < minimum:
        raise ProtocolError("invalid", f"field '{where}{name}' must be >= {minimum}, got {value}")
    return int(value)


def _positive(message: dict[str, Any], name: str) -> float:
    value: Any = message.get(name)
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value) or value <= 0:
        raise ProtocolError("invalid", f"field '{name}' must be a finite number > 0")
    return float(value)


def _str(
    message: dict[str, Any],
    name: str,
    *,
    default: str | None = None,
    allow_empty: bool = False,
    where: str = "",
) -> str:
    value = message.get(name, default)
    if not isinstance(value, str) or len(value) > MAX_STR or (not value and not allow_empty):
        what = "a string" if allow_empty else "a non-empty string"
        raise ProtocolError("invalid", f"field '{where}{name}' must be {what} of <= {MAX_STR} chars")
    return value


def _obj(message: dict[str, Any], name: str) -> dict[str, Any]:
    value = message.get(name)
    if not isinstance(value, dict):
        raise ProtocolError("invalid", f"field '{name}' must be an object")
    return value
