"""Partial psi is exact: for ANY split point c, the first c prefix tokens' K/V read from psi plus
the rest of the prefix and the suffix computed in the ranking step give the scores of full
inference (<= 1e-5 in float32 on the CPU); and psi built in chunks of any size equals psi built
in one pre-inference."""

from __future__ import annotations

import itertools

import pytest
import torch

from relaygr.synthetic import Shape, batch
from services.ranker.model import HSTURanker, PrefixChunk
from services.ranker.sequences import InvalidSequenceError
from shared.fingerprint import CHUNK_TOKENS
from shared.modelspec import preset

TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> HSTURanker:
    return HSTURanker.from_seed(preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def deep() -> HSTURanker:
    spec = preset("tiny").with_overrides(name="deep", num_layers=3, num_heads=2, head_dim=16)
    return HSTURanker.from_seed(spec, seed=3)


def build_in_chunks(model: HSTURanker, prefix, bounds: list[int]):
    """psi of `prefix` built chunk by chunk at these boundaries (0 < b1 < ... < length)."""
    psi = model.new_psi(prefix)
    edges = [0, *bounds, prefix.length]
    for start, end in itertools.pairwise(edges):
        model.preinfer_chunks([PrefixChunk(prefix, psi, start, end)])
    return psi


def split_points(profile: int, length: int) -> list[int]:
    """0, the profile boundary and its neighbours, fingerprint chunk boundaries, the full length,
    and a few arbitrary points."""
    points = {0, 1, profile - 1, profile, profile + 1, length - 1, length, length // 3}
    points.update(range(CHUNK_TOKENS, length, CHUNK_TOKENS))
    gen = torch.Generator().manual_seed(length)
    points.update(int(x) for x in torch.randint(0, length + 1, (4,), generator=gen))
    return sorted(p for p in points if 0 <= p <= length)


@pytest.mark.parametrize("fixture", ["model", "deep"])
def test_any_split_point_equals_full_inference(fixture, request):
    model: HSTURanker = request.getfixturevalue(fixture)
    prefixes, suffixes = batch(11, [Shape(5, 700, 12, 9)])
    prefix, suffix = prefixes[0], suffixes[0]
    want = model.full([prefix], [suffix])[0]
    whole = model.preinfer([prefix])[0]
    for c in split_points(prefix.profile.numel(), prefix.length):
        psi = model.new_psi(prefix)
        if c:
            model.preinfer_chunks([PrefixChunk(prefix, psi, 0, c)])
        got = model.rank_partial([prefix], [suffix], [psi], [c])[0]
        assert float((got - want).abs().max()) <= TOL, f"split {c}"
        # The ranking step wrote the rest of the prefix's K/V: psi is now complete and exact.
        assert float((psi.kv - whole.kv).abs().max()) <= TOL, f"psi completed from split {c}"
        assert torch.equal(psi.timestamps, whole.timestamps)


def test_a_batch_mixes_split_points_users_and_lengths(model):
    prefixes, suffixes = batch(12, [Shape(3, 300, 5, 7), Shape(0, 520, 0, 4), Shape(2, 90, 30, 16)])
    want = model.full(prefixes, suffixes)
    splits = [256, 0, 92]  # a chunk boundary, nothing built (no profile here), the whole prefix
    psis = []
    for p, c in zip(prefixes, splits, strict=True):
        psi = model.new_psi(p)
        if c:
            model.preinfer_chunks([PrefixChunk(p, psi, 0, c)])
        psis.append(psi)
    got = model.rank_partial(prefixes, suffixes, psis, splits)
    for g, w in zip(got, want, strict=True):
        assert float((g - w).abs().max()) <= TOL


@pytest.mark.parametrize("chunk", [1, 7, 256, 512, 1000])
def test_psi_built_in_chunks_equals_one_preinference(deep, chunk):
    prefixes, suffixes = batch(13, [Shape(4, 600, 8, 8)])
    prefix = prefixes[0]
    whole = deep.preinfer([prefix])[0]
    bounds = list(range(chunk, prefix.length, chunk))
    psi = build_in_chunks(deep, prefix, bounds)
    assert psi.key == whole.key
    assert float((psi.kv - whole.kv).abs().max()) <= TOL
    got = deep.rank_cached(suffixes, [psi], [psi.key])[0]
    assert float((got - deep.full(prefixes, suffixes)[0]).abs().max()) <= TOL


def test_chunks_of_several_users_in_one_batch(model):
    prefixes, _ = batch(14, [Shape(2, 400, 0, 1), Shape(6, 300, 0, 1)])
    whole = model.preinfer(prefixes)
    psis = [model.new_psi(p) for p in prefixes]
    model.preinfer_chunks([PrefixChunk(p, psi, 0, 256) for p, psi in zip(prefixes, psis, strict=True)])
    model.preinfer_chunks([PrefixChunk(p, psi, 256, p.length) for p, psi in zip(prefixes, psis, strict=True)])
    for psi, w in zip(psis, whole, strict=True):
        assert float((psi.kv - w.kv).abs().max()) <= TOL


def test_bad_chunks_and_splits_are_refused(model):
    prefixes, suffixes = batch(15, [Shape(2, 50, 2, 2), Shape(2, 60, 2, 2)])
    psi = model.new_psi(prefixes[0])
    with pytest.raises(ValueError, match="chunk"):
        PrefixChunk(prefixes[0], psi, 10, 10)
    with pytest.raises(ValueError, match="chunk"):
        PrefixChunk(prefixes[0], psi, 0, 53)
    with pytest.raises(ValueError, match="tokens for a"):
        PrefixChunk(prefixes[1], psi, 0, 10)
    with pytest.raises(ValueError, match="one chunk per psi"):
        model.preinfer_chunks([PrefixChunk(prefixes[0], psi, 0, 10), PrefixChunk(prefixes[0], psi, 10, 20)])
    with pytest.raises(ValueError, match="not this prefix"):
        model.rank_partial([prefixes[1]], [suffixes[1]], [psi], [0])
    with pytest.raises(ValueError, match="split"):
        model.rank_partial([prefixes[0]], [suffixes[0]], [psi], [53])


def test_one_pass_writing_kv_equals_preinfer(deep):
    """What a pre-inference CUDA graph computes (services/ranker/graphs.py): the chunks' tokens
    packed as one batch (pack_chunks), every layer's K/V written into one buffer
    (layers_writing), gives each user preinfer()'s psi, for whole prefixes and for first chunks."""
    prefixes, _ = batch(5, [Shape(4, 600, 1, 1), Shape(2, 300, 1, 1), Shape(1, 700, 1, 1)])
    ends = [prefixes[0].length, prefixes[1].length, CHUNK_TOKENS]  # the last: a first chunk only
    chunks = [PrefixChunk(p, deep.new_psi(p), 0, end) for p, end in zip(prefixes, ends, strict=True)]
    host = deep.pack_chunks(chunks)
    assert host.lengths == ends
    assert host.candidate_counts == ()
    spec = deep.spec
    kv = torch.full((spec.num_layers, 2, host.total, spec.hidden), float("nan"))
    tokens = deep._on_device(host)
    deep.layers_writing(deep._embed(tokens), deep._prepare(tokens.seq, None), kv)
    start = 0
    for p, end in zip(prefixes, ends, strict=True):
        want = deep.preinfer([p])[0].kv[:, :, :end]
        assert (kv[:, :, start : start + end] - want).abs().max() <= TOL
        start += end
    assert not kv.isnan().any()  # every row written


def test_full_ranking_packs_what_pack_full_lays_out(model):
    """full() runs on pack_full's layout (what a full-ranking CUDA graph is staged from)."""
    prefixes, suffixes = batch(6, [Shape(3, 200, 10, 7), Shape(0, 50, 0, 3)])
    host = model.pack_full(prefixes, suffixes)
    assert host.lengths == [p.length + s.recent.items.numel() + s.candidates.numel()
                            for p, s in zip(prefixes, suffixes, strict=True)]  # fmt: skip
    assert host.n_hist == [p.length + s.recent.items.numel() for p, s in zip(prefixes, suffixes, strict=True)]
    assert host.candidate_counts == (7, 3)


def test_a_full_ranking_that_keeps_psi_leaves_preinfers_psi_and_the_same_scores(deep):
    """full(..., psis): the ranking's own pass writes each kept user's prefix K/V (what a full
    recompute leaves for the user's next call); users with None keep nothing; scores are those of
    full() without psi, and a later call against the kept psi scores as full inference."""
    prefixes, suffixes = batch(16, [Shape(4, 600, 9, 7), Shape(0, 300, 0, 3), Shape(2, 90, 30, 16)])
    want = deep.full(prefixes, suffixes)
    psis = [deep.new_psi(prefixes[0]), None, deep.new_psi(prefixes[2])]
    with torch.inference_mode():  # psi blocks are inference tensors
        for psi in psis:
            if psi is not None:
                psi.kv.fill_(float("nan"))
    got = deep.full(prefixes, suffixes, psis)
    for g, w in zip(got, want, strict=True):
        assert float((g - w).abs().max()) <= TOL
    for p, s, psi in zip(prefixes, suffixes, psis, strict=True):
        if psi is None:
            continue
        whole = deep.preinfer([p])[0]
        assert psi.key == whole.key
        assert float((psi.kv - whole.kv).abs().max()) <= TOL  # every row written
        assert torch.equal(psi.timestamps, whole.timestamps)
        again = deep.rank_cached([s], [psi], [psi.key])[0]
        assert float((again - deep.full([p], [s])[0]).abs().max()) <= TOL


def test_a_full_ranking_refuses_a_psi_not_its_prefixs(model):
    prefixes, suffixes = batch(17, [Shape(2, 50, 2, 2), Shape(2, 60, 2, 2)])
    with pytest.raises(ValueError, match="not this prefix"):
        model.full(prefixes, suffixes, [model.new_psi(prefixes[1]), None])
    with pytest.raises(InvalidSequenceError, match="one psi"):
        model.full(prefixes, suffixes, [model.new_psi(prefixes[0])])


def test_a_new_psi_block_holds_the_prefix_timestamps_unless_its_caller_copies_them(model):
    """new_psi writes the timestamps a pre-inference's psi holds (profile tokens 0, then the
    long-term behaviours'); with timestamps=False it leaves them to its caller (a full graph
    copies them from its staged batch on the device), the block and key the same."""
    prefixes, _ = batch(17, [Shape(5, 300, 4, 4)])
    prefix = prefixes[0]
    built = model.preinfer([prefix])[0]
    psi = model.new_psi(prefix)
    assert torch.equal(psi.timestamps, built.timestamps)
    assert psi.timestamps[: prefix.profile.numel()].eq(0).all()
    bare = model.new_psi(prefix, timestamps=False)
    assert bare.key == psi.key
    assert bare.prefix_len == prefix.length
    assert bare.nbytes == psi.nbytes
    assert bare.block is not None
    assert bare.timestamps.data_ptr() == bare.block.data_ptr() + bare.kv.nbytes
