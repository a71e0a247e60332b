"""Split weight sync: bucketed flat broadcast from the trainer ranks to every receiver.

Runs on a ``SyncGroup`` (``polynya.sync.group``: NCCL on CUDA, gloo on CPU): ranks ``0 .. T-1``
are the trainer ranks, ``T ..`` the receivers (sampler replicas, log-prob ranks). Bucket ``i`` is
sent by trainer rank ``i % T``, so every trainer rank sends its share. Sending is asynchronous:
while bucket ``i`` is on the wire the trainer packs bucket ``i + 1`` (``export_weights`` is a
generator), so packing overlaps sending. After the last bucket every member confirms it holds
the whole update (one small all-reduce), so a sender never reports a sync that a receiver lost.

::

    group = SyncGroup(host, port, rank=r, world_size=T + R, device=dev)   # every member, once
    send_weights(group, trainer, manifest, bucket_bytes, num_senders=T)   # trainer ranks
    staged = recv_weights(group, manifest, device, num_senders=T)         # receivers
    apply_update(sampler, staged)

The manifest travels out of band (Ray call, HTTP JSON); receivers allocate every buffer from it.

Failure is bounded (``SyncGroup``'s ``peer_timeout_s`` / ``timeout_s``): when a member dies,
stalls or gives up mid-sync, every other member raises ``SyncPeerLost`` (naming the lost ranks,
the version and the bucket it had reached) instead of hanging, and the group is torn down. The
trainer's weights, optimizer and version are untouched (sending only reads them); a receiver
never returns a partial update, so its engine keeps serving its previous version. To recover,
make a new ``SyncGroup`` on a new port with the members that are alive (a restarted sampler
joins with version 0) and send the trainer's current weights again, under a version newer than
any survivor serves — the same calls as the first sync::

    group = SyncGroup(host, new_port, rank=r, world_size=T + R, device=dev)  # every member
    send_weights(group, trainer, build_manifest(trainer, version=v + 1, ...), bucket_bytes)

(``RayClient`` does this on the sync after a failed one: a fresh port from the trainer, every
actor's ``init_sync_group`` closes its old group, and the version is never reused.)
"""

from __future__ import annotations

import torch

