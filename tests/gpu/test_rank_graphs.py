"""Ranking against psi through captured CUDA graphs == eager rank_cached (run on the device machine).

Every replay must see only its own batch: batches of different sizes, prefix lengths and psi
addresses go through the same graph one after another, and each is compared with the eager path.
"""

from __future__ import annotations

import pytest
import torch

from relaygr.synthetic import Shape, batch
from services.ranker.model import HSTURanker, PrefixChunk
from services.ranker.psi import PsiMismatchError
from shared.modelspec import preset

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from services.ranker.graphs import (  # noqa: E402
    GraphLimits,
    RankGraphs,
    bucket_for,
    multi_full_keys,
    warm_full_keys,
)

SPEC = preset("tiny").with_overrides(name="graphs", num_layers=3, num_heads=2, head_dim=32)


def max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    scale = max(float(torch.cat(a).abs().max()), 1e-3)
    return max(float((x.cpu() - y.cpu()).abs().max()) for x, y in zip(a, b, strict=True)) / scale


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request) -> HSTURanker:
    return HSTURanker.from_seed(SPEC.with_overrides(dtype=request.param), seed=3, device="cuda")


def ranked(model, graphs, seed, shapes):
    prefixes, suffixes = batch(seed, shapes)
    psis = model.preinfer(prefixes)
    keys = [p.key for p in psis]
    eager = model.rank_cached(suffixes, psis, keys)
    first = graphs.rank(suffixes, psis, keys)
    if first is None:  # no graph for this bucket yet: it is remembered, capture it now
        assert graphs.has_pending()
        graphs.capture_pending(limit=10)
        first = graphs.rank(suffixes, psis, keys)
    assert first is not None
    return eager, first


@pytest.mark.parametrize("copies", ["engine", "scores_aside", "kernel"])
def test_graph_replays_match_eager_across_batches(model, copies):
    graphs = RankGraphs(
        model, GraphLimits(max_batch=4, max_tokens=1024, max_prefix_tokens=4096), batch_copies=copies
    )
    assert graphs.batch_copies == copies  # an H100/H200 gives device views of page-locked memory
    tol = 2e-3 if model.spec.dtype == "float32" else 2e-2
    cases = [
        [Shape(4, 300, 20, 40)],
        [Shape(2, 1000, 30, 50)],  # same bucket, other prefix length and psi address
        [Shape(0, 0, 10, 10)],  # empty prefix
        [Shape(3, 500, 8, 30), Shape(1, 2000, 40, 60), Shape(0, 7, 0, 1)],  # 3 users in a 4-bucket
        [Shape(5, 100, 64, 200), Shape(2, 3000, 1, 5)],
        [Shape(1, 50, 0, 3)] * 4,
    ]
    for seed, shapes in enumerate(cases):
        eager, graphed = ranked(model, graphs, seed, shapes)
        assert max_rel(eager, graphed) <= tol, shapes
    assert graphs.stats.replays >= len(cases)
    # Replaying an earlier bucket again after others still gives its own batch's scores.
    eager, graphed = ranked(model, graphs, 0, cases[0])
    assert max_rel(eager, graphed) <= tol


def test_batches_that_do_not_fit_fall_back(model):
    graphs = RankGraphs(model, GraphLimits(max_batch=2, max_tokens=256, max_prefix_tokens=512))
    prefixes, suffixes = batch(7, [Shape(1, 600, 4, 4)])
    psis = model.preinfer(prefixes)
    assert graphs.rank(suffixes, psis, [p.key for p in psis]) is None
    assert graphs.stats.fallbacks == {"prefix_too_long": 1}
    prefixes, suffixes = batch(8, [Shape(1, 10, 100, 200)])
    psis = model.preinfer(prefixes)
    assert graphs.rank(suffixes, psis, [p.key for p in psis]) is None
    assert graphs.stats.fallbacks["too_large"] == 1
    assert not graphs.has_pending()


def test_a_foreign_psi_is_refused(model):
    graphs = RankGraphs(model, GraphLimits(max_batch=2, max_tokens=256))
    prefixes, suffixes = batch(9, [Shape(1, 30, 4, 4)])
    psi = model.preinfer(prefixes)[0]
    with pytest.raises(PsiMismatchError):
        graphs.rank(
            suffixes, [psi], [model.psi_key(psi.key.user_id + 1, psi.key.prefix_version, psi.key.fingerprint)]
        )


