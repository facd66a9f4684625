"""Device views of page-locked host memory, so that a kernel moves a batch's few KiB itself.

A copy engine serves the copies of one direction in the order they were queued, from every
stream (bench.copy_contention, k23 on an H200): a batch's scores copied to the host while a 512
MiB psi copy to the host is in flight wait for all of it (8.2-8.6 ms), in 16 or 64 MiB pieces
too when the pieces are queued at once, and the stream that queued them waits with them. A kernel
that reads or writes page-locked host memory through its unified address (zero-copy over PCIe)
takes no copy engine, so it does not queue behind psi's copies.

`device_view(host, device)` is a CUDA tensor over the same bytes as a page-locked host tensor
(None where there is no such view: not CUDA, not page-locked, a dtype without one); the caller
keeps `host` alive for as long as the view is used (the view holds a reference too).
`copy_by_kernel(dst, src)` copies with an elementwise bitwise kernel, never a memcpy (a same-dtype
`copy_` between two "device" tensors is a memcpy, which may take a copy engine again).
"""

from __future__ import annotations

from typing import Any

import torch

_TYPESTR = {
    torch.int64: "<i8",
    torch.int32: "<i4",
    torch.float32: "<f4",
    torch.float16: "<f2",
    torch.uint8: "|u1",
}


class _Interface:
    """The __cuda_array_interface__ of a page-locked host tensor's bytes (which it keeps alive)."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": tuple(host.shape),
            "typestr": _TYPESTR[host.dtype],
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 2,
        }


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A tensor on `device` over `host`'s bytes, or None where there is none (see the module)."""
    if device.type != "cuda" or host.device.type != "cpu" or host.dtype not in _TYPESTR:
        return None
    if not host.is_contiguous() or host.numel() == 0 or not host.is_pinned():
        return None
    try:
        view = torch.as_tensor(_Interface(host), device=device)
    except (RuntimeError, TypeError, ValueError):  # no unified addressing: the caller copies
        return None
    if view.data_ptr() != host.data_ptr() or view.device.type != "cuda":
        return None
    return view


# The integer type of each element size: the copy is a bitwise kernel, exact for every value
# (a float multiply would canonicalise NaNs' payloads on the device).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_by_kernel(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst <- src, bit for bit, by an elementwise kernel (a bitwise or with zero), never a memcpy."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy of {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}")
    bits = _BITS.get(src.element_size())
    if bits is None or src.is_complex() or src.dtype == torch.bool:
        raise ValueError(f"no bitwise copy of {src.dtype}")
    torch.bitwise_or(src.view(bits), 0, out=dst.view(bits))
    return dst
