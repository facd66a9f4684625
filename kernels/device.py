"""Accelerator selection and the few device services the rest of the code may ask for.

Everything that differs between CPU, CUDA and Ascend (torch_npu) stays behind this module:
device choice, synchronisation, pinning host memory, and whether the Triton kernels can run.
torch_npu is optional and imported only when asked for: its presence without Huawei's CANN
breaks `import torch`, so it is never a hard dependency.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

import torch

Backend = Literal["cpu", "cuda", "npu"]
BACKENDS: tuple[Backend, ...] = ("cpu", "cuda", "npu")


class DeviceUnavailableError(RuntimeError):
    """The requested accelerator backend is not present on this machine."""


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    importlib.import_module("torch_npu")
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def resolve_backend(requested: str) -> Backend:
    """'auto' picks cuda, then npu, then cpu; an explicit backend must exist or this raises."""
    if requested == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if _npu_available():
            return "npu"
        return "cpu"
    if requested not in BACKENDS:
        raise ValueError(f"unknown device backend {requested!r}; choose auto, {', '.join(BACKENDS)}")
    if requested == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError("device backend 'cuda' requested but torch sees no CUDA device")
    if requested == "npu" and not _npu_available():
        raise DeviceUnavailableError("device backend 'npu' requested but torch_npu/CANN is not usable")
    return requested


def visible_devices(backend: Backend) -> int:
    """How many devices of `backend` this process can use (0 when the backend is absent; the CPU
    counts as one)."""
    if backend == "cpu":
        return 1
    if backend == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    return int(torch.npu.device_count()) if _npu_available() else 0  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Accelerator:
    """A resolved device plus the backend-specific services the cache and tiers need."""

    backend: Backend
    index: int = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.backend == "cpu" else torch.device(self.backend, self.index)

    @property
    def name(self) -> str:
        if self.backend == "cuda":
            return torch.cuda.get_device_name(self.index)
        if self.backend == "npu":
            return str(torch.npu.get_device_name(self.index))  # type: ignore[attr-defined]
        return "cpu"

    def synchronize(self) -> None:
        if self.backend == "cuda":
            torch.cuda.synchronize(self.index)
        elif self.backend == "npu":
            torch.npu.synchronize(self.index)  # type: ignore[attr-defined]

    def _memory_module(self) -> Any:
        """torch.cuda or torch.npu: the two name their memory functions alike."""
        return torch.cuda if self.backend == "cuda" else torch.npu  # type: ignore[attr-defined]

    def allocator_stats(self) -> dict[str, int]:
        """The caching allocator's state: bytes reserved from the device and allocated to
        tensors, how often an allocation had to free every cached block and retry (a
        synchronising stall of the whole device, tens of ms), and how often it reserved memory
        from the device and gave it back (cudaMalloc / cudaFree: slow, and a free synchronises
        the device; in steady state psi blocks should come from the allocator's cache). {}
        where there is no such allocator (the CPU); torch_npu mirrors the CUDA counters."""
        if self.backend == "cpu":
            return {}
        stats = self._memory_module().memory_stats(self.index)
        return {
            "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
            "allocated_bytes": int(stats.get("allocated_bytes.all.current", 0)),
            "alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "device_allocs": int(stats.get("num_device_alloc", 0)),
            "device_frees": int(stats.get("num_device_free", 0)),
        }

    def free_memory_bytes(self) -> int | None:
        """Device memory free for this process's next allocations, after its caching allocator
        has handed back the blocks it holds unused (warm-up's temporaries; CUDA graphs' private
        pools stay): what psi may still take. None on the CPU (no accelerator memory)."""
        if self.backend == "cpu":
            return None
        module = self._memory_module()
        module.empty_cache()
        free, _total = module.mem_get_info(self.index)
        return int(free)

    def pin_host_range(self, address: int, nbytes: int) -> bool:
        """Registers host memory as page-locked for fast async copies; a no-op off CUDA.

        Returns whether the range is now registered (so the caller knows to unregister it).
        """
        if self.backend != "cuda" or nbytes == 0:
            return False
        err = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        return int(err) == 0

    def unpin_host_range(self, address: int) -> None:
        if self.backend == "cuda":
            torch.cuda.cudart().cudaHostUnregister(address)


def accelerator(requested: str = "auto", index: int = 0) -> Accelerator:
    return Accelerator(resolve_backend(requested), index)


def triton_usable(t: torch.Tensor) -> bool:
    """The Triton kernels run on CUDA tensors only, and only where triton imports."""
    return t.is_cuda and _triton_present()


@functools.cache
def _triton_present() -> bool:
    # Once per process: asked per layer of an eager pass, where a module search costs ~10 us.
    return importlib.util.find_spec("triton") is not None
