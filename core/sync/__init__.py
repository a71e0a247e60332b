"""Trainer → sampler weight sync: versioned, bucketed, verified.

- ``manifest``: ``SyncManifest`` (version, dtype, flat buckets, the trainer's checksum) built by
  ``build_manifest(trainer, version=..., bucket_bytes=..., layout="packed" | "spans")`` — packed
  = ``export_weights`` buckets, spans = the trainer's own flat storages (ZeRO-1/2); ``SyncError``.
- ``layout``: a manifest's buckets checked once per layout (the trainer side, where a module's
  weights lie, is ``polynya.spans``; the checksum itself is ``polynya.checksum``).
- ``staging``: ``StagedUpdate`` + ``apply_update(engine, staged)`` — stage every bucket, then
  the engine's ``load_weights(pieces, version=, checksum=)`` verifies them against the trainer's
  ``weight_checksum()`` before it copies anything (always); a rejected sync leaves the receiver
  serving its previous version.
- ``shared``: colocated transport — CUDA-IPC of flat buckets (POSIX shared memory on CPU), one
  handle per bucket (``SharedExport`` / ``open_shared``).
- ``group``: ``SyncGroup`` — the split transport's own process group (NCCL / gloo, its own
  store) with bounded waits: a member that dies, stalls or gives up is detected by heartbeats
  (``liveness``) within ``peer_timeout_s`` and the group is torn down, never a hang.
- ``push``: ``WeightPush`` — in-process push of a framework's module into an engine (TRL's
  adapter): the parameters directly, or through a flat staging buffer when a cast or a ZeRO-3
  gather is needed; verified before the copy and by checksum after, in a fixed number of launches.
- ``broadcast``: split transport — ``send_weights`` / ``recv_weights`` over a ``SyncGroup``;
  trainer ranks share the sending, packing overlaps sending; ``SyncPeerLost`` on a lost member.
"""

from .broadcast import recv_weights, send_weights
from .group import SyncGroup
from .liveness import SyncPeerLost
from .manifest import BucketSpec, SyncError, SyncManifest, build_manifest, plan_buckets
from .push import WeightPush
from .shared import BucketHandle, SharedExport, open_shared
from .staging import StagedUpdate, apply_update

__all__ = [
    "SyncGroup",
    "SyncPeerLost",
    "recv_weights",
    "send_weights",
    "BucketSpec",
    "SyncError",
    "SyncManifest",
    "WeightPush",
    "build_manifest",
    "plan_buckets",
    "BucketHandle",
    "SharedExport",
    "open_shared",
    "StagedUpdate",
    "apply_update",
]
