"""Prefix fingerprints (shared/fingerprint.py): chained chunk digests. A prefix of a token list
shares the chain; any one-token change changes its chunk's digest and every later one; the wire
bytes and the decoded arrays hash alike; the psi key carries the digest."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.ranker.sequences import Behaviors, UserPrefix
from shared.fingerprint import (
    CHUNK_TOKENS,
    PrefixFingerprint,
    common_chunks,
    common_tokens,
    prefix_fingerprint,
)
from shared.psi_key import PsiKey

C = CHUNK_TOKENS


def tokens(n: int, profile: int = 3, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 1 << 40, profile),
        rng.integers(0, 1 << 40, n),
        rng.integers(0, 8, n).astype(np.int32),
        np.sort(rng.integers(0, 1 << 31, n)),
    )


def fp(arrays: tuple[np.ndarray, ...], n: int | None = None) -> PrefixFingerprint:
    prof, items, actions, stamps = arrays
    if n is not None:
        items, actions, stamps = items[:n], actions[:n], stamps[:n]
    return prefix_fingerprint(prof, items, actions, stamps)


def test_chunks_cover_the_prefix_and_the_last_digest_names_it():
    arrays = tokens(2 * C + 10, profile=5)
    f = fp(arrays)
    assert f.length == 2 * C + 15
    assert f.profile_len == 5
    assert len(f.chunks) == 3  # two whole chunks and a partial one
    assert f.digest == f.chunks[-1]
    assert fp(tokens(0, profile=0)).digest == fp(tokens(0, profile=0, seed=1)).digest  # empty: the seed


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5 * C), cut=st.integers(0, 5 * C), profile=st.integers(0, 2 * C))
def test_a_prefix_of_a_token_list_shares_its_chain(n, cut, profile):
    arrays = tokens(n, profile)
    whole = fp(arrays)
    cut = min(cut, n)
    part = fp(arrays, cut)
    whole_chunks = part.length // C  # the part's whole chunks are chunks of the longer list
    assert part.chunks[:whole_chunks] == whole.chunks[:whole_chunks]
    assert common_chunks(part, whole) >= whole_chunks
    assert common_tokens(part, whole) >= whole_chunks * C
    assert common_tokens(part, whole) <= part.length
    if part.length == whole.length:
        assert part == whole


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 4 * C),
    at=st.integers(0, 4 * C),
    which=st.sampled_from(["profile", "items", "actions", "timestamps"]),
)
def test_any_one_token_change_changes_its_chunk_and_every_later_digest(n, at, which):
    arrays = tokens(n, profile=4)
    prof, items, actions, stamps = (a.copy() for a in arrays)
    changed = {"profile": prof, "items": items, "actions": actions, "timestamps": stamps}[which]
    index = at % len(changed)
    changed[index] += 1
    position = index if which == "profile" else len(prof) + index  # the token's place in [U, S_l]
    before, after = fp(arrays), prefix_fingerprint(prof, items, actions, stamps)
    chunk = position // C
    assert before.chunks[:chunk] == after.chunks[:chunk]
    assert all(x != y for x, y in zip(before.chunks[chunk:], after.chunks[chunk:], strict=True))
    assert common_chunks(before, after) == chunk
    assert common_tokens(before, after) == chunk * C


def test_profile_length_is_part_of_the_content():
    """The same values split differently between profile and behaviours are another prefix."""
    prof = np.arange(4)
    items = np.arange(4, 10)
    a = prefix_fingerprint(prof, items, np.zeros(6, np.int32), np.zeros(6, np.int64))
    b = prefix_fingerprint(prof[:3], np.arange(3, 10), np.zeros(7, np.int32), np.zeros(7, np.int64))
    assert a.length == b.length
    assert a.digest != b.digest
    assert common_chunks(a, b) == 0


def test_wire_bytes_decoded_arrays_and_tensors_hash_alike():
    arrays = tokens(3 * C + 7, profile=2)
    prof, items, actions, stamps = arrays
    wire = prefix_fingerprint(
        prof.astype("<i8").tobytes(),
        items.astype("<i8").tobytes(),
        actions.astype("<i4").tobytes(),
        stamps.astype("<i8").tobytes(),
    )
    as_int64 = prefix_fingerprint(prof, items, actions.astype(np.int64), stamps)  # decoded: int64 actions
    assert wire == as_int64 == fp(arrays)
    prefix = UserPrefix(9, 1, torch.from_numpy(prof), Behaviors.of(items, actions.astype(np.int64), stamps))
    assert prefix.fingerprint == wire


def test_ragged_arrays_are_refused():
    with pytest.raises(ValueError, match="whole number"):
        prefix_fingerprint(b"\x00" * 7, b"", b"", b"")
    with pytest.raises(ValueError, match="must match"):
        prefix_fingerprint(b"", b"\x00" * 16, b"\x00" * 4, b"\x00" * 16)


def test_the_psi_key_names_content_and_groups_by_name():
    a = PsiKey(1, 2, "m", 10)
    b = PsiKey(1, 2, "m", 11)
    assert a != b
    assert a.name == b.name
    assert "fingerprint=000000000000000a" in str(a)
    with pytest.raises(ValueError, match="uint64"):
        PsiKey(1, 2, "m", 1 << 64)
