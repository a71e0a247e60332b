"""Verified bucket loads: a weight sync's flat buckets checked in one read, then copied.

``VerifiedBucketCopy(specs, params, dtype)`` is made once per layout (a sync's manifest against
an engine's parameters) and checks everything that does not change between syncs: names known,
shapes equal, no name twice, every tensor inside its bucket, destinations contiguous in the
buckets' dtype (``fits`` is False otherwise and the engine keeps its general path). Per sync,
``load(flats, checksum)`` runs

1. one *check* pass (``polynya.kernels.digest.copy.CopyPlan.check``: one launch per bucket
   plus one for the per-tensor sums): every tensor's digest and non-finite count, one read of
   the buckets, nothing written;
2. one device -> host transfer of those numbers; the checksum lines (prefixes made once per
   layout) are hashed and compared with the sender's checksum; any NaN/inf or a mismatch
   raises ``ValueError`` here, *before* anything is written;
3. one *copy* pass (one launch per bucket, the buckets' bytes into the parameters).

Engines keep their plans in a dict and load through ``load_verified`` (the native sampler
and the ZeRO-0 log-prob engine): one plan per engine (``verified_plan``), made again when the
layout changes or the parameters move.

Why two passes and not one copy that digests as it writes: the destination is the engine's
live parameters (a native sampler's CUDA graphs are captured against their addresses, so
they cannot be swapped for a staging copy), and a failed sync must leave them untouched. A
single pass would either write unverified bytes into the live weights (a mismatch found
afterwards could not be undone: the previous version exists nowhere else) or need a second
full weight buffer and a pointer swap. The check pass reads the bytes once, the copy pass
reads and writes them once: 3 weight-sizes of traffic against the 4 of the general path
(finite check, digest, copy) and 2 + 2·(#buckets) launches instead of ~3 + a multi-tensor copy.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence

import torch

from .checksum import checksum_lines, signature_prefix
from .kernels.digest.copy import CopyPlan
from .weights import NO_WEIGHTS, FlatBuckets, check_known, checksum_error, non_finite_error


class VerifiedBucketCopy:
    """Flat buckets of one layout into ``params``: checked (checksum, finite) then copied."""

    def __init__(self, specs, params: Mapping[str, torch.Tensor], dtype: torch.dtype):
        names = [n for s in specs for n in s.names]
        if not names:
            raise ValueError(NO_WEIGHTS)
        if len(set(names)) != len(names):
            twice = next(n for i, n in enumerate(names) if n in names[:i])
            raise ValueError(f"load_weights: {twice!r} is given twice")
        groups, self.numels = [], []
        for i, spec in enumerate(specs):
            if len(spec.names) != len(spec.shapes):
                raise ValueError(f"bucket {i}: {len(spec.names)} names but "
                                 f"{len(spec.shapes)} shapes")
            check_known(spec.names, spec.shapes, {n: p.shape for n, p in params.items()})
            starts, sizes = list(spec.starts()), spec.sizes()
            if any(o < 0 or o + n > spec.numel for o, n in zip(starts, sizes)):
                raise ValueError(f"bucket {i}: a tensor lies outside its {spec.numel} elements")
            groups.append((starts, sizes, [params[n].detach() for n in spec.names]))
            self.numels.append(spec.numel)
        self.dtype = dtype
        self.params = [params[n] for n in names]
        self.ptrs = [p.data_ptr() for p in self.params]
        # two names of one (tied) parameter: the checked path compares their values instead
        self.fits = dtype.is_floating_point and len({id(p) for p in self.params}) == len(self.params) and all(
            p.dtype == dtype and p.is_contiguous() for p in self.params)
        self.plan = CopyPlan([(st, sz, [d.view(-1) for d in ds]) for st, sz, ds in groups]
                             if self.fits else [(st, sz, None) for st, sz, _ in groups])
        self.names = names
        self.prefixes = [signature_prefix(n, dtype, shape) for s in specs
                         for n, shape in zip(s.names, s.shapes)]

    def current(self) -> bool:
        """Whether every parameter is still where the plan's destinations point."""
        return [p.data_ptr() for p in self.params] == self.ptrs

    def _check_flats(self, flats: Sequence[torch.Tensor]) -> None:
        if len(flats) != len(self.numels):
            raise ValueError(f"{len(flats)} flat buckets for a layout of {len(self.numels)}")
        for i, (flat, numel) in enumerate(zip(flats, self.numels)):
            if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.numel() != numel:
                raise ValueError(f"flat bucket {i} of shape {tuple(getattr(flat, 'shape', ()))} "
                                 f"does not hold the {numel} elements of its layout")
            if flat.dtype != self.dtype:
                raise ValueError(f"flat bucket {i} has dtype {flat.dtype}; the layout's is "
                                 f"{self.dtype}")

    def verify(self, flats: Sequence[torch.Tensor], checksum: str) -> None:
        """``ValueError`` (nothing written) unless the buckets hold finite values only and hash
        to ``checksum``; one read of the buckets, one device -> host transfer."""
        if not isinstance(checksum, str):
            raise ValueError(f"checksum must be a hex string, got {type(checksum).__name__}")
        self._check_flats(flats)
        digests, bad = self.plan.check(flats)
        values = torch.cat([digests, bad]).tolist()
        count = len(self.names)
        if any(values[count:]):
            raise ValueError(non_finite_error(
                [n for n, b in zip(self.names, values[count:]) if b]))
        got = checksum_lines(self.prefixes, values[:count])
        if got != checksum:
            raise ValueError(checksum_error(got, checksum))

    def load(self, flats: Sequence[torch.Tensor], checksum: str, *, checked: bool = False
             ) -> None:
        """``verify`` then copy every tensor into its parameter (one launch per bucket).
        ``checked``: the caller has just seen ``current()`` be True (skips the second look)."""
        if not self.fits:
            raise ValueError("these parameters cannot take a verified bucket copy (dtype or "
                             "layout differs); use the general load_weights path")
        if not checked and not self.current():
            raise ValueError("the parameters moved since this plan was made; make a new one")
        self.verify(flats, checksum)
        with torch.no_grad():
            self.plan.copy(flats)


