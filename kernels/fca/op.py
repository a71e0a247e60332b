"""Checked launchers: ``fca_decode`` (forest cascade attention) and ``paged_decode`` (no sharing).

Both take ``q [B, Hq, D]`` and caches ``[num_blocks, block_size, Hkv, D]`` and return
``out [B, Hq, D]`` (plus ``lse [B, Hq]`` fp32 natural-log when ``return_lse``). On CUDA they run
the Triton kernels of ``kernel.py``; on CPU they fall back to ``paged_decode_reference`` unless
``backend="triton"`` (only meaningful under ``TRITON_INTERPRET=1``, for tests)::

    plan = plan_forest(block_tables, seq_lens, block_size)   # once per step
    out = fca_decode(q, k_cache, v_cache, plan)               # every layer

``softcap`` (both) caps every score at ``softcap * tanh(score / softcap)`` (Gemma 2); ``window``
(``paged_decode`` only) restricts each request to its last ``window`` KV positions (sliding-window
layers: FCA's shared nodes are not windowed, so a sampler runs those layers through
``paged_decode``).

Value checks that need the host (block ids within the cache, seq_lens) cost one sync; they run
once per plan and cache size for ``fca_decode``, on every call of ``paged_decode`` unless
``validate=False``, and never while a CUDA graph is being captured.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import torch

from .plan import ForestPlan, _is_capturing, check_tables
from .reference import paged_decode_reference

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Launch knobs (the benchmark sweeps them). None = chosen from the head dim.

    ``mode`` (FCA only): ``"streams"`` (default, fastest on H200 under CUDA graphs) runs the
    shared units (persistent, one program per SM) on a side stream concurrently with the
    private rows (paged kernel); ``"split"`` runs the same two launches one after the other;
    ``"fused"`` runs shared and private units in one persistent launch.
    """

    block_n: int | None = None     # KV tokens per tile: 64 (D <= 128) / 32 (D = 256)
    num_warps: int | None = None   # 4 (D <= 128) / 8 (D = 256)
    num_stages: int | None = None  # software-pipelining depth: 2
    progs_per_sm: int = 4          # persistent programs per SM; split-K target for paged
    dynamic: bool = True           # atomic work counter (vs static stride), persistent kernel
    mode: str = "streams"
    block_m_shared: int = 64       # rows (members x Hq/Hkv) of a shared tile
    block_n_shared: int | None = None  # KV tokens per shared tile (default: block_n)
    interleave: bool = False       # fused: spread shared units among the private ones
    shared_num_warps: int | None = None  # warps of the shared launch (split / streams)
    shared_progs_per_sm: int | None = None  # default: progs_per_sm (split), 1 (streams)
    shared_num_stages: int | None = None  # pipelining depth of the shared launch: 3

    def __post_init__(self):
        if self.mode not in ("fused", "split", "streams"):
            raise ValueError(f"mode must be 'fused', 'split' or 'streams', got {self.mode!r}")


@functools.lru_cache(maxsize=64)
def _resolve(cfg: DecodeConfig | None, d: int) -> DecodeConfig:
    cfg = cfg or DecodeConfig()
    big = d > 128
    return replace(cfg, block_n=cfg.block_n or (32 if big else 64),
                   num_warps=cfg.num_warps or (8 if big else 4),
                   num_stages=cfg.num_stages or 2,
                   shared_num_stages=cfg.shared_num_stages or 3)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _use_triton(q: torch.Tensor, backend: str) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "torch":
        return False
    if q.is_cuda:
        return True
    if backend == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend='triton' on CPU needs TRITON_INTERPRET=1")
        return True
    return False


def check_decode_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        batch: int, device: torch.device) -> None:
    """ValueError unless q / caches have the documented shapes, dtypes and device."""
    for name, t, nd in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        if not isinstance(t, torch.Tensor) or t.dim() != nd:
            raise ValueError(f"{name} must be a {nd}-D tensor")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} not supported (bf16, fp16, fp32)")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but block tables are on {device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q/k/v dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    B, Hq, D = q.shape
    _, _, Hkv, Dk = k_cache.shape
    if B != batch:
        raise ValueError(f"q has batch {B} but the block tables have {batch} rows")
    if Dk != D:
        raise ValueError(f"head dim of q ({D}) != head dim of the cache ({Dk})")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"Hq ({Hq}) must be a multiple of Hkv ({Hkv})")


