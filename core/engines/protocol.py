"""What every engine offers the coordinator (``polynya.coordination``), as Protocols.

Engines change their own state only through these methods; nothing outside an engine moves
its module or sets its version. Two roles:

- ``ServingEngine`` (sampler, log-prob engine): receives weights —
  ``load_weights(pieces, version=None, *, checksum=None) -> version`` checks everything
  (names, shapes, dtypes, finite values, the sender's checksum) before it copies anything and
  moves ``weight_version`` only once the weights are in; ``sleep(level)`` / ``wake()`` release
  and restore device memory (level 1: caches; level 2: the weights too).
- ``TrainerEngine`` (training engine): the source of weights — ``export_weights`` /
  ``weight_checksum``; ``offload()`` / ``onload()`` move its whole state (weights, gradients,
  optimizer) to host memory and back so a colocated sampler can use the device;
  ``make_room(nbytes) -> bool`` offloads only when ``nbytes`` are not free on the device
  (and says whether it did).
- ``SamplingEngine.room_bytes(level)`` (for the hand-over's ``"auto"`` offload): device bytes
  a wake from sleep ``level`` and a generate take, ``None`` when the backend cannot tell.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class ServingEngine(Protocol):
    @property
    def weight_version(self) -> int: ...

    def load_weights(self, weights: Any, version: int | None = None, *,
                     checksum: str | None = None) -> int: ...

    def weight_checksum(self) -> str: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake(self) -> None: ...


@runtime_checkable
class TrainerEngine(Protocol):
    def export_weights(self, bucket_bytes: int = ...) -> Iterator[tuple[list[str], torch.Tensor]]: ...

    def weight_checksum(self, bucket_bytes: int = ...) -> str: ...

    def offload(self) -> dict[str, float]: ...

    def make_room(self, nbytes: int) -> bool: ...

    def onload(self) -> None: ...
