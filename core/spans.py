"""Where a module's weights lie: spans of the few flat storages they are views of (ZeRO-1/2).

``span_layout(module)`` gives ``(layout, spans)`` for the module's current weights, or ``None``
when they are not views of a few flat storages (ZeRO-0 / ZeRO-3 keep one storage per tensor).
Every call walks the module tree (parameter objects and names, without building
``named_parameters()``' strings: a third of its cost) and compares the data pointers, shapes,
strides and dtypes of the weights with the cached ones, so a layout change (offload / onload
re-points the weights, a checkpoint load, a replaced parameter, another model) rebuilds it; a
layout that moved as a whole keeps its digest plan and checksum line prefixes. Nothing cached
holds a tensor of the weights (parameters are held weakly): the span tensors are made afresh
from the parameters' current storages on every call (a cache must not keep a storage alive
across an offload, nor serve views of a storage that is gone). The engines checksum their
weights through it (``polynya.checksum``) and a weight sync shares the spans as its buckets
(``polynya.sync``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch

from .checksum import DigestPlan, checksum_lines, signature_prefix
from .weights import BucketSpec, is_zero3


def _walk(module: torch.nn.Module, keys: list, slots: list) -> None:
    """Every parameter slot of ``module``'s tree in ``named_parameters`` order (``None`` and
    shared ones included) into ``slots``, and the tree's shape into ``keys``: per module its
    parameter and child counts, then their names. Equal ``keys`` and the same objects in
    ``slots`` mean the same ``named_parameters()`` (names and tensors), at a fraction of its
    cost (no name strings are built)."""
    ps, ms = module._parameters, module._modules
    keys.append(len(ps))
    keys.append(len(ms))
    keys.extend(ps)
    keys.extend(ms)
    slots.extend(ps.values())
    for child in ms.values():
        if child is not None:
            _walk(child, keys, slots)


def _fast_key(params: Sequence[torch.Tensor]) -> tuple:
    """Where each weight lies: data pointers, shapes, strides, dtypes."""
    return ([p.data_ptr() for p in params], [p.shape for p in params],
            [p.stride() for p in params], [p.dtype for p in params])


def _none() -> None:
    return None


def _ref(p):
    return _none if p is None else weakref.ref(p)


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

    def same_as(self, other: SpanLayout) -> bool:
        """Whether ``other`` names the same tensors at the same offsets of alike storages."""
        return (self.names == other.names and self.specs == other.specs
                and self.groups == other.groups and self.dtype == other.dtype)

    @property
    def seen(self) -> tuple:
        """Where the parameters last seen lay (pass it to ``recheck`` later)."""
        return self._fast

    def recheck(self, seen: tuple | None = None) -> list[torch.Tensor] | None:
        """The spans again for the parameters last seen, if they are all alive and still where
        they were (``data_ptr``, shape, strides, dtype), or where ``seen`` (an earlier
        ``.seen``) says they were; ``None`` otherwise. It does not see parameters replaced in
        the module (``span_layout`` does)."""
        params = [r() for r in self._refs]
        if any(p is None for p in params) or _fast_key(params) != (seen or self._fast):
            return None
        return self.spans(params)


_SPAN_LAYOUTS: weakref.WeakKeyDictionary[torch.nn.Module, _Seen] = weakref.WeakKeyDictionary()
_SPAN_LOCK = threading.Lock()


class _Seen:
    """What ``span_layout`` last saw of one module: its tree (``_walk``), its parameters
    (weakly: nothing here keeps a weight alive), where they lay, and their layout."""

    __slots__ = ("fast", "layout", "names", "params", "slots", "tree")

    def __init__(self, tree: list, slots: list, named: list, fast: tuple,
                 layout: SpanLayout | None):
        self.tree = tree
        self.slots = [_ref(p) for p in slots]
        self.names = [n for n, _ in named]
        self.params = [weakref.ref(p) for _, p in named]
        self.fast = fast
        self.layout = layout

    def same_tree(self, tree: list, slots: list) -> bool:
        return (tree == self.tree and len(slots) == len(self.slots)
                and all(r() is p for r, p in zip(self.slots, slots)))


def span_layout(module: torch.nn.Module) -> tuple[SpanLayout, list[torch.Tensor]] | None:
    """``(layout, spans)`` of ``module``'s current weights, or ``None`` when they are not views
    of a few flat storages. Cached per module: every call walks the module tree (names and
    parameter objects, without building ``named_parameters``' strings) and compares where each
    weight lies (``data_ptr``, shape, strides, dtype); any difference builds the layout
    again (reusing the previous one when the offsets came out the same)."""
    tree, slots = [], []
    _walk(module, tree, slots)
    with _SPAN_LOCK:
        seen = _SPAN_LAYOUTS.get(module)
    if seen is not None and seen.same_tree(tree, slots):
        params = [r() for r in seen.params]  # alive: they are in the slots
        named = list(zip(seen.names, params))
        fast = _fast_key(params)
        if fast == seen.fast:
            layout = seen.layout
            if layout is None:
                return None
            spans = layout.spans(params)
            if spans is not None:
                return layout, spans
            # same pointers but a storage no longer covers its span: build it again
    else:
        named = list(module.named_parameters())
        params = [p for _, p in named]
        fast = _fast_key(params)
    if not named:
        return None
    layout = SpanLayout.build(named)
    old = seen.layout if seen is not None else None
    if layout is not None and old is not None and old.same_as(layout):
        old.remember(params, fast)  # moved as a whole (offload / onload): keep plan + prefixes
        layout = old
    with _SPAN_LOCK:
        _SPAN_LAYOUTS[module] = _Seen(tree, slots, named, fast, layout)  # None: "not spans"
    spans = layout.spans(params) if layout is not None else None
    return (layout, spans) if spans is not None else None


def cached_layout(module: torch.nn.Module) -> SpanLayout | None:
    """The layout the last ``span_layout(module)`` call found (``None``: none, or not spans);
    no check of the weights."""
    with _SPAN_LOCK:
        seen = _SPAN_LAYOUTS.get(module)
    return seen.layout if seen is not None else None


def export_spans(module: torch.nn.Module, buckets: tuple[BucketSpec, ...]
                 ) -> list[torch.Tensor] | None:
    """The span tensors of a span manifest's ``buckets`` (``None`` when the module's weights no
    longer have that layout). Right after ``build_manifest`` this re-checks only the pointers
    and shapes of the parameters it saw, not the whole module."""
    with _SPAN_LOCK:
        hit = _SPAN_LAYOUTS.get(module)
    layout = hit.layout if hit is not None else None
    if layout is not None and (layout.specs is buckets or layout.specs == buckets):
        spans = layout.recheck()
        if spans is not None:
            return spans
    found = span_layout(module)
    if found is None or found[0].specs != buckets:
        return None
    return found[1]
