"""Process-group set-up and small collectives shared by the engines; the weight checksum.

``ensure_process_group(device)`` makes ``torch.distributed`` usable everywhere an engine runs:

- under ``torchrun`` / Ray / a DeepSpeed launcher the usual ``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR`` and ``MASTER_PORT`` are set and are used as they are;
- in a plain Python process nothing is set: a single-rank group is made on a free local port
  (only ``LOCAL_RANK=0`` is written to the environment, for DeepSpeed).

The backend is NCCL on CUDA and gloo on CPU. ``checksum_named_tensors`` gives a short digest of
a model's weights that two engines (trainer and sampler) compare after a weight sync.
"""
from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Iterable

import torch
import torch.distributed as dist

CHECKSUM_CHUNK = 1 << 24  # elements hashed at a time (bounds the int64 scratch memory)


def free_port() -> int:
    """A TCP port that is free on this host right now (on every interface: it may host a
    rendezvous that other nodes reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def ensure_process_group(device: torch.device) -> tuple[int, int]:
    """Initialise ``torch.distributed`` if needed; return ``(rank, world_size)``.

    With a launcher's ``WORLD_SIZE`` > 1 the ``env://`` variables are used. Without one, a
    single-rank group is made on a free local port; the environment is left alone except for
    ``LOCAL_RANK=0``, which DeepSpeed reads (so child processes started later by other code do
    not inherit a fake ``RANK`` / ``WORLD_SIZE`` / ``MASTER_PORT``).
    """
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise RuntimeError(f"WORLD_SIZE={world} but {missing} are not set: start the ranks "
                                   "with torchrun (or set the variables yourself)")
            os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
            dist.init_process_group(backend, init_method="env://", **kwargs)
        else:
            os.environ.setdefault("LOCAL_RANK", "0")
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                    world_size=1, **kwargs)
    return dist.get_rank(), dist.get_world_size()


def local_device(requested: str | None) -> torch.device:
    """The device this rank computes on: ``requested``, else ``LOCAL_RANK``'s GPU, else the CPU."""
    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place sum over all ranks (no-op on one rank); returns ``t``."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(values: list[int], device: torch.device) -> list[int]:
    """Element-wise maximum of a list of ints over all ranks."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def batch_fingerprint(batch) -> list[int]:
    """A few integers that differ between different batches (same-batch check across ranks)."""
    n_tok = batch.num_tokens()
    s = sum(int(p.sum()) * 31 + int(r.sum()) * 17 + len(r) for p, r in zip(batch.prompts, batch.responses))
    return [len(batch), n_tok, s % (1 << 40)]


def check_same_on_all_ranks(values: list[int], device: torch.device, what: str) -> None:
    """``ValueError`` on every rank unless all ranks passed the same ``values``."""
    hi = all_reduce_max(values, device)
    lo = [-v for v in all_reduce_max([-v for v in values], device)]
    if hi != lo:
        raise ValueError(f"{what} differs between data-parallel ranks: every rank must be given the same "
                         "global batch (the engine shards it by prompt groups itself)")


def plan_micro_batches(batch, *, rank: int, world: int, max_tokens: int, zorro: bool,
                       device: torch.device) -> list[tuple[list[int], bool]]:
    """This rank's micro-batches of a global batch: ``[(rows, real), ...]``.

    The batch is cut into ``world`` shards of whole prompt groups balanced by tokens
    (``polynya.zorro.split_batch(num_parts=world)``), then this rank's shard into micro-batches
    under ``max_tokens``. Every rank gets the same number of micro-batches (collectives inside
    forward/backward must line up): a rank with fewer repeats its smallest one with
    ``real=False`` (to be weighted 0). ``ValueError`` if there are fewer groups than ranks.
    """
    from .zorro import split_batch

    shard = split_batch(batch, zorro=zorro, num_parts=world)[rank] if world > 1 else list(range(len(batch)))
    sub = batch.select(shard)
    parts = [[shard[i] for i in part] for part in split_batch(sub, max_tokens, zorro=zorro)]
    n = all_reduce_max([len(parts)], device)[0]
    smallest = min(parts, key=len)
    return [(p, True) for p in parts] + [(smallest, False)] * (n - len(parts))


def _int_view(t: torch.Tensor) -> torch.Tensor:
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().reshape(-1).view(bits)


def tensor_digest(t: torch.Tensor) -> int:
    """An exact, order-independent-of-hardware digest of a tensor's bits (int64 arithmetic)."""
    flat = _int_view(t)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), CHECKSUM_CHUNK):
        chunk = flat[start:start + CHECKSUM_CHUNK].to(torch.int64)
        pos = torch.arange(start, start + chunk.numel(), device=flat.device, dtype=torch.int64)
        total += (chunk * (pos % 8191 + 1)).sum()
    return int(total)


def signature_prefix(name: str, dtype: torch.dtype, shape) -> str:
    """A checksum line up to its digest: ``tensor_signature`` is this prefix + the digest (fast
    paths build the prefixes once per weight layout and add the digests per sync)."""
    return f"{name}|{dtype}|{tuple(int(x) for x in shape)}|"


def tensor_signature(name: str, t: torch.Tensor) -> str:
    """One line of the checksum: name, dtype, shape and ``tensor_digest``."""
    return signature_prefix(name, t.dtype, t.shape) + str(tensor_digest(t))


def combine_signatures(signatures: Iterable[str]) -> str:
    """Order-independent hex digest of ``tensor_signature`` lines."""
    return hashlib.sha256("\n".join(sorted(signatures)).encode()).hexdigest()[:32]


def checksum_named_tensors(items: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Hex digest of named tensors: their names, dtypes, shapes and exact bits.

    Independent of the order of ``items`` (so engines that store their weights differently
    agree as long as each named tensor is identical).
    """
    return combine_signatures(tensor_signature(name, t) for name, t in items)