def test_bucket_keys_are_what_the_engine_warms():
    limits = GraphLimits(max_batch=8, max_tokens=4096)
    keys = {bucket_for(b, b * 320, 320, limits) for b in range(1, 9)}
    assert None not in keys
    assert len(keys) <= 8


def with_capture(graphs, run):
    """run() through a graph: the first call remembers its bucket (None / False), capture, again."""
    first = run()
    if first is None or first is False:
        assert graphs.has_pending()
        graphs.capture_pending(limit=10)
        first = run()
    return first


def test_full_graph_replays_match_eager_full(model):
    graphs = RankGraphs(
        model, GraphLimits(max_batch=2, max_tokens=256, max_full_tokens=4096, max_full_batch=2)
    )
    tol = 2e-3 if model.spec.dtype == "float32" else 2e-2
    cases = [
        [Shape(4, 1500, 20, 40)],
        [Shape(2, 1200, 30, 50)],  # same bucket, another length
        [Shape(0, 0, 10, 10)],  # no long-term history
        [Shape(3, 700, 8, 30), Shape(1, 900, 40, 60)],
        [Shape(5, 3000, 64, 200)],
    ]
    for seed, shapes in enumerate(cases):
        prefixes, suffixes = batch(100 + seed, shapes)
        eager = model.full(prefixes, suffixes)
        graphed = with_capture(graphs, lambda p=prefixes, s=suffixes: graphs.full(p, s))
        assert graphed is not None
        assert max_rel(eager, graphed) <= tol, shapes
    assert graphs.stats.replays_by_family["full"] == len(cases)
    # What the scheduler asks before batching full rankings: only captured shapes replay.
    one = [sum(p.length + s.length for p, s in zip(*batch(104, cases[4]), strict=True))]
    assert graphs.holds_full(one)  # the last case's bucket was captured above
    assert not graphs.holds_full([5000])  # over max_full_tokens
    assert not graphs.holds_full([4000, 90])  # within the limits, never captured
    assert not graphs.holds_full([])
    # A batch over the family's limits runs eagerly.
    prefixes, suffixes = batch(200, [Shape(1, 5000, 4, 4)])
    assert graphs.full(prefixes, suffixes) is None
    assert graphs.stats.fallbacks["too_large"] >= 1
    assert graphs.stats.counts()["full"]["eager"] >= 1


def test_full_rankings_of_two_sequences_replay_graphs_captured_at_start_up(model):
    """full_batch_tokens: warm_full_keys holds every bucket of two full rankings up to that many
    tokens, so that the scheduler (which batches full rankings only into held shapes) may pair
    them from the first call; each pair's scores are what each ranking gets eagerly alone, a
    kept psi is what preinfer builds, and a pair over the limit is not held."""
    limits = GraphLimits(max_batch=2, max_tokens=256, max_full_tokens=2048, max_full_batch=2,
                         full_batch_tokens=1024)  # fmt: skip
    graphs = RankGraphs(model, limits, full_keeps_kv=True)
    keys = warm_full_keys(limits, full_keeps_kv=True)
    graphs.request(keys)
    graphs.capture_pending(limit=len(keys))
    assert not graphs.has_pending()
    assert multi_full_keys(limits)
    assert set(multi_full_keys(limits)) <= set(keys)
    assert graphs.stats.captured == len(set(keys))  # none failed, none over the family's cap
    tol = 2e-3 if model.spec.dtype == "float32" else 2e-2
    cases = [
        [Shape(4, 300, 20, 40), Shape(2, 200, 30, 50)],
        [Shape(3, 700, 8, 30), Shape(0, 0, 10, 10)],  # one without long-term history
        [Shape(1, 10, 4, 4), Shape(1, 12, 4, 5)],  # the smallest
        [Shape(2, 450, 10, 30), Shape(2, 430, 12, 40)],  # near the limit, even halves
    ]
    for seed, shapes in enumerate(cases):
        prefixes, suffixes = batch(700 + seed, shapes)
        lengths = [p.length + s.length for p, s in zip(prefixes, suffixes, strict=True)]
        assert sum(lengths) <= limits.full_batch_tokens, lengths
        assert graphs.holds_full(lengths), lengths
        replays = graphs.stats.replays_by_family.get("full_keep", 0)
        psis: list = [model.new_psi(prefixes[0]), None]
        graphed = graphs.full(prefixes, suffixes, psis)
        assert graphed is not None
        assert not graphs.has_pending()
        assert graphs.stats.replays_by_family["full_keep"] == replays + 1  # the keeping family
        plain = graphs.stats.replays_by_family.get("full", 0)
        assert max_rel(graphs.full(prefixes, suffixes), graphed) <= tol  # keeping nothing: plain
        assert graphs.stats.replays_by_family["full"] == plain + 1
        torch.cuda.synchronize()
        alone = [model.full([p], [s])[0] for p, s in zip(prefixes, suffixes, strict=True)]
        assert max_rel(alone, graphed) <= tol, shapes
        want = model.preinfer([prefixes[0]])[0]
        got = psis[0].kv.float()
        assert (got - want.kv.float()).abs().max() <= tol * max(float(want.kv.float().abs().max()), 1e-3)
    prefixes, suffixes = batch(800, [Shape(2, 900, 10, 30), Shape(2, 900, 12, 40)])
    assert not graphs.holds_full([p.length + s.length for p, s in zip(prefixes, suffixes, strict=True)])


