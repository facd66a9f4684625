"""psi between accelerator memory and a host byte range (the expander's shared-memory arena).

Host layout of one psi: [kv bytes | int64 timestamps], described by `host_meta` (stored by the
expander beside the bytes and returned on reload). Copies are *issued* here; the engine runs them
on its copy stream and resolves the caller once they completed.
"""

from __future__ import annotations

from typing import Any

import torch

from services.ranker.psi import Psi, PsiKey

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


def issue_to_host(psi: Psi, dest: torch.Tensor) -> None:
    """Copies psi into dest (uint8, host, host_nbytes long); asynchronous when dest is pinned."""
    kv_bytes = psi.kv.numel() * psi.kv.element_size()
    dest[:kv_bytes].copy_(psi.kv.reshape(-1).view(torch.uint8), non_blocking=True)
    dest[kv_bytes : kv_bytes + psi.prefix_len * 8].copy_(psi.timestamps.view(torch.uint8), non_blocking=True)


def issue_from_host(
    src: torch.Tensor,
    meta: dict[str, Any],
    key: PsiKey,
    device: torch.device,
    alloc_stream: torch.cuda.Stream | None = None,
) -> Psi:
    """A new psi on `device` filled from src (uint8, host). Validates the metadata first.

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
    if kv_bytes != layers * 2 * plen * hidden * torch.tensor([], dtype=dtype).element_size():
        raise ValueError("psi metadata sizes disagree")
    if src.numel() < kv_bytes + plen * 8:
        raise ValueError("host range shorter than the psi it should hold")
    if alloc_stream is not None:
        copy_stream = torch.cuda.current_stream(device)
        with torch.cuda.stream(alloc_stream):
            kv = torch.empty(layers, 2, plen, hidden, dtype=dtype, device=device)
            ts = torch.empty(plen, dtype=torch.int64, device=device)
        # Freed before the copy completes (it never is: the caller waits for it), the blocks
        # would wait for the copy stream before reuse.
        kv.record_stream(copy_stream)
        ts.record_stream(copy_stream)
    else:
        kv = torch.empty(layers, 2, plen, hidden, dtype=dtype, device=device)
        ts = torch.empty(plen, dtype=torch.int64, device=device)
    kv.reshape(-1).view(torch.uint8).copy_(src[:kv_bytes], non_blocking=True)
    ts.view(torch.uint8).copy_(src[kv_bytes : kv_bytes + plen * 8], non_blocking=True)
    return Psi(key, kv, ts)
