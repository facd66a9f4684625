"""The fused gate, LayerNorm(attn) * u, on CUDA against float32 and against torch's two kernels;
the model with it: cached == full, and replayed graphs == eager (run on the device machine)."""

from __future__ import annotations

import pytest
import torch

from kernels.norm_gate import norm_gate, norm_gate_reference
from relaygr.synthetic import Shape, batch
from services.ranker.graphs import GraphLimits, RankGraphs
from services.ranker.model import HSTURanker
from shared.modelspec import preset

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from kernels.norm_gate import norm_gate_triton  # noqa: E402


def exact(attn, u, weight, bias, eps):
    d = attn.shape[1]
    return torch.nn.functional.layer_norm(attn.float(), (d,), weight.float(), bias.float(), eps) * u.float()


@pytest.mark.parametrize("rows", [0, 1, 3, 300, 2561])
@pytest.mark.parametrize(("d", "dtype"), [(1024, torch.bfloat16), (32, torch.float32), (48, torch.bfloat16)])
def test_the_fused_gate_rounds_once_where_torch_rounds_twice(rows, d, dtype):
    gen = torch.Generator().manual_seed(rows * 7 + d)
    attn = (torch.randn(rows, d, generator=gen) * 3 + 1).to("cuda", dtype)
    u = torch.randn(rows, 4 * d, generator=gen).to("cuda", dtype)[:, d : 2 * d]  # a column slice
    weight = (1 + 0.05 * torch.randn(d, generator=gen)).to("cuda", dtype)
    bias = (0.02 * torch.randn(d, generator=gen)).to("cuda", dtype)
    got = norm_gate_triton(attn, u, weight, bias, 1e-6)
    assert got.shape == (rows, d)
    assert got.dtype == dtype
    if not rows:
        return
    want = exact(attn, u, weight, bias, 1e-6)
    torch_err = float((norm_gate_reference(attn, u, weight, bias, 1e-6).float() - want).abs().max())
    fused_err = float((got.float() - want).abs().max())
    # One rounding of the gate: no worse than torch's two (float32: within its own rounding).
    assert fused_err <= max(torch_err, 1e-5 * float(want.abs().max())), (fused_err, torch_err)
    assert bool(torch.isfinite(got).all())


def test_the_choice_is_the_kernel_on_cuda_and_torch_elsewhere():
    attn, u = torch.randn(5, 64, device="cuda"), torch.randn(5, 64, device="cuda")
    weight, bias = torch.ones(64, device="cuda"), torch.zeros(64, device="cuda")
    fused = norm_gate(attn, u, weight, bias, 1e-6, fused=True)
    assert torch.allclose(fused, norm_gate_triton(attn, u, weight, bias, 1e-6))
    on_cpu = norm_gate(attn.cpu(), u.cpu(), weight.cpu(), bias.cpu(), 1e-6, fused=True)
    assert torch.equal(on_cpu, norm_gate_reference(attn.cpu(), u.cpu(), weight.cpu(), bias.cpu(), 1e-6))


def assert_bf16_close(got, want):
    scale = float(want.float().abs().max()) + 1e-6
    err = float((got.float() - want.float()).abs().max())
    assert err <= 2e-2 * scale, f"max error {err:.3e} vs output scale {scale:.3e}"


def test_the_model_with_the_fused_gate_ranks_as_with_torchs():
    spec = preset("bench").with_overrides(name="bench-small", num_layers=2, num_items=1000)
    model = HSTURanker.from_seed(spec, seed=0, device="cuda")
    prefixes, suffixes = batch(1, [Shape(16, 2000, 64, 256), Shape(0, 0, 3, 1), Shape(4, 500, 0, 20)])
    keys = [model.psi_key(p.user_id, 1, p.fingerprint.digest) for p in prefixes]
    plain = model.full(prefixes, suffixes)
    model.fuse_norm_gate(True)
    assert model.fused_norm_gate
    full = model.full(prefixes, suffixes)
    psis = model.preinfer(prefixes)
    cached = model.rank_cached(suffixes, psis, keys)
    for f, c, p in zip(full, cached, plain, strict=True):
        assert_bf16_close(c, f)  # cached == full, both fused
        assert_bf16_close(f, p)  # fused == torch's
    # Replayed graphs captured with the fused gate score as the eager pass does.
    graphs = RankGraphs(model, GraphLimits(max_batch=4, max_tokens=1024, max_prefix_tokens=2048))
    if graphs.rank(suffixes, psis, keys) is None:  # remembered: captured now
        graphs.capture_pending(limit=10)
    graphed = graphs.rank(suffixes, psis, keys)
    assert graphed is not None
    for g, c in zip(graphed, cached, strict=True):
        assert_bf16_close(g.to(c.device), c)
