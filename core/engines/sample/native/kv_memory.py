"""The KV cache's device memory: released on ``sleep``, restored on ``wake`` at the same address.

A colocated sampler frees its KV cache while the trainer runs and takes it back before the next
generate. Its decode steps are CUDA graphs whose kernels hold the cache's address, so a cache
that comes back elsewhere forces every graph to be captured again on every wake (each capture
runs the whole decoder eagerly, once per batch bucket). :class:`KVMemory` avoids that:

- with CUDA's virtual-memory API (``cuda.bindings.driver``, shipped as ``cuda-bindings`` with
  recent PyTorch/CUDA installs) it reserves an address range once and maps / unmaps physical
  memory under it, so the cache always returns at the same address (``stable`` is True) and
  the graphs stay valid; ``release`` really returns the memory to the device;
- otherwise (CPU, or no ``cuda-bindings``) it is a plain ``torch.zeros``; the runner then keeps
  its graphs only when the new cache happens to land at the old address.

    mem = KVMemory((layers, 2, blocks, block_size, hkv, d), torch.bfloat16, torch.device("cuda"))
    kv = mem.allocate()      # zeroed
    mem.release()            # kv must not be touched until the next allocate()
"""
from __future__ import annotations

import math
import weakref

import torch


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


def _ok(driver, result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class _Raw:
    """A device byte range seen by ``torch.as_tensor`` (CUDA array interface, no copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class KVMemory:
    """Owns the KV cache tensor's memory; see the module docstring."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.nbytes = math.prod(self.shape) * torch.empty((), dtype=dtype).element_size()
        self._drv = _driver() if device.type == "cuda" else None
        self._va = self._size = self._prop = None
        self._mapped: dict = {}  # "handle" while physical memory is mapped (read by the finalizer)
        if self._drv is not None:
            try:
                self._reserve()
            except RuntimeError:  # VMM unsupported on this device / driver: plain allocations
                self._drv = None

    @property
    def stable(self) -> bool:
        """Whether every ``allocate`` returns the same address (virtual-memory backed)."""
        return self._drv is not None

    def _reserve(self) -> None:
        drv = self._drv
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.index if self.device.index is not None else torch.cuda.current_device()
        gran = _ok(drv, drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity")
        self._size = -(-self.nbytes // int(gran)) * int(gran)
        self._va = int(_ok(drv, drv.cuMemAddressReserve(self._size, 0, 0, 0), "cuMemAddressReserve"))
        self._prop = prop
        weakref.finalize(self, _free_range, drv, self._va, self._size, self._mapped)

    def allocate(self) -> torch.Tensor:
        """A zeroed ``shape`` tensor (mapped anew at the reserved address when ``stable``)."""
        if self._drv is None:
            return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        drv = self._drv
        torch.cuda.init()
        if "handle" not in self._mapped:
            handle = _ok(drv, drv.cuMemCreate(self._size, self._prop, 0), "cuMemCreate (KV cache)")
            try:
                _ok(drv, drv.cuMemMap(self._va, self._size, 0, handle, 0), "cuMemMap")
                access = drv.CUmemAccessDesc()
                access.location = self._prop.location
                access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                _ok(drv, drv.cuMemSetAccess(self._va, self._size, [access], 1), "cuMemSetAccess")
            except RuntimeError:
                drv.cuMemUnmap(self._va, self._size)
                drv.cuMemRelease(handle)
                raise
            self._mapped["handle"] = handle
        raw = torch.as_tensor(_Raw(self._va, self.nbytes), device=self.device)
        kv = raw.view(self.dtype).view(self.shape)
        kv.zero_()
        return kv

    def release(self) -> None:
        """Return the memory to the device (the address range stays reserved)."""
        if self._drv is None or "handle" not in self._mapped:
            return
        torch.cuda.synchronize(self.device)  # no kernel may still read the pages
        _ok(self._drv, self._drv.cuMemUnmap(self._va, self._size), "cuMemUnmap")
        _ok(self._drv, self._drv.cuMemRelease(self._mapped.pop("handle")), "cuMemRelease")


def _free_range(drv, va: int, size: int, mapped: dict) -> None:
    try:
        if "handle" in mapped:
            drv.cuMemUnmap(va, size)
            drv.cuMemRelease(mapped.pop("handle"))
        drv.cuMemAddressFree(va, size)
    except Exception:  # noqa: BLE001, S110 - interpreter shutdown: the driver may be gone
        pass
