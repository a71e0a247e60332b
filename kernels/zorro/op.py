"""Split ZoRRo attention: exact attention over a packed prefix forest, as dense calls + a merge.

``split_attention(q, k, v, plan, scale)`` computes, for token-major ``q [T, Hq, D]`` and
``k`` / ``v`` ``[T, Hkv, D]``, the attention of every token over its visible forest prefix
(see ``plan.py``): one top-left-causal call per inner node (a prompt read once by its prompt
and all its responses), one causal call over the padded batch of leaves, and the exact
log-sum-exp combine (``kernel.py``). The backward runs every call's backward with the *final*
output and LSE (exact, as in ring attention), sums the query gradients with the same combine,
and gathers key/value gradients (each has one source). Differentiable in q, k, v::

    plan = plan_split(nodes, T, device)                 # once per batch
    out = split_attention(q, k, v, plan, scale)         # every layer -> [T, Hq, D]

Backends: ``"cuda"`` (cuDNN fused attention — FlashAttention-3-class kernels on Hopper, GQA
native, strided views instead of copies — and the Triton combine; bf16 / fp16, head dim a
multiple of 8 up to 128) and ``"reference"`` (``reference.py``, fp32 math; CPU and tests).
cuDNN builds an execution plan for every new problem shape (~40 ms per direction on an H200);
``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` (torch's switch, read once per process) makes it reuse
plans across lengths rounded up to powers of two — see ``polynya.zorro.attention``. ``unsupported_reason`` says why the CUDA backend cannot take given inputs.
"""
from __future__ import annotations

import torch

from . import reference as ref
from .plan import SplitPlan

_A = torch.ops.aten


def fused_inputs_reason(q: torch.Tensor, k: torch.Tensor, *, kernels: str, max_head_dim: int,
                        enabled: bool, switch: str) -> str | None:
    """Why torch's fused attention ``kernels`` (cuDNN, FlashAttention) cannot take these inputs,
    or None: CUDA, bf16/fp16, head dim a multiple of 8 up to ``max_head_dim``, GQA, sm80+, and
    the backend ``enabled`` (``switch`` names torch's setting that turns it on)."""
    if not q.is_cuda:
        return "tensors are not on a CUDA device"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} ({kernels} takes bfloat16 / float16)"
    d = q.shape[-1]
    if d % 8 or d > max_head_dim:
        return f"head dim {d} (needs a multiple of 8, at most {max_head_dim})"
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key heads"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "GPU older than sm80"
    if not enabled:
        return f"{kernels} is disabled ({switch})"
    return None


