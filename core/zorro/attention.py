"""ZoRRo attention, hooked into any HF decoder through transformers' ``AttentionInterface``.

``use_zorro_attention(model)`` switches the model to the ``"polynya"`` implementation. It behaves
exactly like ``"sdpa"`` (same mask creation, same kernel) for every ordinary call — generation,
padded batches — and only differs when the model is handed a ZoRRo mask:

- on CPU a dense ``[R, 1, L, L]`` bool mask (passed straight to SDPA: FlexAttention has no CPU
  backward);
- on GPU a ``ZorroMask`` that carries the forest two ways: a *split* plan
  (``polynya.kernels.zorro``: one cuDNN call per shared node — a prompt's keys read once for the
  prompt and all its responses — one batched call over the responses, exact log-sum-exp merge)
  and, built only when used, a FlexAttention ``BlockMask`` of the same rule (fully visible
  blocks run unmasked, invisible ones are skipped). ``attention="auto"`` takes the split path
  when its kernels can (bf16 / fp16, head dim <= 128) and it pays (``_split_pays``: long shared
  prefixes, at most ``MAX_INNER`` shared nodes), FlexAttention otherwise (fp32, short prompts
  with long responses, deep multi-turn forests); ``"split"`` / ``"flex"`` force one.

The visibility rule (see ``tree.py``): key ``j`` is visible from query ``i`` iff
``tin[j] <= tin[i] and tout[i] <= tout[j] and j <= i``.
No model class is patched; the mask travels as the model's ordinary ``attention_mask``, so it
is also there when gradient checkpointing recomputes a layer in the backward pass.

cuDNN builds an execution plan for every new problem shape (~85 ms for forward + backward on an
H200), and RL batches bring new prompt and response lengths every step. ``import polynya``
therefore sets torch's ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` unless the environment already
says otherwise: cuDNN then reuses plans across lengths rounded up to powers of two. torch reads
the switch once, at the process's first cuDNN attention call (so import polynya first; set it to
``0`` to keep torch's default).
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from torch.nn.attention.flex_attention import BlockMask

from ..config.common import check_zorro_attention
from ..kernels.zorro import MAX_INNER, plan_split, split_attention, unsupported_reason

NAME = "polynya"
FLEX_BLOCK = 128


class ZorroMask(BlockMask):
    """The ``attention_mask`` of packed ZoRRo rows on CUDA (a ``BlockMask`` only so that
    transformers passes it through untouched, as it does every 4-D mask).

    Holds the forest (``tin``, ``tout`` ``[R, L]``; ``nodes``, the packed rows' node table or
    None) and the requested path; the first layer's call decides split vs FlexAttention for the
    whole batch, and the split plan or the FlexAttention block mask is built then, once.
    """

    def __init__(self, tin: torch.Tensor, tout: torch.Tensor, nodes, attention: str):
        self.tin, self.tout, self.nodes, self.attention = tin, tout, nodes, attention
        self._pays = nodes is not None and (attention == "split" or
                                            (attention == "auto" and _split_pays(nodes)))
        self._flex = self._plan = None
        self._why: dict = {}  # unsupported_reason per (device, dtype, heads, head dim)

    @property
    def shape(self):
        rows, length = self.tin.shape
        return (rows, 1, length, length)

    def split_plan(self, query: torch.Tensor, key: torch.Tensor):
        """The split plan when this batch takes split attention with these inputs, else None;
        ``ValueError`` when ``"split"`` was asked for and the kernels cannot take the inputs."""
        if not self._pays:
            return None
        sig = (query.device, query.dtype, query.shape[1], key.shape[1], query.shape[-1])
        if sig not in self._why:
            self._why[sig] = unsupported_reason(query, key)
        if self._why[sig] is not None:
            if self.attention == "split":
                raise ValueError(f"zorro_attention='split' cannot run here: {self._why[sig]}; "
                                 "use 'auto' or 'flex'")
            return None
        if self._plan is None:
            rows, length = self.tin.shape
            self._plan = plan_split(self.nodes, rows * length, self.tin.device)
        return self._plan

    def flex_mask(self) -> BlockMask:
        if self._flex is None:
            self._flex = interval_block_mask(self.tin, self.tout, FLEX_BLOCK)
        return self._flex

    def __repr__(self) -> str:
        path = "split" if self._pays else "flex"
        return f"ZorroMask(shape={self.shape}, path={path}, attention={self.attention!r})"


_compiled_flex = None


def _flex(query, key, value, block_mask, scale):
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex(query, key, value, block_mask=block_mask, scale=scale,
                          enable_gqa=query.shape[1] != key.shape[1])


def polynya_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs):
    """query ``[b, Hq, L, D]``, key/value ``[b, Hkv, L, D]`` -> (``[b, L, Hq, D]``, None)."""
    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    for unsupported in ("sliding_window", "softcap"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"ZoRRo does not support attention with {unsupported}; "
                             "call compute_logprobs(..., zorro=False) for this model")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(attention_mask, ZorroMask):
        plan = attention_mask.split_plan(query, key)
        if plan is not None:
            b, hq, length, d = query.shape
            flat = (lambda x: x.transpose(1, 2).reshape(b * length, x.shape[1], d))
            out = split_attention(flat(query), flat(key), flat(value), plan, scale)
            return out.view(b, length, hq, d), None
        attention_mask = attention_mask.flex_mask()
    out = _flex(query, key, value, attention_mask, scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, polynya_attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_zorro_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` (and its sub-configs) to the ``"polynya"`` attention; idempotent."""
    if getattr(model.config, "_attn_implementation", None) == NAME:
        return
    try:
        model.set_attn_implementation(NAME)
    except (AttributeError, ValueError, ImportError):
        model.config._attn_implementation = NAME


