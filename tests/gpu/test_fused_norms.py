"""The layer's norms fused with what is around them (kernels/fused_norms.py), on CUDA: against
float32 and against torch's kernels; the model with them: cached == full, fused == torch's, and
replayed graphs == eager (run on the device machine)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_norms import add_norm, add_norm_reference, norm_gate, norm_gate_reference
from relaygr.synthetic import Shape, batch
from services.ranker.model import HSTURanker
from shared.modelspec import preset

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kernels.fused_norms import add_norm_triton, norm_gate_triton  # noqa: E402
from services.ranker.graphs import GraphLimits, RankGraphs  # noqa: E402


def ln(t, w, b, eps=1e-6):
    return torch.nn.functional.layer_norm(t.float(), (t.shape[1],), w.float(), b.float(), eps)


def case(rows, d, dtype):
    gen = torch.Generator().manual_seed(rows * 7 + d)
    x = (torch.randn(rows, d, generator=gen) * 3 + 1).to("cuda", dtype)
    u = torch.randn(rows, 4 * d, generator=gen).to("cuda", dtype)[:, d : 2 * d]  # a column slice
    w = (1 + 0.05 * torch.randn(d, generator=gen)).to("cuda", dtype)
    b = (0.02 * torch.randn(d, generator=gen)).to("cuda", dtype)
    return x, u, w, b


SHAPES = [(0, 1024, torch.bfloat16), (1, 1024, torch.bfloat16), (300, 1024, torch.bfloat16),
          (2561, 1024, torch.bfloat16), (7, 32, torch.float32), (5, 48, torch.bfloat16)]  # fmt: skip


@pytest.mark.parametrize(("rows", "d", "dtype"), SHAPES)
def test_the_gate_rounds_once_where_torch_rounds_twice(rows, d, dtype):
    x, u, w, b = case(rows, d, dtype)
    got = norm_gate_triton(x, u, w, b, 1e-6)
    assert got.shape == (rows, d)
    assert got.dtype == dtype
    if not rows:
        return
    want = ln(x, w, b) * u.float()
    torch_err = float((norm_gate_reference(x, u, w, b, 1e-6).float() - want).abs().max())
    fused_err = float((got.float() - want).abs().max())
    assert fused_err <= max(torch_err, 1e-5 * float(want.abs().max())), (fused_err, torch_err)


@pytest.mark.parametrize(("rows", "d", "dtype"), SHAPES)
def test_the_sum_is_torchs_and_its_norm_within_torchs_rounding(rows, d, dtype):
    x, y, w, b = case(rows, d, dtype)
    total, normed = add_norm_triton(x, y, w, b, 1e-6)
    assert total.shape == normed.shape == (rows, d)
    if not rows:
        return
    want_total, want_normed = add_norm_reference(x, y, w, b, 1e-6)
    assert torch.equal(total, want_total)  # one rounding to nearest of the float32 sum, both
    exact = ln(total, w, b)
    torch_err = float((want_normed.float() - exact).abs().max())
    fused_err = float((normed.float() - exact).abs().max())
    assert fused_err <= max(torch_err, 1e-5 * float(exact.abs().max())), (fused_err, torch_err)


def test_the_choice_is_the_kernels_on_cuda_and_torch_elsewhere():
    x, u, w, b = case(5, 64, torch.float32)
    assert torch.allclose(norm_gate(x, u, w, b, 1e-6, fused=True), norm_gate_triton(x, u, w, b, 1e-6))
    assert all(torch.allclose(a, c) for a, c in zip(add_norm(x, u, w, b, 1e-6, fused=True),
                                                    add_norm_triton(x, u, w, b, 1e-6), strict=True))  # fmt: skip
    on_cpu = norm_gate(x.cpu(), u.cpu(), w.cpu(), b.cpu(), 1e-6, fused=True)
    assert torch.equal(on_cpu, norm_gate_reference(x.cpu(), u.cpu(), w.cpu(), b.cpu(), 1e-6))


def assert_bf16_close(got, want):
    scale = float(want.float().abs().max()) + 1e-6
    err = float((got.float() - want.float()).abs().max())
    assert err <= 2e-2 * scale, f"max error {err:.3e} vs output scale {scale:.3e}"


def test_the_model_with_fused_norms_ranks_as_with_torchs():
    spec = preset("bench").with_overrides(name="bench-small", num_layers=3, num_items=1000)
    model = HSTURanker.from_seed(spec, seed=0, device="cuda")
    prefixes, suffixes = batch(1, [Shape(16, 2000, 64, 256), Shape(0, 0, 3, 1), Shape(4, 500, 0, 20)])
    plain = model.full(prefixes, suffixes)
    model.fuse_norms(True)
    assert model.fused_norms
    full = model.full(prefixes, suffixes)
    psis = model.preinfer(prefixes)
    keys = [p.key for p in psis]
    cached = model.rank_cached(suffixes, psis, keys)
    for f, c, p in zip(full, cached, plain, strict=True):
        assert_bf16_close(c, f)  # cached == full, both fused
        assert_bf16_close(f, p)  # fused == torch's
    # Graphs captured with the fused kernels score as the eager pass does.
    graphs = RankGraphs(model, GraphLimits(max_batch=4, max_tokens=1024, max_prefix_tokens=2048))
    if graphs.rank(suffixes, psis, keys) is None:  # remembered: captured now
        graphs.capture_pending(limit=10)
    graphed = graphs.rank(suffixes, psis, keys)
    assert graphed is not None
    for g, c in zip(graphed, cached, strict=True):
        assert_bf16_close(g.to(c.device), c)