def unsupported_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why the CUDA backend cannot run these inputs, or None when it can."""
    return fused_inputs_reason(q, k, kernels="cuDNN attention", max_head_dim=128,
                               enabled=torch.backends.cuda.cudnn_sdp_enabled(),
                               switch="torch.backends.cuda.enable_cudnn_sdp")


def combine(parts: list[torch.Tensor], lse_parts: list[torch.Tensor] | None, src: torch.Tensor):
    """Merge partial rows per token (see ``reference.combine_reference``); Triton on CUDA."""
    if not parts or any(p.dim() != 3 or p.shape[1:] != parts[0].shape[1:] or p.dtype != parts[0].dtype
                        or p.device != parts[0].device for p in parts):
        raise ValueError("combine needs one or more parts [rows, H, D] of one shape tail, dtype "
                         "and device")
    if lse_parts is not None and (len(lse_parts) != len(parts) or any(
            x.shape != (p.shape[1], p.shape[0]) for p, x in zip(parts, lse_parts))):
        raise ValueError("lse_parts must hold one [H, rows] tensor per part")
    if src.dim() != 2 or src.dtype != torch.int64 or src.device != parts[0].device:
        raise ValueError(f"src must be [tokens, K] int64 on {parts[0].device}, got "
                         f"{tuple(src.shape)} {src.dtype} on {src.device}")
    if not parts[0].is_cuda:
        return ref.combine_reference(parts, lse_parts, src)
    return _launch_combine(parts, lse_parts, src)


def _launch_combine(parts: list[torch.Tensor], lse_parts: list[torch.Tensor] | None, src: torch.Tensor):
    from .kernel import _combine_kernel
    import triton

    parts = [p if p.stride(-1) == 1 else p.contiguous() for p in parts]
    has_lse = lse_parts is not None
    lses = [x if x.stride(-1) == 1 else x.contiguous() for x in lse_parts] if has_lse else [None] * len(parts)
    tab = torch.tensor([[p.data_ptr(), p.stride(0), p.stride(1),
                         x.data_ptr() if has_lse else 0, x.stride(0) if has_lse else 0]
                        for p, x in zip(parts, lses)], dtype=torch.int64)
    if parts[0].is_cuda:
        tab = tab.pin_memory().to(parts[0].device, non_blocking=True)
    tokens, width = src.shape
    _, heads, dim = parts[0].shape
    out = torch.empty(tokens, heads, dim, device=parts[0].device, dtype=parts[0].dtype)
    lse = torch.empty(heads, tokens, device=out.device, dtype=torch.float32) if has_lse else out
    _combine_kernel[(tokens,)](
        tab, src, out, lse, width, heads, dim, src.stride(0), out.stride(0), out.stride(1),
        lse.stride(0) if has_lse else 0, HAS_LSE=has_lse, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(dim), num_warps=4)
    return out, (lse if has_lse else None)


class _Cuda:
    """cuDNN fused attention (top-left causal) on ``[B, L, H, D]`` views: no copies, GQA native."""

    @staticmethod
    def forward(q, k, v, scale):
        b = (lambda x: x.transpose(1, 2))
        r = _A._scaled_dot_product_cudnn_attention(b(q), b(k), b(v), None, True, 0.0, True, False,
                                                   scale=scale)
        # r[1] is [B, H, L, 1]; its memory order differs between torch's dense and ragged
        # (TORCH_CUDNN_SDPA_AVOID_RECOMPILE) paths, and the backward must get the same order.
        return r[0].transpose(1, 2), r[1][..., 0], (*r[2:8], r[1].stride())

    @staticmethod
    def backward(do, q, k, v, o, lse, state, scale):
        b = (lambda x: x.transpose(1, 2))
        cq, ck, mq, mk, seed, offset, lse_stride = state
        lse4 = torch.empty_strided((*lse.shape, 1), lse_stride, device=lse.device, dtype=lse.dtype)
        lse4.copy_(lse.unsqueeze(-1))
        g = _A._scaled_dot_product_cudnn_attention_backward(
            b(do), b(q), b(k), b(v), b(o), lse4, seed, offset, None, cq, ck, mq, mk, 0.0, True,
            scale=scale)
        return tuple(x.transpose(1, 2) for x in g[:3])


class _Reference:
    @staticmethod
    def forward(q, k, v, scale):
        outs = [ref.dense_forward(*x, scale) for x in zip(q, k, v)]
        return torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs]), None

    @staticmethod
    def backward(do, q, k, v, o, lse, state, scale):
        grads = [ref.dense_backward(*x, scale) for x in zip(do, q, k, v, o, lse)]
        return tuple(torch.stack(g) for g in zip(*grads))


_BACKENDS = {"cuda": _Cuda, "reference": _Reference}


def _leaf_batch(x: torch.Tensor, plan: SplitPlan) -> torch.Tensor:
    """``[T, H, D]`` -> the padded leaf batch ``[leaves, L, H, D]``."""
    return x.index_select(0, plan.leaf_index).view(-1, plan.leaf_len, *x.shape[1:])


class SplitAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: SplitPlan, scale: float, backend: str):
        impl = _BACKENDS[backend]
        parts, lses, states = [], [], []
        for s, e, x in plan.inner:
            o, lse, st = impl.forward(q[None, s:x], k[None, s:e], v[None, s:e], scale)
            parts.append(o[0])
            lses.append(lse[0])
            states.append(st)
        if plan.leaf_index is not None:
            o, lse, st = impl.forward(_leaf_batch(q, plan), _leaf_batch(k, plan), _leaf_batch(v, plan), scale)
            parts.append(o.flatten(0, 1))
            lses.append(lse.transpose(0, 1).flatten(1))                   # [B, H, L] -> [H, B * L]
            states.append(st)
        out, lse = combine(parts, lses, plan.src)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.impl, ctx.states = plan, scale, impl, states
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale, impl = ctx.plan, ctx.scale, ctx.impl
        dout = dout.contiguous()
        dqs, dks, dvs = [], [], []
        for (s, e, x), st in zip(plan.inner, ctx.states):
            g = impl.backward(dout[None, s:x], q[None, s:x], k[None, s:e], v[None, s:e],
                              out[None, s:x], lse[None, :, s:x], st, scale)
            for acc, grad in zip((dqs, dks, dvs), g):
                acc.append(grad[0])
        if plan.leaf_index is not None:
            n = plan.leaf_len
            do_l = _leaf_batch(dout, plan) * plan.leaf_valid.view(-1, n, 1, 1)  # padding adds nothing
            lse_l = lse.index_select(1, plan.leaf_index).view(lse.shape[0], -1, n).transpose(0, 1)
            g = impl.backward(do_l, _leaf_batch(q, plan), _leaf_batch(k, plan), _leaf_batch(v, plan),
                              _leaf_batch(out, plan), lse_l, ctx.states[-1], scale)
            for acc, grad in zip((dqs, dks, dvs), g):
                acc.append(grad.flatten(0, 1))
        dq, _ = combine(dqs, None, plan.src)
        dk, _ = combine(dks, None, plan.kv_src)
        dv, _ = combine(dvs, None, plan.kv_src)
        return dq, dk, dv, None, None, None


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SplitPlan,
                    scale: float, backend: str | None = None) -> torch.Tensor:
    """Attention of every token over its forest prefix.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` token-major (T = ``plan.num_tokens``).
        plan: from ``plan_split``; scale: softmax scale.
        backend: ``"cuda"`` / ``"reference"``; None picks cuda on GPU, reference on CPU.
    Returns:
        ``[T, Hq, D]`` in q's dtype (zeros for tokens outside every node, e.g. padding).
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0] \
            or q.shape[2] != k.shape[2]:
        raise ValueError(f"split_attention expects q [T, Hq, D] and k, v [T, Hkv, D]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != plan.num_tokens:
        raise ValueError(f"the plan covers {plan.num_tokens} tokens, the inputs {q.shape[0]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key heads")
    if backend is None:
        backend = "cuda" if q.is_cuda else "reference"
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
    if backend == "cuda" and (why := unsupported_reason(q, k)):
        raise ValueError(f"split attention's CUDA backend cannot run: {why}; use FlexAttention")
    return SplitAttentionFunction.apply(q, k, v, plan, scale, backend)
