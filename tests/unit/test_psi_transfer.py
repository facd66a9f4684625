"""psi to host memory and back on the CPU (services/ranker/transfer.py), whole and in pieces: the
bytes that come back are the bytes that went, whatever the piece size."""

from __future__ import annotations

import pytest
import torch

from kernels.device import accelerator
from kernels.psi_fp8 import dequantize_kv, quantize_kv
from services.ranker import transfer
from services.ranker.host_tier import HostTier
from services.ranker.psi import Psi, PsiKey, psi_memory
from services.ranker.transfer import (
    copy_in_pieces,
    host_meta,
    host_nbytes,
    issue_from_host,
    issue_to_host,
    stored_nbytes,
)
from shared.modelspec import preset

KEY = PsiKey(user_id=1, prefix_version=2, model_version="m", fingerprint=3)


@pytest.mark.parametrize("piece_bytes", [0, 1000, 4096, 1 << 30])
def test_psi_round_trips_through_host_memory_in_pieces(piece_bytes):
    kv = torch.randn(3, 2, 77, 32).to(torch.bfloat16)
    psi = Psi(KEY, kv, torch.arange(77, dtype=torch.int64) * 1000)
    meta = host_meta(psi)
    host = torch.zeros(host_nbytes(meta), dtype=torch.uint8)
    issue_to_host(psi, host, piece_bytes)
    back = issue_from_host(host, meta, KEY, torch.device("cpu"), piece_bytes=piece_bytes)
    assert torch.equal(back.kv, psi.kv)
    assert torch.equal(back.timestamps, psi.timestamps)


def test_pieces_cover_the_range_once_and_the_last_one_is_short():
    src = torch.arange(10_000, dtype=torch.int64).view(torch.uint8)  # 80_000 bytes
    dst = torch.zeros_like(src)
    assert copy_in_pieces(dst, src, 30_000) == 3  # 30_000 + 30_000 + 20_000
    assert torch.equal(dst, src)
    assert copy_in_pieces(torch.zeros_like(src), src, 0) == 1
    assert copy_in_pieces(torch.zeros_like(src), src, 80_000) == 1
    with pytest.raises(ValueError, match="copy of 80000 bytes into 79999"):
        copy_in_pieces(dst[:-1], src)


def test_psi_memory_is_one_block_in_the_host_layout():
    kv, ts, block = psi_memory(3, 77, 32, torch.bfloat16, "cpu")
    assert block is not None
    assert kv.shape == (3, 2, 77, 32)
    assert kv.is_contiguous()
    assert ts.shape == (77,)
    assert ts.dtype == torch.int64
    kv.copy_(torch.randn(3, 2, 77, 32).to(torch.bfloat16))
    ts.copy_(torch.arange(77) * 7)
    psi = Psi(KEY, kv, ts, block)
    assert block.numel() == psi.nbytes
    kv_bytes = kv.numel() * 2
    assert torch.equal(block[:kv_bytes], kv.reshape(-1).view(torch.uint8))  # the views share it
    assert torch.equal(block[kv_bytes:].view(torch.int64), ts)


def test_a_psi_block_round_trips_in_one_copy_each_way(monkeypatch):
    kv, ts, block = psi_memory(3, 77, 32, torch.bfloat16, "cpu")
    kv.copy_(torch.randn(3, 2, 77, 32).to(torch.bfloat16))
    ts.copy_(torch.arange(77) * 1000)
    psi = Psi(KEY, kv, ts, block)
    meta = host_meta(psi)
    host = torch.zeros(host_nbytes(meta), dtype=torch.uint8)
    copies: list[int] = []
    real = transfer.copy_in_pieces

    def counted(dst, src, piece_bytes=0):
        copies.append(src.numel())
        return real(dst, src, piece_bytes)

    monkeypatch.setattr(transfer, "copy_in_pieces", counted)
    issue_to_host(psi, host)
    back = issue_from_host(host, meta, KEY, torch.device("cpu"))
    assert copies == [psi.nbytes, psi.nbytes]  # one copy out, one back: no separate timestamps
    assert back.block is not None
    assert torch.equal(back.kv, psi.kv)
    assert torch.equal(back.timestamps, psi.timestamps)
    # The block from the host is the same bytes as a psi built apart would have left there.
    apart = Psi(KEY, psi.kv.clone(), psi.timestamps.clone())
    host_apart = torch.zeros_like(host)
    issue_to_host(apart, host_apart)
    assert torch.equal(host_apart, host)


