"""The layer's gate, LayerNorm(attn) * u (kernels/norm_gate.py), on the CPU: the fused choice
falls back to torch off CUDA with the same scores; bad shapes are refused; and, where Triton is
installed, the kernel itself under Triton's interpreter (the GPU tests run it compiled)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kernels.norm_gate import norm_gate, norm_gate_reference, norm_gate_triton
from relaygr.synthetic import Shape, batch
from services.ranker.config import LayerKernels, RankerConfig
from services.ranker.model import HSTURanker
from shared.config import ConfigError, load_config
from shared.modelspec import preset


def test_the_fused_choice_off_cuda_is_torchs_gate_and_the_models_scores_do_not_move():
    gen = torch.Generator().manual_seed(0)
    attn, uvqk = torch.randn(7, 32, generator=gen), torch.randn(7, 128, generator=gen)
    weight, bias = torch.randn(32, generator=gen), torch.randn(32, generator=gen)
    u = uvqk[:, 32:64]
    assert torch.equal(
        norm_gate(attn, u, weight, bias, 1e-6, fused=True), norm_gate_reference(attn, u, weight, bias, 1e-6)
    )
    model = HSTURanker.from_seed(preset("tiny"), seed=0)
    prefixes, suffixes = batch(3, [Shape(2, 40, 5, 6), Shape(0, 3, 1, 2)])
    before = model.full(prefixes, suffixes)
    assert not model.fused_norm_gate
    model.fuse_norm_gate(True)
    assert model.fused_norm_gate
    for b, a in zip(before, model.full(prefixes, suffixes), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("attn", "u", "d", "match"),
    [
        (torch.zeros(4, 8), torch.zeros(4, 9), 8, "one shape"),
        (torch.zeros(4, 8), torch.zeros(4, 8), 9, r"weight and bias are \[8\]"),
        (torch.zeros(4, 8), torch.zeros(8, 4).t(), 8, "unit stride"),
        (torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float64), 8, "u is torch.float64"),
        (torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), 8, "one shape"),
    ],
)
def test_shapes_the_kernel_cannot_read_are_refused_before_it_runs(attn, u, d, match):
    with pytest.raises(ValueError, match=match):
        norm_gate_triton(attn, u, torch.ones(d), torch.zeros(d), 1e-6)


def test_the_ranker_takes_torch_or_fused_and_refuses_anything_else():
    assert load_config(RankerConfig, [], env={}).layer_kernels is LayerKernels.TORCH
    assert load_config(RankerConfig, ["--layer-kernels", "fused"], env={}).layer_kernels is LayerKernels.FUSED
    with pytest.raises(ConfigError, match="one of torch, fused"):
        load_config(RankerConfig, [], env={"RELAYGR_RANKER_LAYER_KERNELS": "triton"})


_INTERPRETED = textwrap.dedent(
    """
    import torch
    from kernels.norm_gate import norm_gate_triton, norm_gate_reference
    for rows, d, dtype in ((0, 32, torch.float32), (1, 32, torch.float32), (9, 48, torch.float32),
                           (37, 256, torch.bfloat16)):
        gen = torch.Generator().manual_seed(rows + d)
        attn = (torch.randn(rows, d, generator=gen) * 3 + 1).to(dtype)
        u = torch.randn(rows, 4 * d, generator=gen).to(dtype)[:, :d]
        w, b = (1 + 0.05 * torch.randn(d, generator=gen)).to(dtype), (0.02 * torch.randn(d, generator=gen)).to(dtype)
        got = norm_gate_triton(attn, u, w, b, 1e-6)
        assert got.shape == (rows, d) and got.dtype == dtype
        if rows:
            want = torch.nn.functional.layer_norm(attn.float(), (d,), w.float(), b.float(), 1e-6) * u.float()
            err = float((got.float() - want).abs().max())
            torch_err = float((norm_gate_reference(attn, u, w, b, 1e-6).float() - want).abs().max())
            assert err <= max(torch_err, 1e-5 * float(want.abs().max())), (rows, d, err, torch_err)
    print("ok")
    """
)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed (CI's CPU image)"
)
def test_the_kernel_under_tritons_interpreter_rounds_once():
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read at triton's import: a process of its own
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