def zorro_mask(tin: torch.Tensor, tout: torch.Tensor, nodes=None, attention: str = "auto"):
    """The attention mask for packed rows: dense bool ``[R, 1, L, L]`` on CPU, else a ZorroMask.

    Args:
        tin, tout: ``[R, L]`` int32 preorder intervals of each token's node.
        nodes: ``PackedRows.nodes`` (the split plan's input); None = FlexAttention only. The
            split plan and the FlexAttention block mask are built lazily, by the first layer.
        attention: ``"auto"`` / ``"split"`` / ``"flex"`` (module docstring); CPU ignores it.
    """
    check_zorro_attention(attention, "compute_logprobs")
    rows, length = tin.shape
    if tin.device.type != "cuda":
        idx = torch.arange(length, device=tin.device)
        return _visible(tin[:, :, None], tout[:, :, None], idx[:, None],
                        tin[:, None, :], tout[:, None, :], idx)[:, None]
    if attention == "split" and nodes is None:
        raise ValueError("zorro_attention='split' needs the packed rows' node table")
    return ZorroMask(tin, tout, nodes, attention)


SPLIT_MIN_SHARE = 1.5  # auto: split when shared-prefix work >= this x the responses' own work


def _split_pays(nodes) -> bool:
    """Whether ``auto`` should take the split path for this forest (``[N, 3]`` node table).

    Split attention pays per call (leaf gathers, the combine) and wins by reading shared keys
    with cuDNN; measured on the H200 (benchmarks/bench_zorro.py, 4 groups): ahead of
    FlexAttention at P4096/R512 (shared/own work 33), P2048/R512 (12), P1024/R1024 (2.2),
    behind at P256/R512 (1.06). So: at most ``MAX_INNER`` shared nodes and a shared-key work
    (query x key pairs of the inner calls) of at least ``SPLIT_MIN_SHARE`` x the leaves' causal
    pairs.
    """
    start, end, stop = (nodes[:, i].astype(float) for i in range(3))
    inner = stop > end
    if not inner.any() or inner.sum() > MAX_INNER:
        return False
    shared = ((stop - start) * (end - start))[inner].sum()
    own = ((end - start) ** 2 / 2)[~inner].sum()
    return bool(shared >= SPLIT_MIN_SHARE * own)


def _visible(q_tin, q_tout, q_idx, k_tin, k_tout, k_idx):
    """The visibility rule on broadcast operands (one definition for mask_mod and blocks)."""
    return (k_tin <= q_tin) & (q_tout <= k_tout) & (k_idx <= q_idx)


def interval_block_mask(tin: torch.Tensor, tout: torch.Tensor, block: int = FLEX_BLOCK):
    """FlexAttention ``BlockMask`` of the visibility rule, built with plain tensor ops.

    ``create_block_mask`` would trace and compile the mask function for every new row length
    (tens of seconds each on a new shape: an RL run has a new one every step). Here every
    (query block, key block) pair is classified from the token rule directly, a few query
    blocks at a time (at most 2**26 token pairs in flight): *full* pairs run unmasked, *partial*
    pairs evaluate ``mask_mod`` per element, the rest are skipped.
    """
    if tin.dim() != 2 or tin.shape != tout.shape:
        raise ValueError(f"tin and tout must both be [rows, length]; got {tuple(tin.shape)} "
                         f"and {tuple(tout.shape)}")
    rows, length = tin.shape
    if length % block:
        raise ValueError(f"packed rows must be padded to a multiple of {block} tokens for a "
                         f"block mask; got rows of {length}")
    nb = length // block
    dev = tin.device
    anyv = torch.empty(rows, nb, nb, dtype=torch.bool, device=dev)
    allv = torch.empty_like(anyv)
    k_idx = torch.arange(length, device=dev)
    k_tin, k_tout = tin[:, None, None, :], tout[:, None, None, :]
    step = max(1, (1 << 26) // (rows * block * length))
    for s in range(0, nb, step):
        e = min(nb, s + step)
        span = slice(s * block, e * block)
        shape = (rows, e - s, block, 1)
        vis = _visible(tin[:, span].reshape(shape), tout[:, span].reshape(shape),
                       k_idx[span].view(1, e - s, block, 1), k_tin, k_tout, k_idx)
        vis = vis.view(rows, e - s, block, nb, block)
        anyv[:, s:e] = vis.any(dim=4).any(dim=2)
        allv[:, s:e] = vis.all(dim=4).all(dim=2)

    def ordered(m: torch.Tensor):
        num = m.sum(-1, dtype=torch.int32)[:, None]
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, None]
        return num.contiguous(), idx.contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return _visible(tin[b, q_idx], tout[b, q_idx], q_idx, tin[b, kv_idx], tout[b, kv_idx], kv_idx)

    kv_num, kv_idx = ordered(anyv & ~allv)
    full_num, full_idx = ordered(allv)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(length, length))
