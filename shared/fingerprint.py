"""Content fingerprints of a user's prefix [U, S_l]: chained 64-bit hashes over fixed-size chunks.

A psi is named by (user, prefix version) AND by what its tokens are: a client that sends other
tokens under a known (user, prefix version) must get a miss (a full ranking), never the scores of
the old prefix. The fingerprint is that content half of the name.

Chained over chunks, as vLLM's prefix caching hashes its KV blocks: chunk i covers token positions
[i*CHUNK_TOKENS, (i+1)*CHUNK_TOKENS) of the prefix (profile tokens first, then the long-term
behaviours), and its digest is

    d_i = H(d_{i-1} || tokens of chunk i)          d_{-1} = H(format tag || profile length)

with H = xxh3-64 (seeded by the previous digest). So a digest commits to every token before and in
its chunk: two prefixes share the digests of exactly the chunks they have in common from the start,
and one changed token changes its chunk's digest and every later one. With causal attention, psi
of a token list is also psi of each of its prefixes: `common_tokens` tells how much of a resident
psi is the start of another (longer, newer) history. The last digest names the whole prefix.

Tokens are hashed in their wire layout (shared/protos/ranker.proto): profile ids int64, items
int64, actions int32, timestamps int64, all little-endian. The ranker (from the decoded request)
and the router (from the bytes it forwards) therefore compute the same fingerprint without
converting anything. xxh3 is not cryptographic: a client that wants a collision under its own
(user, prefix version) can make one; it breaks only its own scores, as reusing a version did.

numpy and xxhash only (the router, trigger and expander must not import torch).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import xxhash

__all__ = [
    "CHUNK_TOKENS",
    "PrefixFingerprint",
    "common_chunks",
    "common_tokens",
    "prefix_fingerprint",
]

CHUNK_TOKENS: Final = 256
# Changing the layout or the hash changes every digest: bump the tag with it.
_FORMAT: Final = b"relaygr.prefix-fingerprint.v1"
_I64: Final = np.dtype("<i8")
_I32: Final = np.dtype("<i4")


@dataclass(frozen=True)
class PrefixFingerprint:
    """The chain of one prefix: `length` tokens ([U, S_l]), `profile_len` of them profile tokens,
    `chunks[i]` the digest of tokens [0, (i+1)*CHUNK_TOKENS) (the last chunk may be shorter).
    `digest` (the last chunk's) names the whole content; an empty prefix has the seed's."""

    length: int
    profile_len: int
    chunks: tuple[int, ...]
    seed: int

    @property
    def digest(self) -> int:
        return self.chunks[-1] if self.chunks else self.seed

    def __str__(self) -> str:
        return f"{self.digest:016x}/{self.length}"


def _seed(profile_len: int) -> int:
    return xxhash.xxh3_64_intdigest(_FORMAT + struct.pack("<Q", profile_len))


def _as_values(values: object, dtype: np.dtype, name: str) -> memoryview:
    """A memoryview of one `dtype` value per element (little-endian, contiguous) over `values`:
    zero-copy for bytes-like input and arrays already in that layout. Slicing it is in values."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"{name}: must be one-dimensional, got shape {values.shape}")
        array: npt.NDArray[np.generic] = np.ascontiguousarray(values, dtype=dtype)
    else:
        raw = memoryview(values).cast("B")  # type: ignore[arg-type]
        if raw.nbytes % dtype.itemsize:
            raise ValueError(
                f"{name}: {raw.nbytes} bytes is not a whole number of {dtype.itemsize}-byte values"
            )
        array = np.frombuffer(raw, dtype=dtype)
    return memoryview(array)  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs say not


def prefix_fingerprint(
    profile: object, items: object, actions: object, timestamps: object
) -> PrefixFingerprint:
    """The fingerprint of a prefix given as its wire arrays: bytes-like objects (or numpy arrays)
    of profile ids (int64), items (int64), actions (int32) and timestamps (int64), little-endian.
    Numpy arrays of other integer dtypes are converted (values must fit the wire dtype, as they
    must to be sent). Raises ValueError for ragged or mismatched arrays. Token values are not
    validated: that is the decoder's job, and a fingerprint only has to tell contents apart."""
    prof = _as_values(profile, _I64, "profile")
    it = _as_values(items, _I64, "items")
    ac = _as_values(actions, _I32, "actions")
    ts = _as_values(timestamps, _I64, "timestamps")
    if not len(it) == len(ac) == len(ts):
        raise ValueError(f"{len(it)} items, {len(ac)} actions and {len(ts)} timestamps must match")
    return _chain(prof, it, ac, ts)


def _chain(
    prof: memoryview, items: memoryview, actions: memoryview, timestamps: memoryview
) -> PrefixFingerprint:
    n_prof = len(prof)
    length = n_prof + len(items)
    seed = digest = _seed(n_prof)
    chunks: list[int] = []
    for start in range(0, length, CHUNK_TOKENS):
        end = min(start + CHUNK_TOKENS, length)
        h = xxhash.xxh3_64(seed=digest)
        if start < n_prof:
            h.update(prof[start : min(end, n_prof)])
        # Behaviour positions of this chunk (negative bounds clamp to the first behaviour).
        a, b = max(start - n_prof, 0), end - n_prof
        if b > a:
            # Each array's slice separately: xxh3 is a byte stream, and the slice lengths are
            # fixed by (start, end, n_prof), all committed earlier in the chain.
            h.update(items[a:b])
            h.update(actions[a:b])
            h.update(timestamps[a:b])
        digest = h.intdigest()
        chunks.append(digest)
    return PrefixFingerprint(length, n_prof, tuple(chunks), seed)


def common_chunks(a: PrefixFingerprint, b: PrefixFingerprint) -> int:
    """How many leading chunks the two prefixes share (equal digests: equal tokens up to there)."""
    if a.seed != b.seed:
        return 0  # another profile length: every position differs
    n = 0
    for x, y in zip(a.chunks, b.chunks, strict=False):
        if x != y:
            break
        n += 1
    return n


def common_tokens(a: PrefixFingerprint, b: PrefixFingerprint) -> int:
    """How many leading tokens the two prefixes are known to share, in whole chunks (a shared
    last, partial chunk means both prefixes end there: the same length). A psi of `a` serves the
    first common_tokens(a, b) positions of `b`."""
    n = common_chunks(a, b)
    return min(n * CHUNK_TOKENS, a.length, b.length)
