"""psi to host memory and back on CUDA (services/ranker/transfer.py): a reloaded block comes from
the compute stream's memory pool, where full rankings' and pre-inferences' psi blocks live, so a
freed reload is reused by the next psi allocated for compute."""

from __future__ import annotations

import pytest
import torch

from kernels.psi_fp8 import dequantize_kv, quantize_kv
from services.ranker.psi import Psi, PsiKey
from services.ranker.transfer import host_meta, host_nbytes, issue_from_host, issue_to_host

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("piece_bytes", [0, 1 << 20])
def test_a_reloaded_psi_is_exact_and_its_block_is_reused_by_compute_allocations(piece_bytes):
    device = torch.device("cuda")
    compute, copy = torch.cuda.Stream(device), torch.cuda.Stream(device)
    key = PsiKey(user_id=1, prefix_version=2, model_version="m", fingerprint=3)
    kv = torch.randn(4, 2, 1000, 256, device=device).to(torch.bfloat16)
    psi = Psi(key, kv, torch.arange(1000, device=device))
    meta = host_meta(psi)
    host = torch.empty(host_nbytes(meta), dtype=torch.uint8).pin_memory()
    issue_to_host(psi, host, piece_bytes)
    torch.cuda.synchronize()
    copy.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(copy):
        back = issue_from_host(host, meta, key, device, alloc_stream=compute, piece_bytes=piece_bytes)
    copy.synchronize()
    assert torch.equal(back.kv, psi.kv)
    assert torch.equal(back.timestamps, psi.timestamps)
    address = back.kv.data_ptr()
    del back
    torch.cuda.synchronize()
    with torch.cuda.stream(compute):  # the next psi block allocated for compute takes the freed one
        again = torch.empty(4, 2, 1000, 256, dtype=torch.bfloat16, device=device)
    assert again.data_ptr() == address


def test_fp8_psi_goes_out_and_back_on_the_copy_stream_as_the_cpu_quantizes_it():
    """fp8 host format on CUDA: quantized on the copy stream, half the bytes in pinned memory,
    dequantized there into a compute-pool block: the K/V the CPU's quantize/dequantize gives."""
    device = torch.device("cuda")
    compute, copy = torch.cuda.Stream(device), torch.cuda.Stream(device)
    key = PsiKey(user_id=1, prefix_version=2, model_version="m", fingerprint=3)
    kv = (torch.randn(4, 2, 1000, 1024, device=device) * 3).to(torch.bfloat16)
    psi = Psi(key, kv, torch.arange(1000, device=device))
    meta = host_meta(psi, "fp8", heads=4)
    assert host_nbytes(meta) < 0.51 * host_nbytes(host_meta(psi))
    host = torch.empty(host_nbytes(meta), dtype=torch.uint8).pin_memory()
    copy.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(copy):
        issue_to_host(psi, host, 0, meta)
        back = issue_from_host(host, meta, key, device, alloc_stream=compute)
    copy.synchronize()
    want = dequantize_kv(quantize_kv(kv.cpu(), 4, 16))
    assert torch.equal(back.kv.cpu(), want)
    assert torch.equal(back.timestamps, psi.timestamps)