from .group import SyncGroup
from .liveness import PeerFailure, SyncPeerLost
from .manifest import SyncError, SyncManifest
from .staging import StagedUpdate


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

    Returns bytes this rank sent, once every member confirmed it holds the whole update.
    ``SyncPeerLost`` (bounded, group torn down, trainer untouched) when a member is lost;
    ``SyncError`` when a receiver could not take the update (the group stays usable).
    ``corrupt`` (tests only) may alter a bucket before sending.
    """
    if any(b.offsets is not None for b in manifest.buckets):
        raise ValueError("broadcast sync needs a packed manifest (build_manifest(layout='packed'))")
    group.check_usable()
    n, version = len(manifest.buckets), manifest.version
    src_of = lambda i: i % num_senders
    exported = iter(trainer.export_weights(bucket_bytes))
    inflight: list = []  # (index, work, flat): at most the bucket on the wire and the next
    sent = count = 0
    at: int | None = 0
    with group.monitor.watch():
        try:
            for i, (names, flat) in enumerate(exported):
                if i >= n or tuple(names) != manifest.buckets[i].names:
                    raise SyncError(f"export bucket {i} does not match the manifest")
                if corrupt is not None:
                    flat = corrupt(i, flat)
                if flat.device != group.device:
                    flat = flat.to(group.device)
                inflight.append((i, group.broadcast(flat, src_of(i)), flat))  # bucket i on the wire
                if len(inflight) == 2:  # ... while bucket i + 1 is packed next turn
                    at = inflight[0][0]
                    group.wait(inflight.pop(0)[1])
                if src_of(i) == group.rank:
                    sent += flat.numel() * flat.element_size()
                count += 1
            while inflight:
                at = inflight[0][0]
                group.wait(inflight.pop(0)[1])
            if count != n:
                raise SyncError(f"export produced {count} buckets, the manifest has {n}")
            at = None
            missing = group.confirm(True)
        except PeerFailure as exc:
            lost = peer_lost(group, exc, version, n, at, "sending")
            _drain(exported)  # ZeRO-3: every trainer rank runs the export's gathers to the end
            raise lost from None
        except BaseException as exc:  # a local failure while the receivers are mid-sync
            group.abort(f"rank {group.rank} failed while sending version {version}: {exc}")
            raise
    if missing:
        raise SyncError(f"rank(s) {missing} could not take version {version} (their own error "
                        "says why); no receiver applies it; the group stays usable")
    return sent


def recv_weights(
    group: SyncGroup, manifest: SyncManifest, device: torch.device | str, *, num_senders: int = 1
) -> StagedUpdate:
    """Receive every bucket of ``manifest`` into fresh buffers on ``device`` and stage them.

    Returns the staged update only when every member holds the whole of it; otherwise nothing
    is returned (``SyncPeerLost``: a member was lost, group torn down; ``SyncError``: some
    receiver could not take it, group usable), so a partial update can never be applied.
    """
    group.check_usable()
    n, version, device = len(manifest.buckets), manifest.version, torch.device(device)
    staged = StagedUpdate(manifest)
    works: list = []
    local_error: Exception | None = None
    at: int | None = 0
    with group.monitor.watch():
        try:
            for i, spec in enumerate(manifest.buckets):
                buf = torch.empty(spec.numel, dtype=manifest.torch_dtype, device=group.device)
                works.append((i, group.broadcast(buf, i % num_senders), buf))
            for i, work, buf in works:
                at = i
                group.wait(work)
                if local_error is None:
                    try:
                        staged.put(i, buf if buf.device == device else buf.to(device))
                    except Exception as exc:  # out of memory: still keep the group in step
                        local_error = exc
                        staged.clear()
            at = None
            missing = group.confirm(local_error is None)
        except PeerFailure as exc:
            raise peer_lost(group, exc, version, n, at, "receiving") from None
        except BaseException as exc:
            group.abort(f"rank {group.rank} failed while receiving version {version}: {exc}")
            raise
    if local_error is not None:
        raise SyncError(f"could not stage version {version} here: {local_error}") from local_error
    if missing:
        raise SyncError(f"rank(s) {missing} could not take version {version}; it is not applied "
                        "here either (every receiver stays on one version); the group stays usable")
    return staged


def peer_lost(group: SyncGroup, exc: PeerFailure, version: int, n: int | None, at: int | None,
              role: str) -> SyncPeerLost:
    """Tear ``group`` down and describe what was lost, where, and what to do (``n``: the
    buckets of the sync, None when a stream does not announce them)."""
    total = f" of {n}" if n is not None else ""
    where = (f"bucket {at}{total}" if at is not None else
             f"the confirmation after all {n} buckets" if n is not None else "the end of the stream")
    who = f"peer rank(s) {list(exc.ranks)}" if exc.ranks else "a peer that could not be named"
    group.abort(f"rank {group.rank} lost {who} in the sync of version {version}: {exc.reason}",
                exc.ranks)
    kept = ("its weights, optimizer and version are unchanged" if role == "sending" else
            "no partial update is returned: the engine keeps its previous weights and version")
    return SyncPeerLost(
        f"weight sync of version {version} failed on rank {group.rank} ({role}) at {where}: "
        f"{who} lost: {exc.reason.rstrip('.')}. The sync group is torn down and nothing waits on it; {kept}. "
        "To recover, make a new SyncGroup on a new port with the members that are alive or "
        "restarted, and send the trainer's current weights again.",
        ranks=exc.ranks, version=version, bucket=at,
    )


def _drain(exported) -> None:
    try:
        for _ in exported:
            pass
    except Exception:  # the sync has failed already; this error would only hide that one
        pass