def _check_triton_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    D = q.shape[-1]
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"head dim {D} unsupported by the kernel (power of two in 16..256)")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last dimension")
    if q.shape[1] // k_cache.shape[2] > 64:
        raise ValueError("Hq / Hkv > 64 is not supported by the kernel")


def _check_block_ids(lo: int, hi: int, num_blocks: int) -> None:
    if lo < 0 or hi >= num_blocks:
        raise ValueError(f"block ids must be in [0, {num_blocks}); the tables use {lo}..{hi}")


def _check_modifiers(softcap: float | None, window: int | None) -> None:
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap must be a number > 0 or None, got {softcap!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be an int >= 1 or None, got {window!r}")


def _cap_args(scale: float, softcap: float | None) -> tuple[float, float]:
    """Kernel arguments of the soft-cap: ``cap_in = scale / cap``, ``cap_out = cap * log2(e)``."""
    return (scale / softcap, softcap * _LOG2E) if softcap is not None else (0.0, 0.0)


def _dot_prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _kv_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    return (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fca_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: ForestPlan,
    scale: float | None = None,
    return_lse: bool = False,
    *,
    validate: bool | None = None,
    backend: str = "auto",
    config: DecodeConfig | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Forest cascade decode attention: shared prefixes read once per group, merged exactly.

    Args:
        q: ``[B, Hq, D]`` one query token per request (bf16 / fp16 / fp32).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, same dtype as q.
        plan: from ``plan_forest`` on this step's block tables (same device as q).
        scale: softmax scale, default ``1 / sqrt(D)``.
        return_lse: also return ``lse [B, Hq]`` fp32 (natural log).
        softcap: cap every score at ``softcap * tanh(score / softcap)`` (None: no cap).

    Returns:
        ``out [B, Hq, D]`` in q's dtype (and ``lse``).
    """
    if not isinstance(plan, ForestPlan):
        raise ValueError("plan must be a ForestPlan from plan_forest")
    _check_modifiers(softcap, None)
    check_decode_inputs(q, k_cache, v_cache, plan.batch_size, plan.block_tables.device)
    if k_cache.shape[1] != plan.block_size:
        raise ValueError(f"cache block size {k_cache.shape[1]} != plan's {plan.block_size}")
    if (validate or (validate is None and not _is_capturing(q.device))) \
            and plan.checked_num_blocks != k_cache.shape[0]:
        lo, hi = plan.block_id_range.tolist()
        _check_block_ids(lo, hi, k_cache.shape[0])
        plan.checked_num_blocks = k_cache.shape[0]
    if not _use_triton(q, backend):
        return paged_decode_reference(q, k_cache, v_cache, plan.block_tables, plan.seq_lens,
                                      scale, return_lse, softcap=softcap)
    _check_triton_shapes(q, k_cache, v_cache)
    return _fca_triton(q, k_cache, v_cache, plan, scale, return_lse,
                      _resolve(config, q.shape[-1]), softcap)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _num_splits(batch: int, hkv: int, max_tokens: int, device, cfg: DecodeConfig) -> int:
    """Split-K factor from static shapes: ~2 waves of programs, >= 256 tokens per split."""
    want = triton_cdiv(2 * _num_sms(device) * cfg.progs_per_sm, batch * hkv)
    return max(1, min(want, triton_cdiv(max_tokens, 256)))


def _fca_triton(q, k_cache, v_cache, plan: ForestPlan, scale, return_lse, cfg: DecodeConfig,
                softcap: float | None = None):
    from .kernel import _fca_attend_kernel, _merge_partials_kernel, _paged_decode_kernel

    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    qpk = Hq // Hkv
    page = plan.block_size
    MB = plan.pv_bt.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    nsplit = _num_splits(B, Hkv, MB * page, q.device, cfg)
    S = plan.max_shared_slots + nsplit
    ws_o = torch.empty((B, S, Hq, D), device=q.device, dtype=torch.float32)
    ws_lse = torch.empty((B, S, Hq), device=q.device, dtype=torch.float32)
    block_m_sh = max(cfg.block_m_shared, _next_pow2(qpk))
    msub = block_m_sh // qpk
    nsub = triton_cdiv(plan.max_group, msub)
    block_m_pv = max(16, _next_pow2(qpk))
    dot_prec = _dot_prec(q.dtype)
    kv = (q, q.stride(0), q.stride(1), k_cache, v_cache, *_kv_strides(k_cache, v_cache))
    persist = (*kv, plan.block_tables, plan.block_tables.stride(0), plan.seq_lens,
               plan.n_shared, plan.sh_row, plan.sh_c0, plan.sh_c1, plan.sh_slot, plan.sh_nmem,
               plan.sh_mem, plan.pv_bt, plan.pv_bt.stride(0), plan.pv_len, plan.n_sh_slots,
               B, ws_o, ws_lse)
    cap_in, cap_out = _cap_args(scale, softcap)
    tail = (scale * _LOG2E, cap_in, cap_out, S, Hq, Hkv, plan.max_group)
    common = {"QPK": qpk, "NSUB": nsub, "MSUB": msub, "NSPLIT": nsplit, "BLOCK_M_SH": block_m_sh,
                  "BLOCK_M_PV": block_m_pv, "BLOCK_N_SH": cfg.block_n_shared or cfg.block_n,
                  "BLOCK_N": cfg.block_n, "HEAD_D": D, "PAGE": page, "DOT_PREC": dot_prec,
                  "DYNAMIC": cfg.dynamic, "INTERLEAVE": cfg.interleave,
                  "SOFTCAP": softcap is not None, "num_stages": cfg.num_stages}
    sms = _num_sms(q.device)
    if cfg.mode == "fused":
        nprog = sms * cfg.progs_per_sm
        _fca_attend_kernel[(nprog,)](*persist, plan.counters, *tail, DO_SHARED=True,
                                     DO_PRIVATE=True, num_warps=cfg.num_warps, **common)
    else:
        def shared_pass():
            per_sm = cfg.shared_progs_per_sm or (1 if cfg.mode == "streams" else cfg.progs_per_sm)
            nprog = sms * per_sm
            _fca_attend_kernel[(nprog,)](*persist, plan.counters, *tail, DO_SHARED=True,
                                         DO_PRIVATE=False,
                                         num_warps=cfg.shared_num_warps or cfg.num_warps,
                                         **{**common, "num_stages": cfg.shared_num_stages})

        def private_pass():
            _paged_decode_kernel[(B, Hkv, nsplit)](
                *kv, plan.pv_bt, plan.pv_bt.stride(0), plan.pv_len, q, 0, 0, q, ws_o, ws_lse,
                plan.n_sh_slots, scale * _LOG2E, cap_in, cap_out, 0, S, Hq, QPK=qpk,
                BLOCK_M=block_m_pv, BLOCK_N=cfg.block_n, HEAD_D=D, PAGE=page,
                DOT_PREC=dot_prec, SPLIT=True, WRITE_LSE=False, SLOT_OFF=True,
                SOFTCAP=softcap is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

        if cfg.mode == "split" or not q.is_cuda:
            shared_pass()
            private_pass()
        else:
            main = torch.cuda.current_stream(q.device)
            side = _side_stream(q.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared_pass()
            private_pass()
            main.wait_stream(side)  # ws_* are freed on main only after this join
    out = torch.empty_like(q)
    lse = torch.empty((B, Hq), device=q.device, dtype=torch.float32) if return_lse else out
    _merge_partials_kernel[(B, Hkv)](
        ws_o, ws_lse, plan.n_sh_slots, out, out.stride(0), out.stride(1), lse, plan.counters,
        S, Hq, QPK=qpk, BLOCK_H=_next_pow2(qpk), HEAD_D=D, HAS_NSLOTS=True,
        NSLOT_ADD=nsplit, WRITE_LSE=return_lse, RESET=True, num_warps=4)
    return (out, lse) if return_lse else out


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    return_lse: bool = False,
    *,
    validate: bool | None = None,
    backend: str = "auto",
    config: DecodeConfig | None = None,
    num_splits: int | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain paged decode attention (no prefix sharing): the fair baseline and general path.

    Args/Returns as ``fca_decode``, with ``block_tables [B, max_blocks]`` int32 and
    ``seq_lens [B]`` int32 instead of a plan. ``num_splits`` overrides the split-K heuristic;
    ``window``: each request reads only its last ``window`` positions (sliding-window layers).
    """
    _check_modifiers(softcap, window)
    check_tables(block_tables, seq_lens, k_cache.shape[1] if k_cache.dim() == 4 else 1,
                 validate)
    check_decode_inputs(q, k_cache, v_cache, block_tables.shape[0], block_tables.device)
    if validate or (validate is None and not _is_capturing(q.device)):
        lo, hi = _id_range(block_tables, seq_lens, k_cache.shape[1]).tolist()
        _check_block_ids(lo, hi, k_cache.shape[0])
    if not _use_triton(q, backend):
        return paged_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                      return_lse, softcap=softcap, window=window)
    _check_triton_shapes(q, k_cache, v_cache)
    return _paged_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, return_lse,
                         _resolve(config, q.shape[-1]), num_splits, softcap, window)