def test_a_full_graph_that_keeps_kv_leaves_the_psi_preinfer_builds(model):
    """full_keeps_kv: the full-ranking graph also writes K/V; full(..., psis) copies each kept
    user's prefix rows into its psi. Scores as eager full(); psi as eager preinfer(); a user with
    None keeps nothing; without full_keeps_kv a batch that keeps psi runs eagerly."""
    graphs = RankGraphs(
        model,
        GraphLimits(max_batch=2, max_tokens=256, max_full_tokens=4096, max_full_batch=2),
        full_keeps_kv=True,
    )
    tol = 2e-3 if model.spec.dtype == "float32" else 2e-2
    cases = [
        [Shape(4, 1500, 20, 40)],
        [Shape(3, 700, 8, 30), Shape(1, 900, 40, 60)],
        [Shape(5, 3000, 64, 200)],
    ]
    for seed, shapes in enumerate(cases):
        prefixes, suffixes = batch(500 + seed, shapes)
        psis: list = [model.new_psi(p) for p in prefixes]
        if seed % 2:  # blocks allocated by a function the graph calls once its replay is issued
            calls: list[bool] = []

            def make(timestamps, p=prefixes, c=calls, out=psis):
                c.append(timestamps)
                # Left unwritten, and poisoned: the graph copies the timestamps from its batch.
                out[:] = [model.new_psi(x, timestamps) for x in p]
                for psi in out:
                    psi.timestamps.fill_(-7)
                if len(out) > 1:
                    out[1] = None  # this user keeps nothing
                return out

            graphed = with_capture(graphs, lambda p=prefixes, s=suffixes, m=make: graphs.full(p, s, m))
            assert calls
            assert not any(calls)
        else:
            if len(psis) > 1:
                psis[1] = None  # this user keeps nothing
            graphed = with_capture(graphs, lambda p=prefixes, s=suffixes, k=psis: graphs.full(p, s, k))
        assert graphed is not None
        torch.cuda.synchronize()
        assert max_rel(model.full(prefixes, suffixes), graphed) <= tol, shapes
        for p, s, psi in zip(prefixes, suffixes, psis, strict=True):
            if psi is None:
                continue
            want = model.preinfer([p])[0]
            assert torch.equal(psi.timestamps, want.timestamps)
            got = psi.kv.float()
            assert (got - want.kv.float()).abs().max() <= tol * max(float(want.kv.float().abs().max()), 1e-3)
            assert max_rel(model.rank_cached([s], [psi], [psi.key]), model.full([p], [s])) <= tol
    # Batches that kept psi replayed the keeping family; the plain one was never asked for.
    assert graphs.stats.replays_by_family["full_keep"] == len(cases)
    assert graphs.stats.replays_by_family.get("full", 0) == 0
    # Plain full-ranking graphs keep no K/V: a batch that asks for psi is eager.
    plain = RankGraphs(
        model, GraphLimits(max_batch=2, max_tokens=256, max_full_tokens=4096, max_full_batch=2)
    )
    prefixes, suffixes = batch(600, [Shape(1, 600, 4, 4)])
    assert plain.full(prefixes, suffixes, [model.new_psi(prefixes[0])]) is None
    assert plain.stats.fallbacks["kv_not_kept"] == 1


