"""Device views of page-locked host memory on CUDA (kernels/host_view.py): a kernel moves a
batch's bytes in and out through them, exactly, inside a CUDA graph too."""

from __future__ import annotations

import pytest
import torch

from kernels.host_view import copy_by_kernel, device_view

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
