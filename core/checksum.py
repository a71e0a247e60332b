"""The weight checksum: the one definition, and every fast way to compute it.

``checksum_named_tensors(items)`` is a short hex digest of named tensors — their names, dtypes,
shapes and exact bits — independent of the order of ``items``. Each tensor contributes one
line ``name|dtype|shape|digest`` (``tensor_signature``) where ``digest`` is
``polynya.kernels.digest``'s keyed per-position hash mix of its raw bits (any single changed,
swapped or moved value, or ``+k/-k`` pair, changes it with probability ``1 - ~2**-64``); the
sorted lines are hashed with sha256. Every engine's ``weight_checksum()``, every sync manifest
and every ``load_weights(..., checksum=...)`` use this value.

Fast paths give the same value without a second copy of the weights:

- ``checksum_views(items)``: CUDA tensors wherever they lie (one storage each, as a model's
  parameters, or views of a few) digested in place by the Triton kernels in one launch per
  dtype plus one, one device -> host transfer (``polynya.kernels.digest.scatter``); with
  ``scan_views`` the same read also finds NaN/inf (``non_finite_views``: only that);
- ``checksum_packed(buckets, shapes)``: ``(names, flat)`` buckets as ``export_weights`` yields;
- ``specs_checksum(specs, dtype, flats)``: flat buckets described by bucket specs (a weight
  sync's manifest), with the digest plan and line prefixes cached per layout;
- ``PendingChecksum``: the same digests launched on a side CUDA stream ahead of time (a
  trainer's weights right after its update), collected later.
"""
from __future__ import annotations

import hashlib
import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import torch

from .kernels.digest import DigestPlan, tensor_digest
from .kernels.digest import op as digest_op
from .kernels.digest.copy import non_finite_count
from .kernels.digest.op import have_triton
from .kernels.digest.scatter import ScatterPlan, layout_key

__all__ = [
    "DigestPlan", "PendingChecksum", "cached_plan", "checksum_lines", "checksum_named_tensors", "checksum_packed",
    "checksum_views", "combine_signatures", "gather", "non_finite_views", "scan_views",
    "signature_prefix", "specs_checksum",
    "tensor_digest", "tensor_signature",
]


def signature_prefix(name: str, dtype: torch.dtype, shape) -> str:
    """A checksum line up to its digest: ``tensor_signature`` is this prefix + the digest (fast
    paths build the prefixes once per weight layout and add the digests per call)."""
    return f"{name}|{dtype}|{tuple(int(x) for x in shape)}|"


def tensor_signature(name: str, t: torch.Tensor) -> str:
    """One line of the checksum: name, dtype, shape and ``tensor_digest``."""
    return signature_prefix(name, t.dtype, t.shape) + str(tensor_digest(t))


def combine_signatures(signatures: Iterable[str]) -> str:
    """Order-independent hex digest of ``tensor_signature`` lines."""
    return hashlib.sha256("\n".join(sorted(signatures)).encode()).hexdigest()[:32]


def checksum_lines(prefixes: Sequence[str], digests: Sequence[int]) -> str:
    """``combine_signatures`` of ``signature_prefix`` lines completed by their digests."""
    return combine_signatures([p + str(d) for p, d in zip(prefixes, digests)])


