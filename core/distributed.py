"""Process-group set-up and small collectives shared by the engines.

``ensure_process_group(device)`` makes ``torch.distributed`` usable everywhere an engine runs:

- under ``torchrun`` / Ray / a DeepSpeed launcher the usual ``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR`` and ``MASTER_PORT`` are set and are used as they are;
- in a plain Python process nothing is set: a single-rank group is made over an in-process
  ``HashStore`` (no TCPStore; gloo's listener on ``127.0.0.1``), so it opens no socket on any
  other interface; only ``LOCAL_RANK=0`` is written to the environment, for DeepSpeed.

The backend is NCCL on CUDA and gloo on CPU. (The weight checksum lives in ``polynya.checksum``.)
"""
from __future__ import annotations

import hashlib
import ipaddress
import os
import socket

import numpy as np
import torch
import torch.distributed as dist


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def free_port() -> int:
    """A TCP port that is free on this host right now (on every interface: it may host a
    rendezvous that other nodes reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def ensure_process_group(device: torch.device) -> tuple[int, int]:
    """Initialise ``torch.distributed`` if needed; return ``(rank, world_size)``.

    With a launcher's ``WORLD_SIZE`` > 1 the ``env://`` variables are used. Without one, a
    single-rank group is made over an in-process store (nothing listens off loopback); the environment is left alone except for
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
            if backend == "gloo":  # gloo's pair listener on loopback, not the hostname's address
                opts = dist.ProcessGroupGloo._Options()
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
                kwargs["pg_options"] = opts
            # an in-process store: one rank needs no rendezvous, so no TCPStore listens at all
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
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


def batch_fingerprint(batch, tensors: tuple = ()) -> list[int]:
    """A few integers that differ between different batches (same-batch check across ranks):
    the row and token counts and a digest of the rows *in order* (each rank takes its shard by
    row index, and the planner breaks ties between equal prompt groups by position: the same
    samples in another order would train some groups twice and others never, or put log-probs
    in other rows), of the group ids, and of ``tensors`` (None or tensors, e.g. the advantages
    and log-probs a loss reads, hashed as float64)."""
    h = hashlib.blake2b(digest_size=5)
    h.update(repr(None if batch.group_ids is None else list(batch.group_ids)).encode())
    for p, r in zip(batch.prompts, batch.responses):
        for seq in (p, r):
            h.update(np.int64(seq.size).tobytes())
            h.update(seq.astype(np.int64, copy=False).tobytes())
    for t in tensors:
        h.update(b"-" if t is None else repr(tuple(t.shape)).encode())
        if t is not None:
            h.update(t.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
    return [len(batch), batch.num_tokens(), int.from_bytes(h.digest(), "little")]


def check_same_on_all_ranks(values: list[int], device: torch.device, what: str) -> None:
    """``ValueError`` on every rank unless all ranks passed the same ``values``."""
    hi = all_reduce_max(values, device)
    lo = [-v for v in all_reduce_max([-v for v in values], device)]
    if hi != lo:
        raise ValueError(f"{what} differs between data-parallel ranks: every rank must be given the same "
                         "global batch (the engine shards it by prompt groups itself)")
