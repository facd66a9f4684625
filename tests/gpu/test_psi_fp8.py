"""psi's K/V in float8 on CUDA (kernels/psi_fp8.py): the same bytes and scales as on the CPU,
so psi quantized on either side of the host tier reads back the same."""

from __future__ import annotations

import pytest
import torch

from kernels.psi_fp8 import dequantize_kv, quantize_kv

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("group", [1, 16, 5])
def test_quantized_psi_on_the_gpu_is_the_cpus_bit_for_bit(group):
    gen = torch.Generator().manual_seed(3)
    kv = (torch.randn(8, 2, 1000, 1024, generator=gen) * torch.logspace(-3, 3, 1024)).to(torch.bfloat16)
    on_cpu = quantize_kv(kv, 4, group)
    on_gpu = quantize_kv(kv.cuda(), 4, group)
    assert torch.equal(on_gpu.values.cpu().view(torch.uint8), on_cpu.values.view(torch.uint8))
    assert torch.equal(on_gpu.scales.cpu(), on_cpu.scales)
    assert torch.equal(dequantize_kv(on_gpu).cpu(), dequantize_kv(on_cpu))