def _id_range(block_tables, seq_lens, block_size) -> torch.Tensor:
    MB = block_tables.shape[1]
    j = torch.arange(MB, device=block_tables.device)
    valid = j[None, :] * block_size < seq_lens[:, None]
    return torch.stack([torch.where(valid, block_tables, 0).amin(),
                        torch.where(valid, block_tables, 0).amax()])


def _paged_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, return_lse,
                  cfg: DecodeConfig, num_splits: int | None, softcap: float | None = None,
                  window: int | None = None):
    from .kernel import _merge_partials_kernel, _paged_decode_kernel

    B, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    qpk = Hq // Hkv
    MB = block_tables.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    bt = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    sl = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    if num_splits is None:
        span = MB * page if window is None else min(MB * page, window + page)
        num_splits = _num_splits(B, Hkv, span, q.device, cfg)
    num_splits = max(1, min(int(num_splits), MB))
    out = torch.empty_like(q)
    lse = torch.empty((B, Hq), device=q.device, dtype=torch.float32) if return_lse else out
    split = num_splits > 1
    ws_o = torch.empty((B, num_splits, Hq, D), device=q.device, dtype=torch.float32) \
        if split else out
    ws_lse = torch.empty((B, num_splits, Hq), device=q.device, dtype=torch.float32) \
        if split else out
    _paged_decode_kernel[(B, Hkv, num_splits)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, *_kv_strides(k_cache, v_cache),
        bt, bt.stride(0), sl, out, out.stride(0), out.stride(1), lse, ws_o, ws_lse, sl,
        scale * _LOG2E, *_cap_args(scale, softcap), window or 0, num_splits, Hq, QPK=qpk,
        BLOCK_M=max(16, _next_pow2(qpk)), BLOCK_N=cfg.block_n, HEAD_D=D, PAGE=page,
        DOT_PREC=_dot_prec(q.dtype), SPLIT=split, WRITE_LSE=return_lse, SLOT_OFF=False,
        SOFTCAP=softcap is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split:
        _merge_partials_kernel[(B, Hkv)](
            ws_o, ws_lse, sl, out, out.stride(0), out.stride(1), lse, sl,
            num_splits, Hq, QPK=qpk, BLOCK_H=_next_pow2(qpk), HEAD_D=D, HAS_NSLOTS=False,
            NSLOT_ADD=num_splits, WRITE_LSE=return_lse, RESET=False, num_warps=4)
    return (out, lse) if return_lse else out
