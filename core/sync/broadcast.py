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
Rank 0's store listens on the given ``host`` only; with a loopback host gloo's own listener is
on loopback too, so a group on one machine opens nothing on the network.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from ..distributed import is_loopback
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
        # rank 0's store listens on ``host`` only (TCPStore alone would listen on every interface)
        # (the store owns the descriptor from here on: Python must not close it a second time)
        listen_fd = listen_socket(host, int(port)).detach() if rank == 0 else None
        self.store = dist.TCPStore(
            host,
            int(port),
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
        prefixed = dist.PrefixStore("polynya_sync", self.store)
        if self.device.type == "cuda":
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        elif is_loopback(host):  # a group on this host: gloo's pair listener on loopback too
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            opts._timeout = timeout
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)

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


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host`` (name or address) and ``port``."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


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
