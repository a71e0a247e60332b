"""Split weight sync: bucketed flat broadcast from the trainer ranks to every receiver.

One standalone process group per sync topology (NCCL on CUDA, gloo on CPU), separate from the
trainer's DeepSpeed group: ranks ``0 .. T-1`` are the trainer ranks, ``T ..`` the receivers
(sampler replicas, log-prob ranks). Bucket ``i`` is sent by trainer rank ``i % T``, so every
trainer rank sends its share. Sending is asynchronous: while bucket ``i`` is on the wire the
trainer packs bucket ``i + 1`` (``export_weights`` is a generator), so packing overlaps sending.

::

    group = SyncGroup(host, port, rank=r, world_size=T + R, device=dev)   # every member, once
    send_weights(group, trainer, manifest, bucket_bytes, num_senders=T)   # trainer ranks
    staged = recv_weights(group, manifest, device, num_senders=T)         # receivers
    apply_update(sampler, staged)

The manifest travels out of band (Ray call, HTTP JSON); receivers allocate every buffer from it.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .manifest import SyncError, SyncManifest
from .staging import StagedUpdate


class SyncGroup:
    """A process group of its own over a ``TCPStore`` (rank 0 hosts the store)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        rank: int,
        world_size: int,
        device: torch.device | str,
        timeout_s: float = 300.0,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a sync group of {world_size}")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(
            host,
            int(port),
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        if self.device.type == "cuda":
            self.pg = dist.ProcessGroupNCCL(
                dist.PrefixStore("polynya_sync", self.store), rank, world_size
            )
        else:
            self.pg = dist.ProcessGroupGloo(
                dist.PrefixStore("polynya_sync", self.store), rank, world_size, timeout
            )

    def broadcast(self, tensor: torch.Tensor, root: int):
        """Asynchronous broadcast; returns the ``Work`` to wait on."""
        return self.pg.broadcast(tensor, root)

    def barrier(self) -> None:
        self.broadcast(torch.zeros(1, device=self.device), 0).wait()

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # best effort: the peer may be gone already
                pass


def send_weights(
    group: SyncGroup,
    trainer,
    manifest: SyncManifest,
    bucket_bytes: int,
    *,
    num_senders: int = 1,
    corrupt=None,
) -> int:
    """Broadcast ``trainer``'s buckets (every trainer rank calls this, with the same manifest).

    Returns bytes this rank sent. ``corrupt`` (tests only) may alter a bucket before sending.
    """
    if any(b.offsets is not None for b in manifest.buckets):
        raise ValueError("broadcast sync needs a packed manifest (build_manifest(layout='packed'))")
    src_of = lambda i: i % num_senders  # noqa: E731
    pending, sent = None, 0
    count = 0
    for i, (names, flat) in enumerate(trainer.export_weights(bucket_bytes)):
        if i >= len(manifest.buckets) or tuple(names) != manifest.buckets[i].names:
            raise SyncError(f"export bucket {i} does not match the manifest")
        if corrupt is not None:
            flat = corrupt(i, flat)
        if flat.device != group.device:
            flat = flat.to(group.device)
        work = group.broadcast(flat, src_of(i))  # bucket i on the wire ...
        if pending is not None:
            pending[0].wait()  # ... while bucket i + 1 is packed next turn
        pending = (work, flat)
        if src_of(i) == group.rank:
            sent += flat.numel() * flat.element_size()
        count += 1
    if pending is not None:
        pending[0].wait()
    if count != len(manifest.buckets):
        raise SyncError(
            f"export produced {count} buckets, the manifest has {len(manifest.buckets)}"
        )
    return sent


def recv_weights(
    group: SyncGroup, manifest: SyncManifest, device: torch.device | str, *, num_senders: int = 1
) -> StagedUpdate:
    """Receive every bucket of ``manifest`` into fresh buffers on ``device`` and stage them."""
    staged = StagedUpdate(manifest)
    works = []
    for i, spec in enumerate(manifest.buckets):
        buf = torch.empty(spec.numel, dtype=manifest.torch_dtype, device=group.device)
        works.append((i, group.broadcast(buf, i % num_senders), buf))
    for i, work, buf in works:
        work.wait()
        if buf.device != torch.device(device):
            buf = buf.to(device)
        staged.put(i, buf)
    return staged
