"""Weight pieces: the one way engines accept new weights.

``load_weights`` of every engine takes ``{name: tensor}``, ``[(name, tensor), ...]``, flat
buckets ``[(names, flat_1d_tensor), ...]`` as ``TrainingEngine.export_weights`` yields them (each
bucket holds its tensors flattened and concatenated in ``names`` order), or one such bucket on
its own (or one bare ``(name, tensor)``). ``checked_pairs`` turns any of these into ``(name,
tensor)`` pairs and checks all of them before anything is copied — names known, shapes, no name
twice, floating-point and finite values, and, when the caller passes one, the
``polynya.checksum`` of the pieces — so a bad piece leaves the engine untouched. ``FlatBuckets`` (flat buckets with
their layout, as a weight sync stages them) iterate as such pieces; ``BucketCopyPlan`` copies
them with one ``_foreach_copy_`` after checking the layout once.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .checksum import non_finite_views, scan_views

WeightPieces = Any  # Mapping[str, Tensor] | Iterable[(str | Sequence[str], Tensor)] | one bucket



def is_zero3(param: torch.Tensor) -> bool:
    """Whether ``param`` is partitioned by DeepSpeed ZeRO-3 (its ``.data`` is a local shard)."""
    return hasattr(param, "ds_id")


def full_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's full shape (ZeRO-3 keeps it in ``ds_shape``)."""
    return param.ds_shape if is_zero3(param) else param.shape


@dataclass(frozen=True)
class BucketSpec:
    """One flat bucket: ``names`` in order with their ``shapes``.

    Packed layout (``offsets is None``): the tensors back to back, ``numel`` elements in all.
    Span layout: the bucket is a span of ``length`` elements of the trainer's own flat storage
    (ZeRO-1/2 keep every weight as a view of one flat buffer); tensor ``k`` starts at
    ``offsets[k]``; gaps (alignment padding) are ignored.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...] | None = None
    length: int | None = None

    @property
    def numel(self) -> int:
        return self.length if self.length is not None else sum(self.sizes())

    def sizes(self) -> list[int]:
        return [int(torch.Size(s).numel()) for s in self.shapes]

    def starts(self) -> list[int]:
        """Element offset of every tensor inside the bucket."""
        if self.offsets is not None:
            return list(self.offsets)
        out, pos = [], 0
        for n in self.sizes():
            out.append(pos)
            pos += n
        return out

    def views(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` views into ``flat`` (no copy)."""
        return [
            (name, flat[o : o + n].view(shape))
            for name, shape, o, n in zip(self.names, self.shapes, self.starts(), self.sizes())
        ]


def pieces_of(weights: WeightPieces) -> Iterable:
    """The pieces of ``weights``: a mapping's items, a bare ``(name, tensor)`` or ``(names,
    flat)`` tuple as a list of one, or the iterable itself."""
    if isinstance(weights, Mapping):
        return weights.items()
    if isinstance(weights, tuple) and len(weights) == 2 and isinstance(weights[1], torch.Tensor):
        return [weights]
    return weights


def check_known(names, given_shapes, shapes: Mapping[str, torch.Size]) -> None:
    """``ValueError`` unless every name is a known parameter and (when ``given_shapes`` is not
    None) every given shape is that parameter's shape."""
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise ValueError(f"load_weights: unknown parameter{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown[:3]))}")
    for n, s in zip(names, given_shapes or ()):
        if tuple(s) != tuple(shapes[n]):
            raise ValueError(f"load_weights: {n} has shape {tuple(s)}, expected {tuple(shapes[n])}")


