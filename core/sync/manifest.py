"""What one weight sync carries: a versioned manifest of flat buckets and their checksum.

The trainer side describes a sync before any byte moves::

    manifest = build_manifest(trainer, version=3, bucket_bytes=1 << 28)
    # manifest.buckets[i].names / .shapes / .numel, manifest.dtype, manifest.checksum

Buckets follow ``TrainingEngine.export_weights(bucket_bytes)`` exactly (same grouping of
``named_parameters`` in order), so a receiver can allocate every buffer from the manifest alone.
``checksum`` is the trainer's ``weight_checksum()`` (``polynya.checksum``): the receiver
recomputes it over what it staged and rejects the sync on any difference (``SyncError``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..spans import span_layout
from ..weights import BucketSpec, full_shape

__all__ = ["BucketSpec", "SyncError", "SyncManifest", "build_manifest", "plan_buckets"]


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
        return sum(sum(b.sizes()) for b in self.buckets) * elem  # weight bytes (no span padding)

    def to_dict(self) -> dict:
        def bucket(b: BucketSpec) -> dict:
            d = {"names": list(b.names), "shapes": [list(s) for s in b.shapes]}
            if b.offsets is not None:
                d.update(offsets=list(b.offsets), length=b.length)
            return d

        return {
            "version": self.version,
            "dtype": self.dtype,
            "checksum": self.checksum,
            "buckets": [bucket(b) for b in self.buckets],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "SyncManifest":
        try:
            buckets = tuple(
                BucketSpec(
                    tuple(str(n) for n in b["names"]),
                    tuple(tuple(int(x) for x in s) for s in b["shapes"]),
                    None if b.get("offsets") is None else tuple(int(o) for o in b["offsets"]),
                    None if b.get("length") is None else int(b["length"]),
                )
                for b in d["buckets"]
            )
            out = cls(int(d["version"]), str(d["dtype"]), str(d["checksum"]), buckets)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed sync manifest: {exc}") from None
        for b in out.buckets:
            if len(b.names) != len(b.shapes) or (
                b.offsets is not None and len(b.offsets) != len(b.names)
            ):
                raise ValueError(
                    "malformed sync manifest: names, shapes and offsets differ in length"
                )
            if b.offsets is not None and any(
                o < 0 or o + n > (b.length or 0) for o, n in zip(b.offsets, b.sizes())
            ):
                raise ValueError("malformed sync manifest: a tensor lies outside its bucket span")
        dtype_from_name(out.dtype)
        return out


def plan_buckets(
    named_shapes: list[tuple[str, tuple[int, ...]]], element_size: int, bucket_bytes: int
) -> tuple[BucketSpec, ...]:
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


def flat_spans(module: torch.nn.Module) -> list[tuple[torch.Tensor, BucketSpec]] | None:
    """The module's weights as spans of the flat storages they are views of, or ``None`` when
    they are not (ZeRO-0 / ZeRO-3 keep one storage per tensor). Each span tensor is a view.

    The layout (names, offsets, shapes) is cached per module and checked against the weights'
    current pointers on every call (``polynya.spans``); the spans are always fresh views.
    """
    found = span_layout(module)
    if found is None:
        return None
    layout, spans = found
    return list(zip(spans, layout.specs))


def build_manifest(
    trainer, *, version: int, bucket_bytes: int, layout: str = "packed", checksum: str | None = None,
    ready: bool = True,
) -> SyncManifest:
    """The manifest of ``trainer``'s current weights (a ``TrainingEngine`` or any object with
    ``module``, ``export_weights`` and ``weight_checksum``).

    ``layout="packed"``: buckets as ``export_weights(bucket_bytes)`` packs them (every trainer
    rank must call this under ZeRO-3). ``layout="spans"``: the trainer's own flat storages, no
    packing (falls back to packed when the weights are not views of flat buffers).
    ``ready``: take the checksum the trainer launched right after its last update
    (``TrainingEngine.ready_checksum``, off the sync's path) when it has one; else (or with
    ``ready=False``) it is computed here. The checksum does not depend on the layout.
    """
    if layout not in ("packed", "spans"):
        raise ValueError(f"layout must be 'packed' or 'spans', got {layout!r}")
    found = span_layout(trainer.module) if layout == "spans" else None
    if checksum is None and ready and callable(getattr(trainer, "ready_checksum", None)):
        checksum = trainer.ready_checksum()  # after span_layout: it has seen any move
    if found is not None and found[0].dtype is not None:
        spans_layout, spans = found
        buckets = spans_layout.specs
        dtype = spans_layout.dtype
        if checksum is None:  # the same digest as weight_checksum(), read from the spans in place
            checksum = spans_layout.checksum(spans)
        return SyncManifest(version=int(version), dtype=str(dtype), checksum=checksum,
                            buckets=buckets)
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
