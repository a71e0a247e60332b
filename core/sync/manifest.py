"""What one weight sync carries: a versioned manifest of flat buckets and their checksum.

The trainer side describes a sync before any byte moves::

    manifest = build_manifest(trainer, version=3, bucket_bytes=1 << 28)
    # manifest.buckets[i].names / .shapes / .numel, manifest.dtype, manifest.checksum

Buckets follow ``TrainingEngine.export_weights(bucket_bytes)`` exactly (same grouping of
``named_parameters`` in order), so a receiver can allocate every buffer from the manifest alone.
``checksum`` is the trainer's ``weight_checksum()`` (``polynya.distributed``): the receiver
recomputes it over what it staged and rejects the sync on any difference (``SyncError``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class SyncError(RuntimeError):
    """A weight sync was rejected (partial, mismatched, corrupted or stale); the receiver still
    serves its previous weights."""


_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def dtype_from_name(name: str) -> torch.dtype:
    """``"torch.bfloat16"`` / ``"bfloat16"`` → ``torch.bfloat16`` (``ValueError`` otherwise)."""
    key = name if name.startswith("torch.") else f"torch.{name}"
    if key not in _DTYPES:
        raise ValueError(f"unsupported weight dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True)
class BucketSpec:
    """One flat bucket: ``names`` in order, their ``shapes``; ``numel`` elements in all."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        total = 0
        for s in self.shapes:
            n = 1
            for d in s:
                n *= d
            total += n
        return total

    def sizes(self) -> list[int]:
        return [int(torch.Size(s).numel()) for s in self.shapes]


@dataclass(frozen=True)
class SyncManifest:
    """A versioned description of one sync (picklable; JSON via ``to_dict`` / ``from_dict``)."""

    version: int
    dtype: str
    checksum: str
    buckets: tuple[BucketSpec, ...] = field(default_factory=tuple)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.names) for b in self.buckets)

    @property
    def nbytes(self) -> int:
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return sum(b.numel for b in self.buckets) * elem

    def to_dict(self) -> dict:
        return {"version": self.version, "dtype": self.dtype, "checksum": self.checksum,
                "buckets": [{"names": list(b.names), "shapes": [list(s) for s in b.shapes]}
                            for b in self.buckets]}

    @classmethod
    def from_dict(cls, d: dict) -> "SyncManifest":
        try:
            buckets = tuple(BucketSpec(tuple(str(n) for n in b["names"]),
                                       tuple(tuple(int(x) for x in s) for s in b["shapes"]))
                            for b in d["buckets"])
            out = cls(int(d["version"]), str(d["dtype"]), str(d["checksum"]), buckets)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed sync manifest: {exc}") from None
        for b in out.buckets:
            if len(b.names) != len(b.shapes):
                raise ValueError("malformed sync manifest: names and shapes differ in length")
        dtype_from_name(out.dtype)
        return out


def plan_buckets(named_shapes: list[tuple[str, tuple[int, ...]]], element_size: int,
                 bucket_bytes: int) -> tuple[BucketSpec, ...]:
    """Group consecutive tensors up to ``bucket_bytes`` (a larger tensor is alone) — the same
    rule as ``TrainingEngine.export_weights``."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    out, names, shapes, size = [], [], [], 0
    for name, shape in named_shapes:
        nbytes = int(torch.Size(shape).numel()) * element_size
        if names and size + nbytes > bucket_bytes:
            out.append(BucketSpec(tuple(names), tuple(shapes)))
            names, shapes, size = [], [], 0
        names.append(name)
        shapes.append(tuple(int(x) for x in shape))
        size += nbytes
    if names:
        out.append(BucketSpec(tuple(names), tuple(shapes)))
    return tuple(out)


def build_manifest(trainer, *, version: int, bucket_bytes: int, checksum: str | None = None
                   ) -> SyncManifest:
    """The manifest of ``trainer``'s current weights (a ``TrainingEngine`` or any object with
    ``module`` and ``weight_checksum``). Every trainer rank must call it (ZeRO-3 gathers)."""
    from ..engines._deepspeed import full_shape

    params = list(trainer.module.named_parameters())
    if not params:
        raise ValueError("the trainer has no parameters")
    dtype = params[0][1].dtype
    if any(p.dtype != dtype for _, p in params):
        raise ValueError("weight sync needs every parameter in one dtype")
    named_shapes = [(n, tuple(full_shape(p))) for n, p in params]
    buckets = plan_buckets(named_shapes, params[0][1].element_size(), bucket_bytes)
    if checksum is None:
        checksum = trainer.weight_checksum(bucket_bytes)
    return SyncManifest(version=int(version), dtype=str(dtype), checksum=checksum, buckets=buckets)