def split_piece(piece, shapes: Mapping[str, torch.Size], *,
                check_names: bool = True) -> list[tuple[str, torch.Tensor]]:
    """One ``(name, tensor)`` or ``(names, flat)`` piece -> checked ``(name, tensor)`` pairs.

    Args:
        shapes: full shape of every known parameter.
        check_names: also reject a single ``(name, tensor)`` whose name or shape is unknown
            (a backend that validates names itself passes False).
    """
    if not (isinstance(piece, (tuple, list)) and len(piece) == 2):
        raise ValueError("a weight piece is (name, tensor) or (names, flat tensor)")
    key, tensor = piece
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"weights must be tensors, got {type(tensor).__name__}")
    if isinstance(key, str):
        if check_names:
            check_known([key], [tensor.shape], shapes)
        return [(key, tensor)]
    names = list(key)
    check_known(names, None, shapes)
    sizes = [torch.Size(shapes[n]).numel() for n in names]
    if tensor.dim() != 1 or tensor.numel() != sum(sizes):
        raise ValueError(f"flat bucket of shape {tuple(tensor.shape)} does not hold the {sum(sizes)} "
                         f"elements of its {len(names)} named parameters")
    return [(n, p.view(shapes[n])) for n, p in zip(names, tensor.split(sizes))]


