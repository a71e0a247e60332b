"""Where a module's weights lie: spans of the few flat storages they are views of (ZeRO-1/2).

``span_layout(module)`` gives ``(layout, spans)`` for the module's current weights, or ``None``
when they are not views of a few flat storages (ZeRO-0 / ZeRO-3 keep one storage per tensor).
Every call walks ``named_parameters()`` and compares a key of names, data pointers, shapes,
dtypes and contiguity with the cached one, so a layout change (offload / onload re-points the
weights, a checkpoint load, another model) rebuilds it. Nothing cached holds a tensor of the
weights: the span tensors are made afresh from the parameters' current storages on every call
(a cache must not keep a storage alive across an offload, nor serve views of a storage that
is gone). The engines checksum their weights through it (``polynya.checksum``) and a weight
sync shares the spans as its buckets (``polynya.sync``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch

from .checksum import DigestPlan, checksum_lines, signature_prefix
from .weights import BucketSpec, is_zero3


def _param_key(named: list[tuple[str, torch.Tensor]]) -> tuple:
    return (
        tuple(n for n, _ in named),
        tuple(p.data_ptr() for _, p in named),
        tuple(p.shape for _, p in named),
        tuple(p.dtype for _, p in named),
        tuple(p.is_contiguous() for _, p in named),
        named[0][1].device if named else None,
    )


def _fast_key(params: Sequence[torch.Tensor]) -> tuple:
    return tuple(p.data_ptr() for p in params), tuple(p.shape for p in params)


class SpanLayout:
    """A module's weights as spans of flat storages (see ``flat_spans``), per layout."""

    def __init__(self, names: tuple[str, ...], groups: list, specs: tuple[BucketSpec, ...],
                 dtype: torch.dtype | None, params: Sequence[torch.Tensor]):
        self.names = names
        self.groups = groups  # per storage: (index of its lowest member, length, dtype)
        self.specs = specs
        self.dtype = dtype  # the weights' one dtype, or None when they differ
        self.plan = DigestPlan([(s.offsets, s.sizes()) for s in specs])
        self.prefixes = [signature_prefix(n, d, shape) for s, (_, _, d) in zip(specs, groups)
                         for n, shape in zip(s.names, s.shapes)]
        self.remember(params)

    def remember(self, params: Sequence[torch.Tensor], fast: tuple | None = None) -> None:
        """The parameters the layout was last seen with (weak: the export's quick re-check)."""
        self._refs = [weakref.ref(p) for p in params]
        self._fast = _fast_key(params) if fast is None else fast

    @classmethod
    def build(cls, named: list[tuple[str, torch.Tensor]]) -> SpanLayout | None:
        if not named or any(is_zero3(p) or not p.is_contiguous() for _, p in named):
            return None
        by_storage: dict[int, list[tuple[int, str, torch.Tensor]]] = {}
        for i, (name, p) in enumerate(named):
            by_storage.setdefault(p.untyped_storage().data_ptr(), []).append((i, name, p))
        if len(by_storage) > max(4, len(named) // 8):
            return None
        groups, specs = [], []
        for members in by_storage.values():
            members.sort(key=lambda m: m[2].storage_offset())
            first = members[0][2]
            if any(p.dtype != first.dtype for _, _, p in members):
                return None
            lo = first.storage_offset()
            ends = [p.storage_offset() + p.numel() for _, _, p in members]
            if any(e > members[k + 1][2].storage_offset() for k, e in enumerate(ends[:-1])):
                return None  # overlapping views (tied weights stored twice?): pack instead
            hi = max(ends)
            groups.append((members[0][0], hi - lo, first.dtype))
            specs.append(BucketSpec(
                tuple(n for _, n, _ in members),
                tuple(tuple(p.shape) for _, _, p in members),
                tuple(p.storage_offset() - lo for _, _, p in members),
                hi - lo,
            ))
        dtypes = {p.dtype for _, p in named}
        return cls(tuple(n for n, _ in named), groups, tuple(specs),
                   dtypes.pop() if len(dtypes) == 1 else None, [p for _, p in named])

    def spans(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """One span tensor per storage, made from ``params``' current storages (``None`` when a
        storage no longer covers its span: the layout must be rebuilt)."""
        out = []
        for first_index, length, dtype in self.groups:
            first = params[first_index]
            storage, lo = first.untyped_storage(), first.storage_offset()
            if storage.nbytes() < (lo + length) * first.element_size():
                return None
            with torch.no_grad():
                out.append(torch.empty(0, dtype=dtype, device=first.device).set_(
                    storage, lo, (length,)))
        return out

    def checksum(self, spans: Sequence[torch.Tensor]) -> str:
        """``checksum_named_tensors`` of the weights, read from the spans in place."""
        return checksum_lines(self.prefixes, self.plan.digests(spans))

    def recheck(self) -> list[torch.Tensor] | None:
        """The spans again for the parameters last seen, if they are all alive and still where
        they were (``data_ptr`` and shape); ``None`` otherwise."""
        params = [r() for r in self._refs]
        if any(p is None for p in params) or _fast_key(params) != self._fast:
            return None
        return self.spans(params)


_SPAN_LAYOUTS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()
_SPAN_LOCK = threading.Lock()


def span_layout(module: torch.nn.Module) -> tuple[SpanLayout, list[torch.Tensor]] | None:
    """``(layout, spans)`` of ``module``'s current weights, or ``None`` when they are not views
    of a few flat storages. The layout is cached per module and rebuilt when its key changes."""
    named = list(module.named_parameters())
    if not named:
        return None
    key = _param_key(named)
    params = [p for _, p in named]
    with _SPAN_LOCK:
        hit = _SPAN_LAYOUTS.get(module)
    if hit is not None and hit[0] == key:
        layout = hit[1]
        spans = layout.spans(params) if layout is not None else None
        if spans is not None:
            if any(a is not r() for a, r in zip(params, layout._refs)):
                layout.remember(params, (key[1], key[2]))
            return layout, spans
        if layout is None:
            return None
        # same pointers but a storage no longer covers its span: look at the weights again
    layout = SpanLayout.build(named)
    with _SPAN_LOCK:
        _SPAN_LAYOUTS[module] = (key, layout)  # None is cached too: "not spans"
    spans = layout.spans(params) if layout is not None else None
    return (layout, spans) if spans is not None else None


def export_spans(module: torch.nn.Module, buckets: tuple[BucketSpec, ...]
                 ) -> list[torch.Tensor] | None:
    """The span tensors of a span manifest's ``buckets`` (``None`` when the module's weights no
    longer have that layout). Right after ``build_manifest`` this re-checks only the pointers
    and shapes of the parameters it saw, not the whole module."""
    with _SPAN_LOCK:
        hit = _SPAN_LAYOUTS.get(module)
    layout = hit[1] if hit is not None else None
    if layout is not None and (layout.specs is buckets or layout.specs == buckets):
        spans = layout.recheck()
        if spans is not None:
            return spans
    found = span_layout(module)
    if found is None or found[0].specs != buckets:
        return None
    return found[1]
