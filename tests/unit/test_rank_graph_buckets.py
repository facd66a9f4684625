"""The CUDA-graph bucket policy (pure: runs on the CPU; the graphs themselves are tested on the GPU)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from services.ranker.config import RankerConfig
from services.ranker.graphs import (
    CACHED,
    CHUNK,
    FULL,
    FULL_KEEP,
    PREINFER,
    BucketKey,
    GraphLimits,
    GraphStats,
    GraphStatsCollector,
    bucket_for,
    family_graph_cap,
    multi_full_keys,
    prefix_reads,
    token_ladder,
    warm_full_keys,
)


def test_token_ladder_has_bounded_padding_and_ends_at_the_limit():
    ladder = token_ladder(4096)
    assert ladder[0] == 64
    assert ladder[-1] == 4096
    assert ladder == sorted(set(ladder))
    for small, big in itertools.pairwise(ladder):
        assert big - small <= max(64, small // 4)  # padding: under one row block, or under 25%
    assert token_ladder(100) == [64, 100]
    assert token_ladder(1300) == [*range(64, 1025, 64), 1280, 1300]


def test_known_buckets():
    limits = GraphLimits(max_batch=8, max_tokens=4096)
    assert bucket_for(1, 320, 320, limits) == BucketKey(1, 320, 320)
    assert bucket_for(3, 960, 320, limits) == BucketKey(4, 960, 512)
    assert bucket_for(8, 2560, 320, limits) == BucketKey(8, 2560, 512)
    assert bucket_for(7, 2240, 320, limits) == BucketKey(8, 2560, 512)
    assert bucket_for(4, 1100, 300, limits) == BucketKey(4, 1280, 512)
    assert bucket_for(1, 5, 5, limits) == BucketKey(1, 64, 64)


def test_outside_the_limits_there_is_no_bucket():
    limits = GraphLimits(max_batch=4, max_tokens=1024)
    assert bucket_for(5, 100, 20, limits) is None  # too many sequences
    assert bucket_for(2, 1025, 600, limits) is None  # too many tokens
    assert bucket_for(0, 0, 0, limits) is None
    assert bucket_for(2, 100, 101, limits) is None  # inconsistent: a sequence longer than the batch


@given(
    batch=st.integers(1, 16),
    lengths=st.lists(st.integers(0, 600), min_size=1, max_size=16),
    max_tokens=st.sampled_from([256, 1000, 4096]),
)
def test_a_bucket_always_holds_its_batch(batch, lengths, max_tokens):
    lengths = (lengths * batch)[:batch]
    limits = GraphLimits(max_batch=8, max_tokens=max_tokens)
    tokens, longest = sum(lengths), max(lengths)
    key = bucket_for(batch, tokens, longest, limits)
    if batch > 8 or tokens > max_tokens:
        assert key is None
        return
    assert key is not None
    assert key.batch >= batch
    assert key.tokens >= tokens
    assert key.max_len >= longest
    assert key.max_len <= key.tokens
    assert key.batch <= 8
    assert key.tokens <= max_tokens


def test_limits_are_validated():
    with pytest.raises(ValueError, match="must be >= 1"):
        GraphLimits(max_tokens=0).validate()
    with pytest.raises(ValueError, match="rab_index_mb"):
        GraphLimits(rab_index_mb=0).validate()


def test_full_and_preinfer_buckets_have_limits_of_their_own():
    limits = GraphLimits(max_batch=8, max_tokens=1024, max_full_tokens=8192, max_full_batch=2)
    # A 4096-token prefix with 64 recent and 256 candidates: one full ranking.
    assert bucket_for(1, 4416, 4416, limits, FULL) == BucketKey(1, 5120, 5120, FULL)
    assert bucket_for(1, 4096, 4096, limits, PREINFER) == BucketKey(1, 4096, 4096, PREINFER)
    assert bucket_for(2, 8192, 4096, limits, PREINFER) == BucketKey(2, 8192, 4096, PREINFER)
    assert bucket_for(3, 3000, 1000, limits, FULL) is None  # more sequences than max_full_batch
    assert bucket_for(1, 8193, 8193, limits, FULL) is None
    assert bucket_for(1, 4416, 4416, limits) is None  # the cached family keeps its own limit
    # Same sizes, other families: other graphs.
    assert len({bucket_for(1, 300, 300, limits, m) for m in (CACHED, FULL, PREINFER)}) == 3
    # Off by default: no full or preinfer graph at all.
    for mode in (FULL, PREINFER):
        assert bucket_for(1, 100, 100, GraphLimits(), mode) is None


def test_full_graph_limits_are_validated():
    with pytest.raises(ValueError, match="full graph limits"):
        GraphLimits(max_full_tokens=-1).validate()
    with pytest.raises(ValueError, match="full graph limits"):
        GraphLimits(max_full_batch=0).validate()
    GraphLimits(max_full_tokens=0).validate()  # 0: none, valid


def test_graph_counts_are_exported_per_family():
    stats = GraphStats(replays_by_family={FULL: 3}, eager_by_family={PREINFER: 2, CACHED: 1})
    registry = CollectorRegistry()
    registry.register(GraphStatsCollector(stats))

    def value(what: str, family: str) -> float | None:
        return registry.get_sample_value(f"relaygr_ranker_graph_{what}_total", {"family": family})

    assert value("replays", FULL) == 3
    assert value("replays", CACHED) == 0  # every family is exported, 0 where none ran
    assert value("eager_batches", PREINFER) == 2
    assert value("eager_batches", CACHED) == 1
    stats.replays_by_family[FULL] = 4  # read at scrape time
    assert value("replays", FULL) == 4


def test_full_and_preinfer_graphs_of_one_sequence_are_all_captured_at_start_up():
    limits = GraphLimits(max_full_tokens=8192)
    keys = warm_full_keys(limits)
    sizes = sorted({k.tokens for k in keys})
    assert sizes[0] == 256
    assert sizes[-1] == 8192
    for small, big in itertools.pairwise(sizes):
        assert big - small <= max(64, small // 4)  # padding under 25% past the first size
    assert len(sizes) <= limits.max_full_graphs
    assert {k.mode for k in keys} == {FULL, PREINFER}
    # Every one-sequence batch of either family lands on a bucket captured at start-up.
    for mode in (FULL, PREINFER):
        for tokens in (1, 100, 256, 257, 700, 4096, 4416, 8000, 8192):
            assert bucket_for(1, tokens, tokens, limits, mode) in keys, (mode, tokens)
    assert warm_full_keys(GraphLimits()) == []  # off by default
    # The ranker's default reaches a 16384-token prefix with a 1024-token suffix, every size of
    # it captured at start-up within the family's cap.
    default = GraphLimits(max_full_tokens=RankerConfig().graph_max_full_tokens)
    assert bucket_for(1, 16384 + 320, 16384 + 320, default, FULL) in warm_full_keys(default)
    assert len(warm_full_keys(default)) == 2 * len({k.tokens for k in warm_full_keys(default)})
    few = warm_full_keys(GraphLimits(max_full_tokens=8192, max_full_graphs=4))
    assert len(few) == 8  # at most the family's cap each
    # With chunks that read psi replaying graphs, their family is warmed at the same sizes.
    with_chunks = warm_full_keys(limits, chunks_reading_psi=True)
    assert {k.mode for k in with_chunks} == {FULL, PREINFER, CHUNK}
    assert {k.tokens for k in with_chunks if k.mode == CHUNK} == set(sizes)
    for tokens in (1, 700, 8192):
        assert bucket_for(1, tokens, tokens, limits, CHUNK) in with_chunks


@given(
    st.integers(min_value=2, max_value=4),
    st.sampled_from([256, 640, 1000, 2048, 4096]),
    st.data(),
)
def test_batches_of_full_rankings_within_full_batch_tokens_land_on_buckets_warmed_at_start_up(
    max_full_batch: int, full_batch_tokens: int, data: st.DataObject
) -> None:
    # The scheduler batches full rankings only into shapes a captured graph holds; graphs of
    # several sequences are captured only at start-up (warm_full_keys): every batch of 2..max
    # full rankings whose bucket fits within full_batch_tokens must find its graph there.
    limits = GraphLimits(
        max_full_tokens=17408, max_full_batch=max_full_batch, full_batch_tokens=full_batch_tokens
    ).validate()
    held = set(warm_full_keys(limits))
    n = data.draw(st.integers(min_value=2, max_value=max_full_batch))
    lengths = data.draw(
        st.lists(st.integers(min_value=1, max_value=full_batch_tokens), min_size=n, max_size=n)
    )
    key = bucket_for(n, sum(lengths), max(lengths), limits, FULL)
    if key is not None and key.tokens <= full_batch_tokens:
        assert key in held, (lengths, key)
    else:  # more tokens than the largest size within full_batch_tokens: never warmed
        assert key not in set(multi_full_keys(limits))


def test_full_graphs_of_several_sequences_are_off_by_default_bounded_and_counted_in_the_cap():
    assert multi_full_keys(GraphLimits(max_full_tokens=17408)) == ()  # off by default
    assert RankerConfig().graph_full_batch_tokens == 0
    one = GraphLimits(max_full_tokens=17408, full_batch_tokens=2048, max_full_batch=1)
    assert multi_full_keys(one) == ()  # nothing to batch with one sequence a graph
    limits = GraphLimits(max_full_tokens=17408, full_batch_tokens=2048)
    keys = multi_full_keys(limits)
    assert len(keys) == 27  # what the setting's help says
    assert {k.mode for k in keys} == {FULL}
    assert {k.batch for k in keys} == {2}
    assert max(k.tokens for k in keys) == 2048
    singles = [k for k in warm_full_keys(limits) if k.mode == FULL and k.batch == 1]
    # Room for all of them beside the one-sequence graphs; other families keep their cap.
    assert family_graph_cap(limits, FULL) == limits.max_full_graphs + 27 >= len(singles) + 27
    assert family_graph_cap(limits, PREINFER) == limits.max_full_graphs
    assert family_graph_cap(limits, CACHED) == limits.max_graphs
    with pytest.raises(ValueError, match="full_batch_tokens"):
        GraphLimits(max_full_tokens=1024, full_batch_tokens=2048).validate()
    with pytest.raises(ValueError, match="full_batch_tokens"):
        GraphLimits(max_full_tokens=1024, full_batch_tokens=-1).validate()


def test_a_ranker_whose_full_rankings_keep_psi_warms_a_keeping_graph_beside_each_plain_one():
    # Full rankings that keep nothing replay the plain family (no K/V writes: k30c measured
    # them 0.17 ms slower on an H100 where every full graph wrote K/V); those that keep psi
    # replay the full_keep family, warmed at the same buckets, several sequences included.
    limits = GraphLimits(max_full_tokens=8192, full_batch_tokens=2048)
    plain = warm_full_keys(limits)
    assert FULL_KEEP not in {k.mode for k in plain}
    keeping = warm_full_keys(limits, full_keeps_kv=True)
    full = {(k.batch, k.tokens, k.max_len) for k in keeping if k.mode == FULL}
    kept = {(k.batch, k.tokens, k.max_len) for k in keeping if k.mode == FULL_KEEP}
    assert full == kept
    assert any(b > 1 for b, _, _ in kept)
    assert set(plain) <= set(keeping)
    assert family_graph_cap(limits, FULL_KEEP) == family_graph_cap(limits, FULL)
    assert len(kept) <= family_graph_cap(limits, FULL_KEEP)
    for n, tokens in ((1, 700), (1, 8192), (2, 1500)):
        key, base = (bucket_for(n, tokens, tokens // n, limits, mode) for mode in (FULL_KEEP, FULL))
        assert key is not None
        assert base is not None
        assert key in keeping
        assert key == BucketKey(base.batch, base.tokens, base.max_len, FULL_KEEP)
    # Its counts are exported as a family of their own.
    stats = GraphStats(replays_by_family={FULL_KEEP: 2})
    assert stats.counts()[FULL_KEEP] == {"replays": 2, "eager": 0}
    assert stats.counts()[FULL] == {"replays": 0, "eager": 0}


def test_prefix_reads_stage_whole_blocks_or_their_first_tokens_and_refuse_a_read_past_one():
    # Complete psi (the cached family): each block whole, timestamps back to back.
    plens, offsets = prefix_reads([700, 0, 300], None)
    assert plens == [700, 0, 300]
    assert offsets.tolist() == [0, 700, 700, 1000]
    # Chunks reading psi built in part (the chunk family): each block's first tokens only; the
    # blocks' own lengths stay their layers' stride (staged apart as pstride).
    plens, offsets = prefix_reads([1903, 1302], [700, 0])
    assert plens == [700, 0]
    assert offsets.tolist() == [0, 700, 700]
    with pytest.raises(ValueError, match="reads"):
        prefix_reads([500], [501])  # past its block: it would read the next layer's K
    with pytest.raises(ValueError, match="reads"):
        prefix_reads([500, 600], [100])