def split_weight_pieces(weights: WeightPieces, shapes: Mapping[str, torch.Size], *,
                        check_names: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Every piece of ``weights`` as checked ``(name, tensor)`` pairs (see ``split_piece``)."""
    return [pair for piece in pieces_of(weights) for pair in split_piece(piece, shapes, check_names=check_names)]


class FlatBuckets:
    """Flat buckets with their layout, as a weight sync stages them.

    ``specs[i]`` (a ``BucketSpec``: ``names``, ``shapes``, ``offsets`` or None,
    ``numel``, ``sizes()``, ``starts()``) describes ``flats[i]``: packed (tensors back to back)
    or a span with element ``offsets``. Iterating gives ordinary pieces (``(names, flat)`` for a
    packed bucket, ``(name, view)`` pairs for a span), so every ``load_weights`` accepts it;
    the native sampler instead copies it through a ``BucketCopyPlan`` kept per layout
    (``key``: any hashable that stands for ``specs``, by default ``specs`` itself).
    """

    __slots__ = ("flats", "key", "specs")

    def __init__(self, specs, flats, key=None):
        self.specs = tuple(specs)
        self.flats = list(flats)
        self.key = self.specs if key is None else key
        if len(self.flats) != len(self.specs):
            raise ValueError(f"{len(self.flats)} flat buckets for {len(self.specs)} bucket specs")

    def __iter__(self):
        for spec, flat in zip(self.specs, self.flats):
            if spec.offsets is None:
                yield list(spec.names), flat
                continue
            if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.numel() != spec.numel:
                raise ValueError(f"flat span of shape {tuple(getattr(flat, 'shape', ()))} is not "
                                 f"the {spec.numel} elements its spec describes")
            for name, shape, o, n in zip(spec.names, spec.shapes, spec.starts(), spec.sizes()):
                yield name, flat[o:o + n].view(shape)


class BucketCopyPlan:
    """Destinations and source splits of ``FlatBuckets`` of one layout, checked once.

    Built from the specs and the engine's parameters: every name must be known, every shape must
    match, every tensor must lie inside its bucket (``ValueError`` otherwise, nothing copied).
    ``sources(flats)`` then only checks each bucket's size and splits it with one
    ``split_with_sizes`` per bucket, so a sync is one ``_foreach_copy_(plan.dst, sources)``.

    ``dst`` are flat views of the parameters (they keep the parameters' storages alive): a plan
    must be dropped when the parameters move (``current()`` is False once any of them was
    re-pointed; engines also drop their plans when they offload or onload weights).
    """

    def __init__(self, specs, params: Mapping[str, torch.Tensor]):
        self.params: list[torch.Tensor] = []
        self.dst: list[torch.Tensor] = []
        self.numels: list[int] = []
        self.splits: list[tuple[list[int], list[int] | None, list[tuple[int, int]] | None]] = []
        self.reshape: list[tuple[int, torch.Size]] = []  # sources viewed to a strided dst's shape
        for i, spec in enumerate(specs):
            names = list(spec.names)
            if len(names) != len(spec.shapes):
                raise ValueError(f"bucket {i}: {len(names)} names but {len(spec.shapes)} shapes")
            check_known(names, spec.shapes, {n: p.shape for n, p in params.items()})
            sizes = [torch.Size(s).numel() for s in spec.shapes]
            starts = list(spec.starts())
            numel = spec.numel
            if any(o < 0 or o + n > numel for o, n in zip(starts, sizes)):
                raise ValueError(f"bucket {i}: a tensor lies outside its {numel} elements")
            self.splits.append(self._split(starts, sizes, numel))
            self.numels.append(numel)
            for n in names:
                p = params[n]
                self.params.append(p)
                if p.is_contiguous():
                    self.dst.append(p.detach().view(-1))
                else:
                    self.reshape.append((len(self.dst), p.shape))
                    self.dst.append(p.detach())
        self.ptrs = [p.data_ptr() for p in self.params]

    @staticmethod
    def _split(starts: list[int], sizes: list[int], numel: int):
        """``(split sizes, kept pieces or None for all, None)`` when the tensors are in order
        without overlap (gaps become dropped pieces); else ``([], None, [(start, size)])``."""
        pos, chunks, keep = 0, [], []
        for o, n in zip(starts, sizes):
            if o < pos:
                return [], None, list(zip(starts, sizes))
            if o > pos:
                chunks.append(o - pos)
            keep.append(len(chunks))
            chunks.append(n)
            pos = o + n
        if pos < numel:
            chunks.append(numel - pos)
        return chunks, (None if len(keep) == len(chunks) else keep), None

    def current(self) -> bool:
        """Whether every parameter is still where the plan's views point."""
        return [p.data_ptr() for p in self.params] == self.ptrs

    def sources(self, flats) -> list[torch.Tensor]:
        """Source tensors matching ``dst`` (``ValueError`` when a bucket has the wrong size)."""
        if len(flats) != len(self.numels):
            raise ValueError(f"{len(flats)} flat buckets for a layout of {len(self.numels)}")
        out: list[torch.Tensor] = []
        for i, (flat, numel, (chunks, keep, spans)) in enumerate(zip(flats, self.numels, self.splits)):
            if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.numel() != numel:
                raise ValueError(f"flat bucket {i} of shape {tuple(getattr(flat, 'shape', ()))} "
                                 f"does not hold the {numel} elements of its layout")
            if spans is not None:
                out += [flat.narrow(0, o, n) for o, n in spans]
                continue
            pieces = flat.split_with_sizes(chunks) if len(chunks) > 1 else (flat,)
            out += pieces if keep is None else [pieces[k] for k in keep]
        for k, shape in self.reshape:
            out[k] = out[k].view(shape)
        return out


def _extremes(t: torch.Tensor) -> torch.Tensor:
    """``[min, max]`` of ``t`` (NaN when it holds one; one read, no copy; float8 is widened
    first: torch has no ``aminmax`` for it)."""
    if t.element_size() == 1:
        t = t.float()
    lo, hi = torch.aminmax(t.reshape(-1) if t.is_contiguous() else t)
    return torch.stack([lo, hi]).float()


def non_finite(pairs: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors holding NaN or inf.

    On CUDA all of them are read by one Triton launch per dtype wherever they lie
    (``polynya.checksum.non_finite_views``). Elsewhere contiguous tensors that are views of
    one storage (a sync's flat bucket) are checked with one ``aminmax`` over the storage range
    they cover; only a range that fails is looked at tensor by tensor (its alignment gaps must
    not count). One device -> host transfer per device."""
    pairs = list(pairs)
    fast = non_finite_views(pairs)
    if fast is not None:
        return fast
    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, t in pairs:
        if t.numel() == 0:
            continue
        key = ((t.untyped_storage().data_ptr(), t.dtype, t.device) if t.is_contiguous()
               else (id(t), t.dtype, t.device))
        groups.setdefault(key, []).append((name, t))
    checks: dict[torch.device, list[tuple[list, torch.Tensor]]] = {}
    for (_, dtype, device), members in groups.items():
        first = members[0][1]
        if len(members) == 1:
            span = first
        else:
            lo = min(t.storage_offset() for _, t in members)
            hi = max(t.storage_offset() + t.numel() for _, t in members)
            span = torch.empty(0, dtype=dtype, device=device).set_(first.untyped_storage(), lo,
                                                                   (hi - lo,))
        checks.setdefault(device, []).append((members, _extremes(span)))
    bad = []
    for items in checks.values():
        ok = torch.isfinite(torch.stack([e for _, e in items])).all(dim=1).tolist()
        for (members, _), fine in zip(items, ok):
            if not fine:
                bad += [n for n, t in members if not torch.isfinite(_extremes(t)).all()]
    return bad


def check_pairs(pairs: list[tuple[str, torch.Tensor]], *, checksum: str | None = None) -> None:
    """``ValueError`` unless there are pieces (a version must not move with nothing loaded), no
    name comes twice, every tensor is floating point and finite, and (when ``checksum`` is
    given) ``polynya.checksum.checksum_named_tensors(pairs)`` equals it. Nothing is copied
    here: engines call it before they touch a weight."""
    if not pairs:
        raise ValueError(NO_WEIGHTS)
    seen: set[str] = set()
    for name, t in pairs:
        if name in seen:
            raise ValueError(f"load_weights: {name!r} is given twice")
        seen.add(name)
        if not t.is_floating_point():
            raise ValueError(f"load_weights: {name} has dtype {t.dtype}; weights are floating point")
    if checksum is not None and not isinstance(checksum, str):
        raise ValueError(f"checksum must be a hex string, got {type(checksum).__name__}")
    if checksum is None:
        bad = non_finite(pairs)
    else:  # one read of the tensors for both on CUDA (``scan_views``)
        got, bad = scan_views(pairs, finite=True)
    if bad:
        raise ValueError(non_finite_error(bad))
    if checksum is not None and got != checksum:
        raise ValueError(checksum_error(got, checksum))


NO_WEIGHTS = "load_weights got no weights: nothing to load (the version stays)"


def non_finite_error(names: list[str]) -> str:
    """The message of a load refused because ``names`` hold NaN or inf."""
    return (f"load_weights: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} "
            "hold NaN or inf; nothing was loaded")


def checksum_error(got: str, expected: str) -> str:
    """The message of a load refused because the weights hash to ``got``, not ``expected``."""
    return (f"checksum mismatch: the weights hash to {got}, the sender's checksum is "
            f"{expected} (corrupted or incomplete); nothing was loaded")


def check_tied(pairs: list[tuple[str, torch.Tensor]], params: Mapping[str, torch.Tensor]) -> None:
    """``ValueError`` when two names of one parameter (tied embeddings: ``params`` from
    ``named_parameters(remove_duplicate=False)``) carry different values: the copy would keep
    the last one silently (an untied trainer's weights loaded into a tied model). Equal values
    pass (a state dict lists a tied parameter under both names)."""
    first: dict[int, tuple[str, torch.Tensor]] = {}
    for name, t in pairs:
        key = id(params[name])
        if key not in first:
            first[key] = (name, t)
            continue
        other, u = first[key]
        if not torch.equal(u, t.to(device=u.device, dtype=u.dtype)):
            raise ValueError(f"load_weights: {other!r} and {name!r} are one tied parameter of this model "
                             "but carry different values (weights of a model with untied embeddings?): "
                             "load them into a model whose config has tie_word_embeddings=False")


def checked_pairs(weights: WeightPieces, shapes: Mapping[str, torch.Size], *,
                  checksum: str | None = None, check_names: bool = True
                  ) -> list[tuple[str, torch.Tensor]]:
    """``split_weight_pieces`` then ``check_pairs``: every check ``load_weights`` makes."""
    pairs = split_weight_pieces(weights, shapes, check_names=check_names)
    check_pairs(pairs, checksum=checksum)
    return pairs