def checksum_named_tensors(items: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Hex digest of named tensors: their names, dtypes, shapes and exact bits (module
    docstring). Independent of the order of ``items``, so engines that store their weights
    differently agree as long as each named tensor is identical."""
    return combine_signatures(tensor_signature(name, t) for name, t in items)


_PLANS: OrderedDict = OrderedDict()  # (starts, lengths) -> DigestPlan, for ad-hoc callers
_PLANS_LOCK = threading.Lock()


def cached_plan(starts: Sequence[int], lengths: Sequence[int]) -> DigestPlan:
    """A one-group ``DigestPlan``, cached (a model's layout repeats from call to call)."""
    key = (tuple(int(s) for s in starts), tuple(int(n) for n in lengths))
    with _PLANS_LOCK:
        plan = _PLANS.get(key)
        if plan is not None:
            _PLANS.move_to_end(key)
            return plan
    plan = DigestPlan([key])
    with _PLANS_LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > 64:
            _PLANS.popitem(last=False)
    return plan


def gather(digests: Sequence[torch.Tensor]) -> list[int]:
    """``DigestPlan.digest_tensor`` results as one list of ints (one device -> host transfer)."""
    if not digests:
        return []
    if len({d.device for d in digests}) == 1:
        return torch.cat(list(digests)).tolist()
    return [v for d in digests for v in d.tolist()]


class _ViewsLayout:
    """A ``ScatterPlan`` of named tensors with their checksum line prefixes (per layout)."""

    __slots__ = ("names", "plan", "prefixes")

    def __init__(self, items: Sequence[tuple[str, torch.Tensor]]):
        self.plan = ScatterPlan([t for _, t in items])
        self.prefixes = [signature_prefix(n, t.dtype, t.shape) for n, t in items]
        self.names = [n for n, _ in items]


_VIEWS: OrderedDict = OrderedDict()  # names + layout_key -> _ViewsLayout
_VIEWS_LOCK = threading.Lock()


def _views_layout(items: Sequence[tuple[str, torch.Tensor]]) -> tuple[_ViewsLayout, tuple] | None:
    """The cached ``_ViewsLayout`` of ``items`` and the tensors' ``layout_key`` when the Triton
    path can read them (one CUDA device, or any device with ``KERNEL_ON_CPU``), else None. The
    cache key (names + layout key: addresses, dtypes, shapes, contiguity, devices) reads no
    tensor data."""
    if not items or not have_triton():
        return None
    dev = items[0][1].device
    if not (dev.type == "cuda" or digest_op.KERNEL_ON_CPU):
        return None
    tensors_key = layout_key([t for _, t in items])
    key = (tuple(n for n, _ in items), tensors_key)
    with _VIEWS_LOCK:
        found = _VIEWS.get(key)
        if found is not None:
            _VIEWS.move_to_end(key)
            return found, tensors_key
    if any(t.device != dev for _, t in items):
        return None
    found = _ViewsLayout(items)
    with _VIEWS_LOCK:
        _VIEWS[key] = found
        while len(_VIEWS) > 8:
            _VIEWS.popitem(last=False)
    return found, tensors_key


def scan_views(items: Sequence[tuple[str, torch.Tensor]], *, finite: bool = True
               ) -> tuple[str, list[str]]:
    """``(checksum_named_tensors(items), names of the tensors holding NaN/inf)`` (the second
    empty unless ``finite``). On CUDA every tensor, wherever it lies (one storage each, as a
    model's parameters), is read once by the Triton kernels: one launch per dtype, one for the
    per-tensor sums, one device -> host transfer; the layout's tables and line prefixes are
    cached. Elsewhere the torch reference, tensor by tensor."""
    items = list(items)
    found = _views_layout(items)
    if found is None:
        bad = [n for n, t in items if t.numel() and int(non_finite_count(t))] if finite else []
        return checksum_named_tensors(items), bad
    layout, key = found
    digests, bad = layout.plan.scan([t for _, t in items], finite=finite, key=key)
    values = (torch.cat([digests, bad]) if finite else digests).tolist()
    n = len(items)
    bad_names = [name for name, b in zip(layout.names, values[n:]) if b]
    return checksum_lines(layout.prefixes, values[:n]), bad_names


def checksum_views(items: Sequence[tuple[str, torch.Tensor]]) -> str:
    """``checksum_named_tensors(items)``; on CUDA in O(1) launches (``scan_views``)."""
    return scan_views(items, finite=False)[0]


def non_finite_views(items: Sequence[tuple[str, torch.Tensor]]) -> list[str] | None:
    """Names of the tensors of ``items`` holding NaN/inf, read by the Triton kernels in one
    launch per dtype; None when they cannot take that path (the caller checks with torch)."""
    items = list(items)
    found = _views_layout(items)
    if found is None:
        return None
    layout, key = found
    _, bad = layout.plan.scan([t for _, t in items], digest=False, finite=True, key=key)
    return [name for name, b in zip(layout.names, bad.tolist()) if b]


def checksum_packed(buckets: Iterable[tuple[Sequence[str], torch.Tensor]],
                    shapes: Mapping[str, torch.Size]) -> str:
    """The checksum of ``(names, flat)`` buckets (each tensor flattened, back to back, with its
    shape in ``shapes``); on CUDA no host sync until the end."""
    prefixes, digests = [], []
    for names, flat in buckets:
        sizes = [torch.Size(shapes[n]).numel() for n in names]
        starts = [0, *itertools.accumulate(sizes)][:-1]
        digests.append(cached_plan(starts, sizes).digest_tensor([flat]))
        prefixes += [signature_prefix(n, flat.dtype, shapes[n]) for n in names]
    return checksum_lines(prefixes, gather(digests))


class PendingChecksum:
    """A checksum whose digests run on a side CUDA ``stream``, queued behind the work already on
    the current stream, without a host sync. ``result()`` collects it (one device -> host
    transfer); ``wait()`` makes the current stream wait for the digests (call it before the
    digested tensors change or are freed)."""

    def __init__(self, plan: DigestPlan, prefixes: Sequence[str], flats: Sequence[torch.Tensor],
                 stream: torch.cuda.Stream):
        stream.wait_stream(torch.cuda.current_stream(flats[0].device))
        with torch.cuda.stream(stream):
            self._digests = plan.digest_tensor(flats, kernel=True)
            self._done = torch.cuda.Event()
            self._done.record(stream)
        self._prefixes = list(prefixes)
        self._value: str | None = None

    def wait(self) -> None:
        torch.cuda.current_stream(self._digests.device).wait_event(self._done)

    def result(self) -> str:
        if self._value is None:
            self.wait()
            self._value = checksum_lines(self._prefixes, self._digests.tolist())
        return self._value


class _SpecDigest:
    """Digest plan and line prefixes of flat buckets described by specs (``names``,
    ``shapes``, ``starts()``, ``sizes()``), in one dtype."""

    def __init__(self, specs, dtype: torch.dtype):
        self.plan = DigestPlan([(s.starts(), s.sizes()) for s in specs])
        self.prefixes = [signature_prefix(n, dtype, shape) for s in specs
                         for n, shape in zip(s.names, s.shapes)]


_SPECS: OrderedDict = OrderedDict()
_SPECS_LOCK = threading.Lock()


def specs_checksum(specs: Sequence, dtype: torch.dtype, flats: Sequence[torch.Tensor]) -> str:
    """The checksum of the tensors that ``specs`` place in ``flats`` (plan and prefixes cached
    by the specs' value; ``ValueError`` when a flat is too short for its spec)."""
    key = (tuple(specs), dtype)
    with _SPECS_LOCK:
        found = _SPECS.get(key)
        if found is not None:
            _SPECS.move_to_end(key)
    if found is None:
        found = _SpecDigest(specs, dtype)
        with _SPECS_LOCK:
            _SPECS[key] = found
            while len(_SPECS) > 8:
                _SPECS.popitem(last=False)
    return checksum_lines(found.prefixes, found.plan.digests(flats))
