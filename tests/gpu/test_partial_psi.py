"""Partial psi on the GPU (Triton attention): psi built in chunks and a ranking call that reads
the first c prefix tokens from psi and computes the rest give the scores of full inference, for
split points 0, the profile boundary, fingerprint chunk boundaries and the full length; within
float32 accumulation error in float32 and bf16 rounding in bfloat16 (the CPU test,
tests/unit/test_partial_psi.py, holds the exact 1e-5 bound in float32)."""

from __future__ import annotations

import pytest
import torch

from relaygr.synthetic import Shape, batch
from services.ranker.model import HSTURanker, PrefixChunk
from shared.modelspec import preset

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

SPEC = preset("tiny").with_overrides(name="partial", num_layers=3, num_heads=2, head_dim=32)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request) -> HSTURanker:
    return HSTURanker.from_seed(SPEC.with_overrides(dtype=request.param), seed=5, device="cuda")


def tolerance(model: HSTURanker) -> float:
    """Relative to the largest score: float32 accumulation order, or bf16 rounding of K/V and
    activations (the same bound tests/gpu/test_rank_graphs.py holds the graph replays to)."""
    return 2e-3 if model.spec.dtype == "float32" else 2e-2


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(float(want.abs().max()), 1e-3)
    return float((got.float().cpu() - want.float().cpu()).abs().max()) / scale


def test_any_split_point_equals_full_inference(model):
    prefixes, suffixes = batch(21, [Shape(5, 1500, 16, 64)])
    prefix, suffix = prefixes[0], suffixes[0]
    want = model.full([prefix], [suffix])[0]
    for c in (0, 1, 5, 256, 512, 1024, 1280, 1504, 1505):
        psi = model.new_psi(prefix)
        if c:
            model.preinfer_chunks([PrefixChunk(prefix, psi, 0, c)])
        got = model.rank_partial([prefix], [suffix], [psi], [c])[0]
        assert max_rel(got, want) <= tolerance(model), f"split {c}"
        # The call completed psi: ranking against it gives the same scores again.
        again = model.rank_cached([suffix], [psi], [psi.key])[0]
        assert max_rel(again, want) <= tolerance(model), f"psi completed from split {c}"


def test_chunks_of_several_users_and_a_mixed_partial_batch(model):
    prefixes, suffixes = batch(22, [Shape(2, 300, 12, 8), Shape(0, 700, 4, 16), Shape(3, 900, 8, 32)])
    want = model.full(prefixes, suffixes)
    psis = [model.new_psi(p) for p in prefixes]
    model.preinfer_chunks([PrefixChunk(p, psi, 0, 256) for p, psi in zip(prefixes, psis, strict=True)])
    model.preinfer_chunks([PrefixChunk(prefixes[2], psis[2], 256, 768)])
    # None built first (the kernels' prefix base is then an empty block), one chunk, two chunks.
    built = [0, 256, 768]
    got = model.rank_partial(prefixes, suffixes, psis, built)
    for g, w in zip(got, want, strict=True):
        assert max_rel(g, w) <= tolerance(model)
    whole = model.preinfer(prefixes)
    for psi, w in zip(psis, whole, strict=True):
        assert max_rel(psi.kv, w.kv) <= tolerance(model)
