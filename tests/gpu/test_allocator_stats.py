"""The caching allocator's counters the ranker exports (kernels/device.py allocator_stats)."""

from __future__ import annotations

import pytest
import torch

from kernels.device import Accelerator

pytestmark = pytest.mark.gpu


def test_allocator_stats_follow_allocations():
    accel = Accelerator("cuda", 0)
    before = accel.allocator_stats()
    assert set(before) == {
        "reserved_bytes",
        "allocated_bytes",
        "alloc_retries",
        "device_allocs",
        "device_frees",
    }
    block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    during = accel.allocator_stats()
    assert during["allocated_bytes"] >= before["allocated_bytes"] + block.numel()
    assert during["reserved_bytes"] >= during["allocated_bytes"]
    assert during["alloc_retries"] >= before["alloc_retries"] >= 0
    del block
    torch.cuda.empty_cache()  # the cached block goes back to the device: one cudaFree at least
    after = accel.allocator_stats()
    assert after["device_frees"] > before["device_frees"]
    assert after["device_allocs"] >= during["device_allocs"] >= before["device_allocs"]