def test_preinfer_graph_builds_the_psi_that_eager_preinfer_builds(model):
    graphs = RankGraphs(
        model, GraphLimits(max_batch=2, max_tokens=512, max_full_tokens=4096, max_full_batch=2)
    )
    tol = 2e-3 if model.spec.dtype == "float32" else 2e-2
    cases = [
        [Shape(4, 2000, 1, 1)],
        [Shape(2, 1000, 1, 1), Shape(3, 1500, 1, 1)],
        [Shape(1, 3000, 1, 1)],  # same bucket as the first, written after a larger batch
    ]
    for seed, shapes in enumerate(cases):
        prefixes, suffixes = batch(300 + seed, [Shape(s.profile, s.long_term, 8, 16) for s in shapes])
        chunks = [PrefixChunk(p, model.new_psi(p), 0, p.length) for p in prefixes]
        assert with_capture(graphs, lambda c=chunks: graphs.preinfer(c)) is True
        torch.cuda.synchronize()
        eager = model.preinfer(prefixes)
        for c, want in zip(chunks, eager, strict=True):
            got = c.psi.kv.float()
            assert (got - want.kv.float()).abs().max() <= tol * max(float(want.kv.float().abs().max()), 1e-3)
        # Ranking against the graph-built psi gives the eager scores.
        keys = [c.psi.key for c in chunks]
        assert max_rel(model.rank_cached(suffixes, [c.psi for c in chunks], keys),
                       model.rank_cached(suffixes, eager, keys)) <= tol  # fmt: skip
    # A chunk after a prefix's first token reads psi: eager.
    prefixes, _ = batch(400, [Shape(1, 600, 1, 1)])
    psi = model.new_psi(prefixes[0])
    assert graphs.preinfer([PrefixChunk(prefixes[0], psi, 256, 512)]) is False
    assert graphs.stats.fallbacks["chunk_reads_psi"] == 1
    assert graphs.stats.replays_by_family["preinfer"] == len(cases)
    assert "cached" not in graphs.stats.replays_by_family


def test_chunks_that_read_psi_replay_graphs_that_build_what_eager_chunks_build(model):
    """With chunks_reading_psi, a prefix built in several steps (the first from its first token,
    each later one reading the psi built before it, in place, in a block longer than what it
    reads) replays graphs at every step, and its psi is the eager chunks' psi; a batch of two
    users at different offsets too. Ranking against it gives the eager scores."""
    graphs = RankGraphs(
        model,
        GraphLimits(max_batch=2, max_tokens=512, max_full_tokens=4096, max_full_batch=2),
        chunks_reading_psi=True,
    )
    tol = 2e-3 if model.spec.dtype == "float32" else 2e-2
    prefixes, suffixes = batch(500, [Shape(3, 1900, 8, 16), Shape(2, 1300, 8, 16)])
    built = [model.new_psi(p) for p in prefixes]
    eager = [model.new_psi(p) for p in prefixes]
    # Steps: user 0 alone [0, 700), both together [700, 1500) and [0, 600), then [1500, end) and
    # [600, 1302): chunks of one step read psi at different offsets.
    ends = [prefixes[0].length, prefixes[1].length]
    steps = [[(0, 0, 700)], [(0, 700, 1500), (1, 0, 600)], [(0, 1500, ends[0]), (1, 600, ends[1])]]
    for step in steps:
        chunks = [PrefixChunk(prefixes[u], built[u], a, b) for u, a, b in step]
        assert with_capture(graphs, lambda c=chunks: graphs.preinfer(c)) is True
        model.preinfer_chunks([PrefixChunk(prefixes[u], eager[u], a, b) for u, a, b in step])
    torch.cuda.synchronize()
    whole = model.preinfer(prefixes)
    for got, want, ref in zip(built, eager, whole, strict=True):
        scale = max(float(ref.kv.float().abs().max()), 1e-3)
        assert (got.kv.float() - want.kv.float()).abs().max() <= tol * scale
        assert (got.kv.float() - ref.kv.float()).abs().max() <= tol * scale
    keys = [p.key for p in built]
    assert max_rel(model.rank_cached(suffixes, built, keys), model.rank_cached(suffixes, whole, keys)) <= tol
    assert graphs.stats.replays_by_family["chunk"] == 2
    assert graphs.stats.replays_by_family["preinfer"] == 1
    assert "chunk_reads_psi" not in graphs.stats.fallbacks


