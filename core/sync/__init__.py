"""Trainer → sampler weight sync: versioned, bucketed, verified.

- ``manifest``: ``SyncManifest`` (version, dtype, flat buckets, the trainer's checksum) built by
  ``build_manifest(trainer, version=..., bucket_bytes=..., layout="packed" | "spans")`` — packed
  = ``export_weights`` buckets, spans = the trainer's own flat storages (ZeRO-1/2); ``SyncError``.
- ``digest``: the trainer's checksum on CUDA: Triton kernels over the flat storages, one
  device -> host transfer per checksum (``DigestPlan``: block tables made once per layout).
- ``layout``: what depends only on where the weights lie (trainer spans, a manifest's buckets,
  digest plans, checksum line prefixes), cached per layout and re-checked every sync against
  the weights' current pointers, so offload / onload or another model never gets stale views.
- ``staging``: ``StagedUpdate`` + ``apply_update(engine, staged)`` — stage every bucket, verify
  the checksum against the trainer's ``weight_checksum()``, only then load; a rejected sync
  leaves the receiver serving its previous version.
- ``shared``: colocated transport — CUDA-IPC of flat buckets (POSIX shared memory on CPU), one
  handle per bucket (``SharedExport`` / ``open_shared``).
- ``broadcast``: split transport — ``SyncGroup`` (NCCL / gloo, its own store) with
  ``send_weights`` / ``recv_weights``; trainer ranks share the sending, packing overlaps sending.
"""

from .broadcast import SyncGroup, recv_weights, send_weights
from .manifest import BucketSpec, SyncError, SyncManifest, build_manifest, plan_buckets
from .shared import BucketHandle, SharedExport, open_shared
from .staging import StagedUpdate, apply_update, current_version, engine_checksum, engine_model

__all__ = [
    "SyncGroup",
    "recv_weights",
    "send_weights",
    "BucketSpec",
    "SyncError",
    "SyncManifest",
    "build_manifest",
    "plan_buckets",
    "BucketHandle",
    "SharedExport",
    "open_shared",
    "StagedUpdate",
    "apply_update",
    "current_version",
    "engine_checksum",
    "engine_model",
]
