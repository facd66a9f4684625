"""Device views of page-locked host memory on CUDA (kernels/host_view.py): a kernel moves a
batch's bytes in and out through them, exactly, inside a CUDA graph too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.host_view import HostStaging, copy_by_kernel, device_view
from relaygr.synthetic import Shape, batch
from services.ranker.model import HSTURanker
from shared.modelspec import preset

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.float16, torch.uint8])
def test_a_kernel_reads_and_writes_page_locked_host_memory_through_its_view(dtype):
    device = torch.device("cuda")
    host_in = (torch.arange(4096) % 251).to(dtype).pin_memory()
    if dtype.is_floating_point:
        host_in[:4] = torch.tensor([-0.0, float("inf"), float("nan"), 1e-40]).to(dtype)
    host_out = torch.zeros_like(host_in).pin_memory()
    view_in, view_out = device_view(host_in, device), device_view(host_out, device)
    assert view_in is not None
    assert view_out is not None
    assert view_in.device.type == "cuda"
    assert view_in.data_ptr() == host_in.data_ptr()
    on_device = torch.empty(host_in.shape, dtype=dtype, device=device)
    copy_by_kernel(on_device, view_in)
    copy_by_kernel(view_out, on_device)
    torch.cuda.synchronize()
    assert torch.equal(host_out.view(torch.uint8), host_in.view(torch.uint8))


def test_views_work_inside_a_captured_graph_and_read_the_host_bytes_at_each_replay():
    device = torch.device("cuda")
    host_in = torch.zeros(1024, dtype=torch.int64).pin_memory()
    host_out = torch.zeros(1024, dtype=torch.int64).pin_memory()
    view_in, view_out = device_view(host_in, device), device_view(host_out, device)
    assert view_in is not None
    assert view_out is not None
    staged = torch.empty(1024, dtype=torch.int64, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
        copy_by_kernel(staged, view_in)
        copy_by_kernel(view_out, staged + 1)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_by_kernel(staged, view_in)
        copy_by_kernel(view_out, staged + 1)
    for round_ in range(3):
        host_in.copy_(torch.arange(1024) * (round_ + 2))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(host_out, torch.arange(1024) * (round_ + 2) + 1)


def test_no_view_of_pageable_memory():
    assert device_view(torch.zeros(16, dtype=torch.int64), torch.device("cuda")) is None


def test_host_staging_moves_each_copy_exactly_beside_a_psi_sized_copy_to_the_device():
    """Slots in turn, grown to the longest copy, while a 256 MiB copy from page-locked memory holds
    the host -> device engine; every copy lands exactly, in its stream order."""
    device = torch.device("cuda")
    staging = HostStaging(device, slots=2)
    assert staging.available
    big_host = torch.ones(256 << 20, dtype=torch.uint8).pin_memory()
    big = torch.empty(big_host.numel(), dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        big.copy_(big_host, non_blocking=True)
    outs = []
    for round_, n in enumerate([16384, 100, 40000, 16384, 7, 16384]):
        out = torch.empty(n, dtype=torch.int64, device=device)
        staging.copy(out, lambda host, r=round_: host.__setitem__(slice(None), np.arange(host.size) + r))
        outs.append(out)
    torch.cuda.synchronize()
    for round_, out in enumerate(outs):
        assert torch.equal(out.cpu(), torch.arange(out.numel()) + round_)


def test_a_new_psis_timestamps_are_the_same_through_the_staging():
    """model.new_psi with an engine's staging (batch_copies "kernel") writes the same timestamps
    as the copy from page-locked memory, for every prefix of a batch (profile tokens first)."""
    model = HSTURanker.from_seed(preset("tiny"), seed=3, device="cuda")
    prefixes, _ = batch(7, [Shape(3, 500, 8, 30), Shape(0, 2000, 1, 5), Shape(4, 1, 2, 2)])
    plain = [model.new_psi(p).timestamps.clone() for p in prefixes]
    model.host_staging = HostStaging(model.device)
    try:
        staged = [model.new_psi(p).timestamps for p in prefixes]
    finally:
        model.host_staging = None
    torch.cuda.synchronize()
    for a, b in zip(plain, staged, strict=True):
        assert torch.equal(a, b)
