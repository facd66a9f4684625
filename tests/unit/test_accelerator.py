"""The accelerator abstraction's CPU behaviour (the CUDA side: tests/gpu/test_allocator_stats.py)."""

from __future__ import annotations

from kernels.device import Accelerator, accelerator


def test_the_cpu_has_no_caching_allocator_to_report():
    assert Accelerator("cpu").allocator_stats() == {}
    assert accelerator("cpu").allocator_stats() == {}
