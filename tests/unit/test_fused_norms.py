"""The layer's norms fused with what is around them (kernels/fused_norms.py), on the CPU: the
fused choice falls back to torch off CUDA and the model's scores do not move; bad shapes are
refused before a kernel runs; and, where Triton is installed, the kernels themselves under
Triton's interpreter (the GPU tests run them compiled)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kernels.fused_norms import (
    add_norm,
    add_norm_reference,
    add_norm_triton,
    norm_gate,
    norm_gate_reference,
    norm_gate_triton,
)
from relaygr.synthetic import Shape, batch
from services.ranker.config import LayerKernels, RankerConfig
from services.ranker.model import HSTURanker, PrefixChunk
from shared.config import ConfigError, load_config
from shared.modelspec import preset


def test_the_fused_choice_off_cuda_is_torchs():
    gen = torch.Generator().manual_seed(0)
    attn, uvqk = torch.randn(7, 32, generator=gen), torch.randn(7, 128, generator=gen)
    weight, bias = torch.randn(32, generator=gen), torch.randn(32, generator=gen)
    u = uvqk[:, 32:64]
    gate = norm_gate(attn, u, weight, bias, 1e-6, fused=True)
    assert torch.equal(gate, norm_gate_reference(attn, u, weight, bias, 1e-6))
    total, normed = add_norm(attn, u, weight, bias, 1e-6, fused=True)
    want_total, want_normed = add_norm_reference(attn, u, weight, bias, 1e-6)
    assert torch.equal(total, want_total)
    assert torch.equal(normed, want_normed)
    assert torch.equal(total, attn + u)


def test_the_model_scores_alike_with_the_norms_computed_where_finish_is_and_fused_asked_for():
    """finish now computes the next layer's input norm (project takes it): on the CPU the same
    kernels in another place, so every path's scores are the same bits, fused asked for or not."""
    model = HSTURanker.from_seed(preset("tiny"), seed=0)
    prefixes, suffixes = batch(3, [Shape(2, 40, 5, 6), Shape(0, 3, 1, 2)])
    keys = [model.psi_key(p.user_id, 1, p.fingerprint.digest) for p in prefixes]
    # A model's norm at each layer's start, as before the change: norm_in(x) in project.
    reference = HSTURanker.from_seed(preset("tiny"), seed=0)
    for layer in reference._stack():
        layer.finish = lambda x, attn, u, next_norm=None, layer=layer: (  # type: ignore[method-assign]
            x + layer.out(layer.norm_attn(attn) * u),
            None,
        )
    want_full = reference.full(prefixes, suffixes)
    want_psis = reference.preinfer(prefixes)
    for fused in (False, True):
        model.fuse_norms(fused)
        assert model.fused_norms is fused
        for got, want in zip(model.full(prefixes, suffixes), want_full, strict=True):
            assert torch.equal(got, want)
        psis = model.preinfer(prefixes)
        for got, want in zip(psis, want_psis, strict=True):
            assert torch.equal(got.kv, want.kv)
        cached = model.rank_cached(suffixes, psis, keys)
        for got, want in zip(cached, want_full, strict=True):
            assert float((got - want).abs().max()) <= 1e-5
        # Chunks: the first half of a prefix, then the rest against the psi built so far.
        prefix = prefixes[0]
        built = model.new_psi(prefix)
        half = prefix.length // 2
        model.preinfer_chunks([PrefixChunk(prefix, built, 0, half)])
        model.preinfer_chunks([PrefixChunk(prefix, built, half, prefix.length)])
        assert torch.equal(built.kv, want_psis[0].kv)


@pytest.mark.parametrize("kernel", [norm_gate_triton, add_norm_triton])
@pytest.mark.parametrize(
    ("first", "second", "d", "match"),
    [
        (torch.zeros(4, 8), torch.zeros(4, 9), 8, "one shape"),
        (torch.zeros(4, 8), torch.zeros(4, 8), 9, r"weight and bias are \[8\]"),
        (torch.zeros(4, 8), torch.zeros(8, 4).t(), 8, "unit stride"),
        (torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float64), 8, "second tensor is torch.float64"),
        (torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), 8, "one shape"),
    ],
)
def test_shapes_the_kernels_cannot_read_are_refused_before_they_run(kernel, first, second, d, match):
    with pytest.raises(ValueError, match=match):
        kernel(first, second, torch.ones(d), torch.zeros(d), 1e-6)


def test_the_ranker_takes_torch_or_fused_and_refuses_anything_else():
    assert load_config(RankerConfig, [], env={}).layer_kernels is LayerKernels.FUSED
    assert load_config(RankerConfig, ["--layer-kernels", "torch"], env={}).layer_kernels is LayerKernels.TORCH
    env = {"RELAYGR_RANKER_LAYER_KERNELS": "torch"}
    assert load_config(RankerConfig, [], env=env).layer_kernels is LayerKernels.TORCH
    with pytest.raises(ConfigError, match="one of torch, fused"):
        load_config(RankerConfig, [], env={"RELAYGR_RANKER_LAYER_KERNELS": "triton"})


# The interpreter casts float32 to bfloat16 by truncation where CUDA rounds to nearest: within one
# step of bfloat16 of torch's result, not equal to it.
_INTERPRETED = textwrap.dedent(
    """
    import torch
    from kernels.fused_norms import add_norm_reference, add_norm_triton, norm_gate_reference, norm_gate_triton

    def ln(t, w, b):
        return torch.nn.functional.layer_norm(t.float(), (t.shape[1],), w.float(), b.float(), 1e-6)

    for rows, d, dtype in ((0, 32, torch.float32), (1, 32, torch.float32), (9, 48, torch.float32),
                           (37, 256, torch.bfloat16)):
        gen = torch.Generator().manual_seed(rows + d)
        x = (torch.randn(rows, d, generator=gen) * 3 + 1).to(dtype)
        uvqk = torch.randn(rows, 4 * d, generator=gen).to(dtype)
        u = uvqk[:, :d]
        w = (1 + 0.05 * torch.randn(d, generator=gen)).to(dtype)
        b = (0.02 * torch.randn(d, generator=gen)).to(dtype)
        gate = norm_gate_triton(x, u, w, b, 1e-6)
        total, normed = add_norm_triton(x, u, w, b, 1e-6)
        assert gate.shape == total.shape == normed.shape == (rows, d)
        assert gate.dtype == total.dtype == normed.dtype == dtype
        if not rows:
            continue
        step = 2.0**-7 if dtype == torch.bfloat16 else 1e-6  # relative
        want = ln(x, w, b) * u.float()
        assert float((gate.float() - want).abs().max()) <= 2 * step * float(want.abs().max()), "gate"
        want_total = x.float() + u.float()
        assert float((total.float() - want_total).abs().max()) <= step * float(want_total.abs().max()), "sum"
        want_normed = ln(total, w, b)  # the norm of the sum as rounded
        assert float((normed.float() - want_normed).abs().max()) <= 2 * step * float(want_normed.abs().max()), "norm"
    print("ok")
    """
)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed (CI's CPU image)"
)
def test_the_kernels_under_tritons_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read at triton's import: a process of its own
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
