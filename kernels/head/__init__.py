"""LM-head token statistics (log-prob of the target, log-sum-exp, entropy, and their logit
gradient), one pass over a chunk of logits each; used by ``polynya.head``::

    from polynya.kernels.head import row_stats, logit_grad
    logp, lse, ent = row_stats(logits, target, temperature, entropy=True)
    dz = logit_grad(logits, target, lse, ent, g_lp, g_ent, temperature)   # in place on CUDA
"""
from .op import logit_grad, row_stats

__all__ = ["logit_grad", "row_stats"]