def verified_plan(plans: MutableMapping, weights: FlatBuckets,
                  params: Callable[[], Mapping[str, torch.Tensor]]) -> VerifiedBucketCopy | None:
    """The ``VerifiedBucketCopy`` for ``weights``' layout, kept in an engine's ``plans`` (one
    at a time: a plan holds the parameters, so an older one is dropped); made again when the
    layout or the buckets' dtype changes or ``current()`` is False. ``params()`` gives the
    engine's ``{name: parameter}`` (tied aliases included). None when the buckets are not
    tensors or the parameters cannot take the path (dtype, layout, tied names): the engine's
    general path applies. ``ValueError`` (nothing copied) when the layout names an unknown
    weight or a wrong shape."""
    flats = weights.flats
    if not flats or not isinstance(flats[0], torch.Tensor):
        return None
    key = ("verified", weights.key, flats[0].dtype)
    plan = plans.get(key)
    if plan is None or not plan.current():
        plan = VerifiedBucketCopy(weights.specs, params(), flats[0].dtype)
        for old in [k for k, p in plans.items() if isinstance(p, VerifiedBucketCopy)]:
            del plans[old]
        plans[key] = plan
    return plan if plan.fits else None


def load_verified(plans: MutableMapping, weights, checksum: str | None,
                  params: Callable[[], Mapping[str, torch.Tensor]]) -> bool:
    """Load ``weights`` through the layout's plan when they are a sync's ``FlatBuckets`` with a
    ``checksum`` that the parameters can take (``verified_plan``); True when it did (checked,
    then copied), False when the engine's general path applies (nothing was done).
    ``ValueError`` with nothing written on a mismatch, NaN/inf or a layout that does not fit."""
    if not isinstance(weights, FlatBuckets) or checksum is None:
        return False
    plan = verified_plan(plans, weights, params)
    if plan is None:
        return False
    plan.load(weights.flats, checksum, checked=True)  # current(): checked by verified_plan
    return True
