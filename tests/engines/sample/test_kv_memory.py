"""KVMemory on CPU: the plain-allocation fallback (the virtual-memory path is GPU-tested in
test_native_engine_gpu.py)."""
from __future__ import annotations

import torch
from polynya.engines.sample.native.kv_memory import KVMemory


def test_cpu_fallback_allocates_zeroed_cache_of_the_shape():
    mem = KVMemory((2, 2, 5, 4, 3, 8), torch.bfloat16, torch.device("cpu"))
    assert not mem.stable
    assert mem.nbytes == 2 * 2 * 5 * 4 * 3 * 8 * 2
    kv = mem.allocate()
    assert kv.shape == (2, 2, 5, 4, 3, 8) and kv.dtype == torch.bfloat16
    assert not kv.any()
    kv.normal_()
    mem.release()  # no-op without virtual memory
    again = mem.allocate()
    assert not again.any()  # a fresh, zeroed cache
