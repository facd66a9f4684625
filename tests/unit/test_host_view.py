"""kernels/host_view.py off CUDA: no view (the caller copies), copy_by_kernel is bit-exact, and
HostStaging copies through its slots the ordinary way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.host_view import HostStaging, copy_by_kernel, device_view


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


def test_host_staging_off_cuda_copies_the_ordinary_way_through_slots_used_in_turn():
    staging = HostStaging(torch.device("cpu"), slots=2)
    assert not staging.available
    for n in (5, 300, 7, 1000, 3):  # slots grow to the longest copy asked for
        out = torch.full((n,), -1, dtype=torch.int64)

        def fill(host, n=n):
            assert host.shape == (n,)
            host[:] = np.arange(n) * 3

        staging.copy(out, fill)
        assert torch.equal(out, torch.arange(n) * 3)
    staging.copy(torch.empty(0, dtype=torch.int64), lambda host: pytest.fail("nothing to fill"))


def test_host_staging_refuses_what_it_cannot_stage():
    with pytest.raises(ValueError, match="slots"):
        HostStaging(torch.device("cpu"), slots=0)
    with pytest.raises(ValueError, match="no device view"):
        HostStaging(torch.device("cpu"), dtype=torch.bool)
    staging = HostStaging(torch.device("cpu"))
    with pytest.raises(ValueError, match="staging of"):
        staging.copy(torch.empty(3, dtype=torch.int32), lambda host: None)
    with pytest.raises(ValueError, match="staging of"):
        staging.copy(torch.empty(6, dtype=torch.int64)[::2], lambda host: None)
