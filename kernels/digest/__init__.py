"""The weight digest: a keyed per-position hash mix of a tensor's raw bits, summed; one pass
over the weights (Triton on CUDA, plain torch elsewhere, equal bit for bit)::

    from polynya.kernels.digest import DigestPlan, tensor_digest
    tensor_digest(w)                                  # int
    DigestPlan([(starts, lengths)]).digests([flat])   # [int] per tensor view of flat
    ScatterPlan(tensors).scan(tensors, finite=True)   # (digests, NaN/inf counts), any storages

``reference.py`` defines it and says what it detects; ``polynya.checksum`` builds the model
checksum (names, dtypes, shapes and these digests) on top of it.
"""
from .op import DigestPlan, tensor_digest
from .scatter import ScatterPlan

__all__ = ["DigestPlan", "ScatterPlan", "tensor_digest"]
