"""Device views of page-locked host memory, so that a kernel moves a batch's few KiB itself.

A copy engine serves the copies of one direction in the order they were queued, from every
stream (bench.copy_contention, k23 on an H200): a batch's scores copied to the host while a 512
MiB psi copy to the host is in flight wait for all of it (8.2-8.6 ms), in 16 or 64 MiB pieces
too, queued at once or two at a time, and the stream that queued them waits with them. A kernel
that reads or writes page-locked host memory through its unified address (zero-copy over PCIe)
takes no copy engine, so it does not queue behind psi's copies.

`device_view(host, device)` is a CUDA tensor over the same bytes as a page-locked host tensor
(None where there is no such view: not CUDA, not page-locked, a dtype without one); the caller
keeps `host` alive for as long as the view is used (the view holds a reference too).
`copy_by_kernel(dst, src)` copies with an elementwise bitwise kernel, never a memcpy (a same-dtype
`copy_` between two "device" tensors is a memcpy, which may take a copy engine again).
`HostStaging` is a ring of such buffers for one-off copies to the device (a new psi's timestamps).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
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


class _StagingSlot:
    def __init__(self, cuda: bool) -> None:
        self.host: torch.Tensor | None = None
        self.view: torch.Tensor | None = None
        # Recorded after each copy that reads `host`, again at the next (a new event each time
        # costs the device loop ~45 us on an H200: services/ranker/events.py).
        self.event = torch.cuda.Event() if cuda else None
        self.pending = False


class HostStaging:
    """Page-locked buffers used in turn for small one-off copies to the device, moved by a
    kernel through their device views, so that they never queue on a copy engine behind psi's
    copies (a new psi's 128 KiB of timestamps, written on the compute stream before its first
    pre-inference step, would wait there for a reload in flight, and every step behind it).

    A slot is written only once the kernel that read it last has run (its event), so `slots`
    bounds how many such copies may be on the device at once; slots grow (doubling) to the
    longest copy asked for. Where the device gives no views (not CUDA, no unified addressing)
    `available` is False and `copy` copies the ordinary way, from page-locked memory where it
    can: the caller's result is the same either way. Any thread may stage (one at a time); each
    copy runs on that thread's current stream."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.int64, slots: int = 16) -> None:
        if slots < 1:
            raise ValueError("slots: at least 1")
        if dtype not in _TYPESTR:
            raise ValueError(f"no device view of {dtype}")
        self.device = device
        self.dtype = dtype
        self._cuda = device.type == "cuda"
        self._slots = [_StagingSlot(self._cuda) for _ in range(slots)]
        self._next = 0
        self._lock = threading.Lock()
        probe = torch.zeros(1, dtype=dtype, pin_memory=self._cuda)
        self.available = device_view(probe, device) is not None

    def copy(self, out: torch.Tensor, fill: Callable[[np.ndarray], None]) -> None:
        """Writes `out` (a contiguous tensor on the device, of this dtype): `fill` writes its
        values into a host array of out's length, then they are moved to `out` on the current
        stream."""
        if out.dtype != self.dtype or out.device.type != self.device.type or not out.is_contiguous():
            raise ValueError(f"staging of {self.dtype} on {self.device} into {out.dtype} on {out.device}")
        n = out.numel()
        if n == 0:
            return
        with self._lock:
            self._copy(out, n, fill)

    def _copy(self, out: torch.Tensor, n: int, fill: Callable[[np.ndarray], None]) -> None:
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.pending and slot.event is not None:
            slot.event.synchronize()  # the copy that read this slot last has run
        slot.pending = False
        if slot.host is None or slot.host.numel() < n:
            capacity = max(n, 2 * (slot.host.numel() if slot.host is not None else 0))
            slot.host = torch.empty(capacity, dtype=self.dtype, pin_memory=self._cuda)
            slot.view = device_view(slot.host, self.device) if self.available else None
        host = slot.host[:n]
        fill(host.numpy())
        if slot.view is not None:
            copy_by_kernel(out.view(-1), slot.view[:n])
        else:
            out.view(-1).copy_(host, non_blocking=self._cuda)
        if slot.event is not None:
            slot.event.record(torch.cuda.current_stream(self.device))
            slot.pending = True
