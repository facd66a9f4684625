"""psi between accelerator memory and a host byte range (the expander's shared-memory arena).

Host layout of one psi: [kv bytes | int64 timestamps], described by `host_meta` (stored by the
expander beside the bytes and returned on reload); the layout of the ranker's own psi blocks in
accelerator memory too (Psi.block), so that each way is one copy. Copies are *issued* here; the engine runs them
on its copy stream and resolves the caller once they completed.

psi may be copied in pieces (`piece_bytes`, the ranker's copy_piece_mb; 0 by default: one copy).
A ranking batch copies its inputs in and its scores out on the ranking stream, over the same PCIe
link as psi's copies on the copy streams; where a copy engine serves copies in order, a whole
psi's copy (128 MiB at 4096 tokens of the bench preset, 3-6 ms) could hold a batch's few-KiB copy
for its whole length. Pieces were to bound that to one piece; they do not: the copy engine goes on
serving psi's stream while it has work (bench.copy_contention k23b, an H200: 8.1-8.7 ms behind a
512 MiB copy, whole, in 16 or 64 MiB pieces queued at once, or 16 MiB pieces queued two at a time).
The ranker's batch_copies "kernel" (graphs.py) keeps a batch's bytes off the copy engines instead.
On an H200 (L4096, h2d) 8 MiB pieces also doubled the device loop's time issuing copies.
"""

from __future__ import annotations

from typing import Any

import torch

from services.ranker.psi import Psi, PsiKey, psi_memory

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def host_meta(psi: Psi) -> dict[str, Any]:
    layers, _two, plen, hidden = psi.kv.shape
    return {
        "prefix_len": plen,
        "layers": layers,
        "hidden": hidden,
        "dtype": str(psi.kv.dtype).removeprefix("torch."),
        "kv_bytes": psi.kv.numel() * psi.kv.element_size(),
        "ts_bytes": plen * 8,
    }


def host_nbytes(meta: dict[str, Any]) -> int:
    return int(meta["kv_bytes"]) + int(meta["ts_bytes"])


def copy_in_pieces(dst: torch.Tensor, src: torch.Tensor, piece_bytes: int = 0) -> int:
    """dst.copy_(src) for flat uint8 tensors of one length, as copies of at most `piece_bytes`
    each (0: one copy); asynchronous where the host side is pinned. Returns the copies issued."""
    n = src.numel()
    if dst.numel() != n:
        raise ValueError(f"copy of {n} bytes into {dst.numel()}")
    if piece_bytes <= 0 or n <= piece_bytes:
        dst.copy_(src, non_blocking=True)
        return 1
    for start in range(0, n, piece_bytes):
        end = min(start + piece_bytes, n)
        dst[start:end].copy_(src[start:end], non_blocking=True)
    return -(-n // piece_bytes)


def issue_to_host(psi: Psi, dest: torch.Tensor, piece_bytes: int = 0) -> None:
    """Copies psi into dest (uint8, host, host_nbytes long); asynchronous when dest is pinned.
    One copy where psi is one block (Psi.block: the host layout already), else two."""
    if psi.block is not None:
        copy_in_pieces(dest[: psi.nbytes], psi.block, piece_bytes)
        return
    kv_bytes = psi.kv.numel() * psi.kv.element_size()
    copy_in_pieces(dest[:kv_bytes], psi.kv.reshape(-1).view(torch.uint8), piece_bytes)
    dest[kv_bytes : kv_bytes + psi.prefix_len * 8].copy_(psi.timestamps.view(torch.uint8), non_blocking=True)


def issue_from_host(
    src: torch.Tensor,
    meta: dict[str, Any],
    key: PsiKey,
    device: torch.device,
    alloc_stream: torch.cuda.Stream | None = None,
    piece_bytes: int = 0,
) -> Psi:
    """A new psi on `device` filled from src (uint8, host). Validates the metadata first.
    `piece_bytes`: psi's bytes are copied in pieces of at most this many (0: one copy).

    `alloc_stream` (CUDA): the stream whose memory pool the block comes from, the compute
    stream's, where every other psi block lives. The copies run on the current stream (the copy
    stream, ordered after the compute stream by the engine). Allocated on the copy stream, a
    reloaded psi's memory went back to that stream's pool when freed, where no full ranking's
    psi could reuse it: the two pools grew apart until the allocator had to free everything
    cached (a device-wide synchronisation)."""
    try:
        dtype = _DTYPES[str(meta["dtype"])]
        layers, plen, hidden = int(meta["layers"]), int(meta["prefix_len"]), int(meta["hidden"])
        kv_bytes = int(meta["kv_bytes"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"bad psi metadata from the host tier: {exc}") from None
    if kv_bytes != layers * 2 * plen * hidden * dtype.itemsize:
        raise ValueError("psi metadata sizes disagree")
    if src.numel() < kv_bytes + plen * 8:
        raise ValueError("host range shorter than the psi it should hold")
    if alloc_stream is not None:
        copy_stream = torch.cuda.current_stream(device)
        with torch.cuda.stream(alloc_stream):
            kv, ts, block = psi_memory(layers, plen, hidden, dtype, device)
        # Freed before the copy completes (it never is: the caller waits for it), the memory
        # would wait for the copy stream before reuse.
        for t in (block,) if block is not None else (kv, ts):
            t.record_stream(copy_stream)
    else:
        kv, ts, block = psi_memory(layers, plen, hidden, dtype, device)
    if block is not None:  # one copy: the block is the host layout
        copy_in_pieces(block, src[: block.numel()], piece_bytes)
    else:
        copy_in_pieces(kv.reshape(-1).view(torch.uint8), src[:kv_bytes], piece_bytes)
        ts.view(torch.uint8).copy_(src[kv_bytes : kv_bytes + plen * 8], non_blocking=True)
    return Psi(key, kv, ts, block)
