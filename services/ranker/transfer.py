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

Host format "fp8" (the ranker's host_psi_format; "native" by default): the K/V go to the host as
float8 e4m3 with a float32 scale per 16 tokens of one head (kernels.psi_fp8), quantized on the
copy stream before the copy and dequantized there after it: half the bytes to copy and to hold
in DRAM, with scores off by what bench.psi_fp8 measures. Layout [fp8 values | scales |
timestamps]; HBM keeps psi as computed either way.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.psi_fp8 import FP8, QuantizedKV, dequantize_kv, quantize_kv
from services.ranker.psi import Psi, PsiKey, PsiSizeClasses, psi_memory

HOST_FORMATS = ("native", "fp8")
FP8_GROUP_TOKENS = 16  # a scale per 16 tokens of one head: 1/1024 more bytes at 256 dims a head

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _fp8_sizes(layers: int, plen: int, hidden: int, heads: int) -> tuple[int, int]:
    """Bytes of psi's fp8 values and of their scales."""
    return layers * 2 * plen * hidden, layers * 2 * -(-plen // FP8_GROUP_TOKENS) * heads * 4


def host_meta(psi: Psi, fmt: str = "native", heads: int = 1) -> dict[str, Any]:
    """How psi is laid out on the host: `kv_bytes` of K/V (in `fmt`; `heads` splits its features
    for fp8's scales), then `ts_bytes` of timestamps; `dtype` is psi's own."""
    layers, _two, plen, hidden = psi.kv.shape
    meta: dict[str, Any] = {
        "prefix_len": plen,
        "layers": layers,
        "hidden": hidden,
        "dtype": str(psi.kv.dtype).removeprefix("torch."),
        "kv_bytes": psi.kv.numel() * psi.kv.element_size(),
        "ts_bytes": plen * 8,
    }
    if fmt == "fp8":
        values, scales = _fp8_sizes(layers, plen, hidden, heads)
        meta.update(format="fp8", heads=heads, group_tokens=FP8_GROUP_TOKENS, kv_bytes=values + scales)
    elif fmt != "native":
        raise ValueError(f"host format must be one of {', '.join(HOST_FORMATS)}, not {fmt!r}")
    return meta


def host_nbytes(meta: dict[str, Any]) -> int:
    return int(meta["kv_bytes"]) + int(meta["ts_bytes"])


def stored_nbytes(
    layers: int, plen: int, hidden: int, itemsize: int, fmt: str = "native", heads: int = 1
) -> int:
    """Bytes of a psi of `plen` tokens on the host in `fmt` (host_nbytes of its host_meta)."""
    if fmt == "fp8":
        return sum(_fp8_sizes(layers, plen, hidden, heads)) + plen * 8
    return layers * 2 * plen * hidden * itemsize + plen * 8


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


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def issue_to_host(
    psi: Psi, dest: torch.Tensor, piece_bytes: int = 0, meta: dict[str, Any] | None = None
) -> None:
    """Copies psi into dest (uint8, host, host_nbytes long) laid out as `meta` says (host_meta;
    None: native); asynchronous when dest is pinned. Native: one copy where psi is one block
    (Psi.block: the host layout already), else two. fp8: quantized on the current stream first
    (its buffers are that stream's: freed, they wait for the copies)."""
    if meta is not None and meta.get("format") == "fp8":
        q = quantize_kv(psi.kv, int(meta["heads"]), int(meta["group_tokens"]))
        values, scales = _bytes_of(q.values), _bytes_of(q.scales)
        at = values.numel()
        copy_in_pieces(dest[:at], values, piece_bytes)
        dest[at : at + scales.numel()].copy_(scales, non_blocking=True)
        at += scales.numel()
        dest[at : at + psi.prefix_len * 8].copy_(_bytes_of(psi.timestamps), non_blocking=True)
        return
    if psi.block is not None:
        copy_in_pieces(dest[: psi.nbytes], psi.block, piece_bytes)
        return
    kv_bytes = psi.kv.numel() * psi.kv.element_size()
    copy_in_pieces(dest[:kv_bytes], _bytes_of(psi.kv), piece_bytes)
    dest[kv_bytes : kv_bytes + psi.prefix_len * 8].copy_(_bytes_of(psi.timestamps), non_blocking=True)


def issue_from_host(
    src: torch.Tensor,
    meta: dict[str, Any],
    key: PsiKey,
    device: torch.device,
    alloc_stream: torch.cuda.Stream | None = None,
    piece_bytes: int = 0,
    classes: PsiSizeClasses | None = None,
) -> Psi:
    """A new psi on `device` filled from src (uint8, host). Validates the metadata first.
    `piece_bytes`: psi's bytes are copied in pieces of at most this many (0: one copy).
    `classes`: its block allocated in size classes, as the ranker's other psi (psi_memory).

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
        fmt = str(meta.get("format", "native"))
        heads = int(meta.get("heads", 1))
        group = int(meta.get("group_tokens", FP8_GROUP_TOKENS))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"bad psi metadata from the host tier: {exc}") from None
    if fmt not in HOST_FORMATS:
        raise ValueError(f"bad psi metadata from the host tier: format {fmt!r}")
    if fmt == "fp8":
        if heads < 1 or hidden % heads or group != FP8_GROUP_TOKENS:
            raise ValueError("psi metadata sizes disagree")
        values_bytes, scales_bytes = _fp8_sizes(layers, plen, hidden, heads)
        expected = values_bytes + scales_bytes
    else:
        values_bytes = expected = layers * 2 * plen * hidden * dtype.itemsize
    if kv_bytes != expected:
        raise ValueError("psi metadata sizes disagree")
    if src.numel() < kv_bytes + plen * 8:
        raise ValueError("host range shorter than the psi it should hold")
    if alloc_stream is not None:
        copy_stream = torch.cuda.current_stream(device)
        with torch.cuda.stream(alloc_stream):
            kv, ts, block = psi_memory(layers, plen, hidden, dtype, device, classes)
        # Freed before the copy completes (it never is: the caller waits for it), the memory
        # would wait for the copy stream before reuse.
        for t in (block,) if block is not None else (kv, ts):
            t.record_stream(copy_stream)
    else:
        kv, ts, block = psi_memory(layers, plen, hidden, dtype, device, classes)
    if fmt == "fp8":  # into buffers of this stream, then dequantized into psi's K/V here too
        values = torch.empty(layers, 2, plen, hidden, dtype=FP8, device=device)
        scales = torch.empty(layers, 2, -(-plen // group), heads, dtype=torch.float32, device=device)
        copy_in_pieces(_bytes_of(values), src[:values_bytes], piece_bytes)
        _bytes_of(scales).copy_(src[values_bytes:kv_bytes], non_blocking=True)
        dequantize_kv(QuantizedKV(values, scales, group, heads, dtype), out=kv)
        _bytes_of(ts).copy_(src[kv_bytes : kv_bytes + plen * 8], non_blocking=True)
    elif block is not None:  # one copy: the block is the host layout
        copy_in_pieces(block, src[: block.numel()], piece_bytes)
    else:
        copy_in_pieces(_bytes_of(kv), src[:kv_bytes], piece_bytes)
        _bytes_of(ts).copy_(src[kv_bytes : kv_bytes + plen * 8], non_blocking=True)
    return Psi(key, kv, ts, block)
