"""psi to host memory and back on the CPU (services/ranker/transfer.py), whole and in pieces: the
bytes that come back are the bytes that went, whatever the piece size."""

from __future__ import annotations

import pytest
import torch

from services.ranker.psi import Psi, PsiKey
from services.ranker.transfer import copy_in_pieces, host_meta, host_nbytes, issue_from_host, issue_to_host

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
