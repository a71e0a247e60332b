"""Split ZoRRo attention: attention over a packed prefix forest as one dense call per shared
node (its keys read once by everything below it) plus one padded call over the leaves, merged
exactly by log-sum-exp, with backward::

    from polynya.kernels.zorro import plan_split, split_attention
    plan = plan_split(nodes, T, device)              # [N, 3] start, end, stop per node
    out = split_attention(q, k, v, plan, scale)      # [T, Hq, D], [T, Hkv, D] -> [T, Hq, D]

A forest of leaves only (packed samples, nothing shared) takes ``varlen_attention`` instead:
one FlashAttention-2 varlen call over the segments (``varlen.py``).
"""
from .op import combine, split_attention, unsupported_reason
from .plan import MAX_INNER, SplitPlan, plan_split
from .varlen import segment_bounds, varlen_attention
from .varlen import unsupported_reason as varlen_unsupported_reason

__all__ = ["MAX_INNER", "SplitPlan", "combine", "plan_split", "segment_bounds", "split_attention",
           "unsupported_reason", "varlen_attention", "varlen_unsupported_reason"]
