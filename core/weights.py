"""Weight pieces: the one way engines accept new weights.

``load_weights`` of every engine takes ``{name: tensor}``, ``[(name, tensor), ...]``, flat
buckets ``[(names, flat_1d_tensor), ...]`` as ``TrainingEngine.export_weights`` yields them (each
bucket holds its tensors flattened and concatenated in ``names`` order), or one such bucket on
its own (or one bare ``(name, tensor)``). ``split_weight_pieces`` turns any of these into checked ``(name, tensor)`` pairs before
anything is copied, so a bad piece leaves the engine untouched.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

WeightPieces = Any  # Mapping[str, Tensor] | Iterable[(str | Sequence[str], Tensor)] | one bucket


def pieces_of(weights: WeightPieces) -> Iterable:
    """The pieces of ``weights``: a mapping's items, a bare ``(name, tensor)`` or ``(names,
    flat)`` tuple as a list of one, or the iterable itself."""
    if isinstance(weights, Mapping):
        return weights.items()
    if isinstance(weights, tuple) and len(weights) == 2 and isinstance(weights[1], torch.Tensor):
        return [weights]
    return weights


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
            if key not in shapes:
                raise ValueError(f"load_weights: unknown parameter {key!r}")
            if tuple(tensor.shape) != tuple(shapes[key]):
                raise ValueError(f"load_weights: {key} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(shapes[key])}")
        return [(key, tensor)]
    names = list(key)
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise ValueError(f"load_weights: unknown parameters {unknown[:3]}")
    sizes = [torch.Size(shapes[n]).numel() for n in names]
    if tensor.dim() != 1 or tensor.numel() != sum(sizes):
        raise ValueError(f"flat bucket of shape {tuple(tensor.shape)} does not hold the {sum(sizes)} "
                         f"elements of its {len(names)} named parameters")
    return [(n, p.view(shapes[n])) for n, p in zip(names, tensor.split(sizes))]


def split_weight_pieces(weights: WeightPieces, shapes: Mapping[str, torch.Size], *,
                        check_names: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Every piece of ``weights`` as checked ``(name, tensor)`` pairs (see ``split_piece``)."""
    return [pair for piece in pieces_of(weights) for pair in split_piece(piece, shapes, check_names=check_names)]
