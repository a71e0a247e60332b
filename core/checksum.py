"""The weight checksum: the one definition, and every fast way to compute it.

``checksum_named_tensors(items)`` is a short hex digest of named tensors — their names, dtypes,
shapes and exact bits — independent of the order of ``items``. Each tensor contributes one
line ``name|dtype|shape|digest`` (``tensor_signature``) where ``digest`` is
``polynya.kernels.digest``'s keyed per-position hash mix of its raw bits (any single changed,
swapped or moved value, or ``+k/-k`` pair, changes it with probability ``1 - ~2**-64``); the
sorted lines are hashed with sha256. Every engine's ``weight_checksum()``, every sync manifest
and every ``load_weights(..., checksum=...)`` use this value.

Fast paths give the same value without a second copy of the weights:

- ``checksum_views(items)``: tensors that are views of a few CUDA storages are digested in
  place by the Triton kernels, one device -> host transfer;
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
from .kernels.digest.op import MAX_TENSOR, have_triton

__all__ = [
    "DigestPlan", "PendingChecksum", "cached_plan", "checksum_lines", "checksum_named_tensors", "checksum_packed",
    "checksum_views", "combine_signatures", "gather", "signature_prefix", "specs_checksum",
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


def checksum_views(items: Sequence[tuple[str, torch.Tensor]]) -> str:
    """``checksum_named_tensors(items)``; fast when the tensors are views of a few CUDA storages."""
    items = list(items)
    if not items or not have_triton() or not all(
        t.is_cuda and t.is_contiguous() and t.numel() < MAX_TENSOR for _, t in items
    ):
        return checksum_named_tensors(items)
    groups: dict[tuple[int, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, t in items:
        groups.setdefault((t.untyped_storage().data_ptr(), t.dtype), []).append((name, t))
    prefixes, digests = [], []
    for members in groups.values():
        first = members[0][1]
        size = first.untyped_storage().nbytes() // first.element_size()
        flat = torch.empty(0, dtype=first.dtype, device=first.device).set_(
            first.untyped_storage(), 0, (size,))
        plan = cached_plan([t.storage_offset() for _, t in members], [t.numel() for _, t in members])
        digests.append(plan.digest_tensor([flat], kernel=True))
        prefixes += [signature_prefix(n, t.dtype, t.shape) for n, t in members]
    return checksum_lines(prefixes, gather(digests))


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
