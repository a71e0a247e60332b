"""Receiver side of a weight sync: a manifest's buckets checked once per *layout*.

``bucket_layout(manifest)``: the manifest's buckets checked once (names, shapes and offsets
agree, every tensor inside its bucket), cached by the buckets' value; its ``checksum(flats)``
is ``polynya.checksum.specs_checksum`` (digest plan and line prefixes cached per layout too),
so a sync only launches the digest and the copy. The trainer side (where a module's weights
lie) is ``polynya.spans``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from ..checksum import specs_checksum
from .manifest import BucketSpec, SyncError, SyncManifest


class BucketLayout:
    """A manifest's buckets, checked once (offsets inside their bucket), in its dtype."""

    def __init__(self, buckets: tuple[BucketSpec, ...], dtype: torch.dtype):
        for i, b in enumerate(buckets):
            sizes = b.sizes()
            if len(b.names) != len(b.shapes) or (
                b.offsets is not None and len(b.offsets) != len(b.names)
            ):
                raise SyncError(f"malformed manifest: bucket {i}'s names, shapes and offsets "
                                "differ in length")
            if b.offsets is not None and any(
                o < 0 or o + n > b.numel for o, n in zip(b.offsets, sizes)
            ):
                raise SyncError(f"malformed manifest: a tensor lies outside bucket {i}")
        self.buckets = buckets
        self.dtype = dtype

    def checksum(self, flats: Sequence[torch.Tensor]) -> str:
        """``polynya.checksum`` of the tensors the buckets place in ``flats``."""
        return specs_checksum(self.buckets, self.dtype, flats)


_BUCKET_LAYOUTS: OrderedDict = OrderedDict()
_BUCKET_LOCK = threading.Lock()


def bucket_layout(manifest: SyncManifest) -> BucketLayout:
    """The ``BucketLayout`` of ``manifest`` (cached by buckets and dtype; ``SyncError`` when
    the manifest is malformed)."""
    dtype = manifest.torch_dtype
    key = (manifest.buckets, dtype)
    with _BUCKET_LOCK:
        layout = _BUCKET_LAYOUTS.get(key)
        if layout is not None:
            _BUCKET_LAYOUTS.move_to_end(key)
            return layout
    layout = BucketLayout(manifest.buckets, dtype)
    with _BUCKET_LOCK:
        _BUCKET_LAYOUTS[key] = layout
        while len(_BUCKET_LAYOUTS) > 8:
            _BUCKET_LAYOUTS.popitem(last=False)
    return layout