def test_sizes_whose_timestamps_would_be_misaligned_get_memory_apart():
    kv, ts, block = psi_memory(1, 3, 3, torch.float16, "cpu")  # 36 bytes of K/V
    assert block is None
    assert kv.shape == (1, 2, 3, 3)
    assert ts.numel() == 3
    psi = Psi(KEY, kv.zero_(), ts.zero_())
    host = torch.zeros(host_nbytes(host_meta(psi)), dtype=torch.uint8)
    issue_to_host(psi, host)
    back = issue_from_host(host, host_meta(psi), KEY, torch.device("cpu"))
    assert back.block is None
    assert torch.equal(back.kv, psi.kv)


def test_a_block_that_is_not_the_psi_s_own_is_refused():
    kv, ts, block = psi_memory(2, 16, 8, torch.bfloat16, "cpu")
    assert block is not None
    with pytest.raises(ValueError, match="block"):
        Psi(KEY, kv, ts, torch.zeros_like(block))
    with pytest.raises(ValueError, match="block"):
        Psi(KEY, kv, ts, block[:-8])


@pytest.mark.parametrize("piece_bytes", [0, 1000])
@pytest.mark.parametrize("plen", [77, 64])  # a partial last group of 16 tokens, and none
def test_fp8_psi_comes_back_as_its_quantization_and_takes_half_the_bytes(piece_bytes, plen):
    kv, ts, block = psi_memory(3, plen, 32, torch.bfloat16, "cpu")
    kv.copy_(torch.randn(3, 2, plen, 32).to(torch.bfloat16) * 5)
    ts.copy_(torch.arange(plen) * 1000)
    psi = Psi(KEY, kv, ts, block)
    meta = host_meta(psi, "fp8", heads=4)
    assert host_nbytes(meta) == stored_nbytes(3, plen, 32, 2, "fp8", heads=4)
    assert host_nbytes(meta) < 0.55 * host_nbytes(host_meta(psi))  # half, and the scales
    assert host_nbytes(host_meta(psi)) == stored_nbytes(3, plen, 32, 2)
    host = torch.zeros(host_nbytes(meta), dtype=torch.uint8)
    issue_to_host(psi, host, piece_bytes, meta)
    back = issue_from_host(host, meta, KEY, torch.device("cpu"), piece_bytes=piece_bytes)
    assert back.kv.dtype == torch.bfloat16
    assert back.block is not None  # one block in HBM, as a computed psi's
    assert torch.equal(back.kv, dequantize_kv(quantize_kv(psi.kv, 4, 16)))
    assert torch.equal(back.timestamps, psi.timestamps)
    assert float((back.kv.float() - psi.kv.float()).abs().max()) <= 2.0**-4 * float(
        psi.kv.float().abs().max()
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"format": "int4"}, "format"),
        ({"heads": 5}, "sizes disagree"),
        ({"group_tokens": 8}, "sizes disagree"),
        ({"kv_bytes": 10}, "sizes disagree"),
        ({"heads": "x"}, "bad psi metadata"),
    ],
)
def test_fp8_metadata_that_does_not_describe_the_bytes_is_refused(change, match):
    psi = Psi(KEY, torch.zeros(2, 2, 20, 32), torch.zeros(20, dtype=torch.int64))
    meta = host_meta(psi, "fp8", heads=4)
    host = torch.zeros(host_nbytes(meta), dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        issue_from_host(host, {**meta, **change}, KEY, torch.device("cpu"))
    with pytest.raises(ValueError, match="host format"):
        host_meta(psi, "fp4")


def test_a_host_tier_stores_in_a_format_it_can_size_and_refuses_others():
    cpu, spec = accelerator("cpu"), preset("bench")
    assert HostTier("sock", cpu).stored_nbytes(4096) is None  # no spec: the caller's own estimate
    assert HostTier("sock", cpu, spec=spec).stored_nbytes(4096) == spec.psi_bytes(4096)
    fp8 = HostTier("sock", cpu, psi_format="fp8", spec=spec).stored_nbytes(4096)
    assert fp8 == 8 * 2 * 4096 * 1024 + 8 * 2 * 256 * 4 * 4 + 8 * 4096  # values, scales, timestamps
    with pytest.raises(ValueError, match="needs the model's spec"):
        HostTier("sock", cpu, psi_format="fp8")
    with pytest.raises(ValueError, match="psi_format must be one of native, fp8"):
        HostTier("sock", cpu, psi_format="bf8", spec=spec)
