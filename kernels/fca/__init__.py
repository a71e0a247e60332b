"""FCA: forest cascade attention for decode over a paged KV cache with shared prefixes.

Requests that share a prefix (system prompt -> prompt -> the G samples of a prompt) share
physical KV blocks. ``plan_forest`` finds that forest on the device once per step; ``fca_decode``
then reads every shared node's blocks once for all its members (their queries stacked as one
tensor-core tile), each request's own blocks once, and merges the partials exactly by
log-sum-exp. ``paged_decode`` is the plain no-sharing path; ``reference.paged_decode_reference``
the fp32 oracle and CPU fallback::

    from polynya.kernels.fca import plan_forest, fca_decode
    plan = plan_forest(block_tables, seq_lens, block_size)    # [B, max_blocks], [B] int32
    out = fca_decode(q, k_cache, v_cache, plan)                # q [B, Hq, D] -> [B, Hq, D]
"""
from .op import DecodeConfig, fca_decode, paged_decode
from .plan import ForestPlan, plan_forest

__all__ = ["DecodeConfig", "ForestPlan", "fca_decode", "paged_decode", "plan_forest"]
