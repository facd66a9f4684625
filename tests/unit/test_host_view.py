"""kernels/host_view.py off CUDA: no view (the caller copies), and copy_by_kernel is bit-exact."""

from __future__ import annotations

import pytest
import torch

from kernels.host_view import copy_by_kernel, device_view


def test_no_device_view_off_cuda():
    host = torch.zeros(8, dtype=torch.int64)
    assert device_view(host, torch.device("cpu")) is None


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.float32, torch.float16, torch.bfloat16, torch.uint8]
)
def test_copy_by_kernel_is_bit_exact(dtype):
    src = (torch.arange(300) % 200).to(dtype)
    if dtype.is_floating_point:
        src[:3] = torch.tensor([-0.0, float("-inf"), float("nan")], dtype=dtype)
        src.view(torch.uint8)[-1] ^= 1  # an odd bit pattern: no arithmetic may touch it
    dst = torch.empty_like(src)
    copy_by_kernel(dst, src)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


def test_copy_by_kernel_refuses_mismatched_tensors():
    with pytest.raises(ValueError, match="copy of"):
        copy_by_kernel(torch.empty(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="copy of"):
        copy_by_kernel(torch.empty(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="no bitwise copy"):
        copy_by_kernel(torch.empty(4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool))