def test_a_capture_that_fails_leaves_its_shape_eager_and_the_others_captured(model, monkeypatch):
    graphs = RankGraphs(
        model, GraphLimits(max_batch=2, max_tokens=256, max_full_tokens=1024, max_full_batch=1)
    )
    real = graphs._capture

    def capture(key):
        if key.mode == "full" and key.tokens == 256:
            raise RuntimeError("capture failed")
        return real(key)

    monkeypatch.setattr(graphs, "_capture", capture)
    keys = [bucket_for(1, 256, 256, graphs.limits, "full"), bucket_for(1, 512, 512, graphs.limits, "full")]
    graphs.request(keys)
    assert graphs.capture_pending(limit=10) == 1  # the other one is captured
    prefixes, suffixes = batch(500, [Shape(1, 100, 4, 8)])  # 113 tokens: the failed bucket
    assert graphs.full(prefixes, suffixes) is None
    assert graphs.stats.fallbacks["capture_failed"] == 1
    assert not graphs.has_pending()  # not remembered for another try
    prefixes, suffixes = batch(501, [Shape(1, 480, 4, 8)])  # 493 tokens: the captured one (512)
    assert graphs.full(prefixes, suffixes) is not None


@pytest.mark.parametrize("copies", ["engine", "scores_aside", "kernel"])
def test_launches_in_flight_each_see_their_own_batch(model, copies):
    """Three launches issued back to back before any is collected (the engine keeps at most two
    in flight; a third reuses the first's page-locked buffers and must first take its scores):
    each equals the eager path, whatever the order they are waited in. Off the engine's copies,
    psi-sized copies to and from page-locked memory run on other streams meanwhile (as a
    demotion and a reload hold the copy engines), so that the scores' copies (aside) wait behind
    them while the replays go on, or (kernel) the batches' own kernels read and write the host
    beside them."""
    graphs = RankGraphs(
        model, GraphLimits(max_batch=4, max_tokens=1024, max_prefix_tokens=4096), batch_copies=copies
    )
    tol = 2e-3 if model.spec.dtype == "float32" else 2e-2
    cases = [
        [Shape(4, 300, 20, 40)],
        [Shape(2, 1000, 30, 50)],
        [Shape(3, 500, 8, 30), Shape(1, 2000, 40, 60)],
        [Shape(5, 100, 64, 200)],
    ]
    batches = []
    for seed, shapes in enumerate(cases):
        prefixes, suffixes = batch(100 + seed, shapes)
        psis = model.preinfer(prefixes)
        keys = [p.key for p in psis]
        batches.append((suffixes, psis, keys, model.rank_cached(suffixes, psis, keys)))
    for suffixes, psis, keys, _ in batches:  # capture every bucket first
        if graphs.launch_rank(suffixes, psis, keys) is None:
            graphs.capture_pending(limit=10)
    torch.cuda.synchronize()
    if copies != "engine":
        big = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
        host = torch.empty(big.numel(), dtype=torch.uint8, pin_memory=True)
        back = torch.empty_like(big)
        out, into = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(out):
            host.copy_(big, non_blocking=True)
        with torch.cuda.stream(into):
            back.copy_(host, non_blocking=True)
    pending = [graphs.launch_rank(s, p, k) for s, p, k, _ in batches]
    assert all(x is not None for x in pending)
    for (_, _, _, eager), got in reversed(list(zip(batches, pending, strict=True))):
        assert max_rel(eager, got.wait()) < tol
