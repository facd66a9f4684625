"""psi blocks in size classes on CUDA (services/ranker/psi.py, PsiSizeClasses; run on the device
machine): a full-ranking graph writes kept psi into class-sized blocks, and calls against them
replay the cached graphs with the scores of full inference; a class's freed block is the next
psi of its class's block (the caching allocator reuses it: no new segment)."""

from __future__ import annotations

import pytest
import torch

from relaygr.synthetic import Shape, batch
from services.ranker.model import HSTURanker
from services.ranker.psi import PsiSizeClasses
from shared.modelspec import preset

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from services.ranker.graphs import GraphLimits, RankGraphs  # noqa: E402

SPEC = preset("tiny").with_overrides(name="classes", num_layers=3, num_heads=2, head_dim=32, dtype="bfloat16")


def max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    scale = max(float(torch.cat(a).abs().max()), 1e-3)
    return max(float((x.cpu() - y.cpu()).abs().max()) for x, y in zip(a, b, strict=True)) / scale


def captured(graphs: RankGraphs, run):
    got = run()
    if got is None:
        graphs.capture_pending(limit=10)
        got = run()
    assert got is not None
    return got


def test_kept_psi_in_class_blocks_ranks_through_graphs_as_full_inference():
    model = HSTURanker.from_seed(SPEC, seed=3, device="cuda")
    model.psi_classes = PsiSizeClasses(1.125)
    graphs = RankGraphs(
        model,
        GraphLimits(
            max_batch=2, max_tokens=1024, max_prefix_tokens=4096, max_full_tokens=8192, max_full_batch=2
        ),
        full_keeps_kv=True,
    )
    prefixes, suffixes = batch(700, [Shape(4, 1500, 20, 40), Shape(2, 3000, 10, 30)])
    psis = [model.new_psi(p) for p in prefixes]
    for psi in psis:
        assert psi.block is not None
        assert psi.block.untyped_storage().nbytes() == model.psi_classes.footprint(psi.nbytes)
    full = captured(graphs, lambda: graphs.full(prefixes, suffixes, psis))
    torch.cuda.synchronize()
    want = model.full(prefixes, suffixes)
    assert max_rel(want, full) <= 2e-2
    cached = captured(graphs, lambda: graphs.rank(suffixes, psis, [p.key for p in psis]))
    assert max_rel(want, cached) <= 2e-2


def test_a_freed_class_block_is_the_next_psi_of_its_class():
    model = HSTURanker.from_seed(SPEC, seed=3, device="cuda")
    model.psi_classes = PsiSizeClasses(1.125)
    prefixes, _ = batch(
        701, [Shape(4, 32000, 1, 1), Shape(4, 30000, 1, 1)]
    )  # one class (24 MiB), two lengths
    first = model.new_psi(prefixes[0])
    assert model.psi_classes.footprint(first.nbytes) == model.psi_classes.footprint(
        model.spec.psi_bytes(prefixes[1].length)
    )
    address = first.kv.data_ptr()
    del first
    torch.cuda.synchronize()
    second = model.new_psi(prefixes[1])
    assert second.kv.data_ptr() == address
