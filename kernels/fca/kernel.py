"""Triton kernels for FCA decode and the plain paged decode baseline (@triton.jit only).

Launchers, checks and heuristics live in ``op.py``; the forest planner's kernels in
``plan_kernel.py``. Conventions shared by all kernels:
caches are ``[num_blocks, PAGE, Hkv, D]`` with a unit last stride; a token ``t`` of a request
lives at ``cache[bt[row, t // PAGE], t % PAGE]``; scores are kept in log2 units (``qk_scale``
already holds ``log2(e)``); a partial result is ``(o / l, m + log2 l)`` in fp32, and the merge
combines a request's partials by log-sum-exp. ``SOFTCAP`` kernels cap every score at
``cap * tanh(score / cap)`` (Gemma 2): ``cap_in = scale / cap`` and ``cap_out = cap * log2(e)``
replace ``qk_scale``. A ``window > 0`` (paged decode only: there a token's index is its
position) restricts request ``b`` to its last ``window`` positions.
"""
import triton
import triton.language as tl


@triton.jit
def _scores(q, k, qk_scale, cap_in, cap_out, DOT_PREC: tl.constexpr, SOFTCAP: tl.constexpr):
    """Scores of q against a key tile in log2 units (soft-capped when ``SOFTCAP``)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if SOFTCAP:  # cap * tanh(x), tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both saturations
        s = (1.0 - 2.0 / (tl.exp2(s * (cap_in * 2.8853900817779268)) + 1.0)) * cap_out
    else:
        s = s * qk_scale
    return s


@triton.jit
def _tile_rows(bt_row_ptr, start, tok1, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Tokens [start, start + BLOCK_N) of one block-table row: (valid mask, block id, slot)."""
    t = start + tl.arange(0, BLOCK_N)
    tm = t < tok1
    bid = tl.load(bt_row_ptr + t // PAGE, mask=tm, other=0).to(tl.int64)
    return tm, bid, t % PAGE


@triton.jit
def _load_tile(ptr, bid, within, tm, s_b, s_t, head, s_h, HEAD_D: tl.constexpr):
    off = bid * s_b + within * s_t + head * s_h
    return tl.load(ptr + off[:, None] + tl.arange(0, HEAD_D)[None, :], mask=tm[:, None], other=0.0)


@triton.jit
def _accumulate(s, tm, bid, within, m_i, l_i, acc, v_ptr, s_vb, s_vt, head, s_vh,
                HEAD_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """One online-softmax step over a score tile and its values: (acc, max, sum) updated."""
    s = tl.where(tm[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = _load_tile(v_ptr, bid, within, tm, s_vb, s_vt, head, s_vh, HEAD_D)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend(q, k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, bt_row_ptr, head,
            tok0, tok1, qk_scale, cap_in, cap_out,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
            PAGE: tl.constexpr, DOT_PREC: tl.constexpr, SOFTCAP: tl.constexpr):
    """Online softmax of q [BLOCK_M, D] over tokens [tok0, tok1) of one block-table row."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    for start in range(tok0, tok1, BLOCK_N):
        tm, bid, within = _tile_rows(bt_row_ptr, start, tok1, BLOCK_N, PAGE)
        k = _load_tile(k_ptr, bid, within, tm, s_kb, s_kt, head, s_kh, HEAD_D)
        s = _scores(q, k, qk_scale, cap_in, cap_out, DOT_PREC, SOFTCAP)
        acc, m_i, l_i = _accumulate(s, tm, bid, within, m_i, l_i, acc, v_ptr, s_vb, s_vt, head,
                                    s_vh, HEAD_D, DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def _store_partial(ws_o, ws_lse, req, slot, qh, rowok, acc, m_i, l_i, S, HQ,
                   HEAD_D: tl.constexpr):
    offs_d = tl.arange(0, HEAD_D)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    base = (req.to(tl.int64) * S + slot) * HQ + qh
    tl.store(ws_lse + base, lse, mask=rowok)
    tl.store(ws_o + base[:, None] * HEAD_D + offs_d[None, :], acc / l_safe[:, None],
             mask=rowok[:, None])


@triton.jit
def _shared_unit(w, q_ptr, s_qb, s_qh, k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                 bt_ptr, s_bt, sl_ptr, sh_row, sh_c0, sh_c1, sh_slot, sh_nmem, sh_mem,
                 ws_o, ws_lse, qk_scale, cap_in, cap_out, S, HQ, HKV, G,
                 QPK: tl.constexpr, NSUB: tl.constexpr, MSUB: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
                 PAGE: tl.constexpr, DOT_PREC: tl.constexpr, SOFTCAP: tl.constexpr):
    """Unit (item, member sub-tile, kv head): members x QPK query heads as one M tile."""
    item = w // (NSUB * HKV)
    rem = w % (NSUB * HKV)
    sub = rem // HKV
    head = rem % HKV
    nmem = tl.load(sh_nmem + item)
    if sub * MSUB < nmem:
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_D)
        mi = offs_m // QPK
        mrow = sub * MSUB + mi
        rowok = (mi < MSUB) & (mrow < nmem)
        req = tl.load(sh_mem + item * G + mrow, mask=rowok, other=0)
        qh = head * QPK + offs_m % QPK
        q = tl.load(q_ptr + req[:, None].to(tl.int64) * s_qb + qh[:, None] * s_qh
                    + offs_d[None, :], mask=rowok[:, None], other=0.0)
        row = tl.load(sh_row + item)
        tok0 = tl.load(sh_c0 + item) * PAGE
        tok1 = tl.minimum(tl.load(sh_c1 + item) * PAGE, tl.load(sl_ptr + row))
        acc, m_i, l_i = _attend(q, k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                                bt_ptr + row.to(tl.int64) * s_bt, head, tok0, tok1,
                                qk_scale, cap_in, cap_out, BLOCK_M, BLOCK_N, HEAD_D, PAGE,
                                DOT_PREC, SOFTCAP)
        _store_partial(ws_o, ws_lse, req, tl.load(sh_slot + item), qh, rowok,
                       acc, m_i, l_i, S, HQ, HEAD_D)


@triton.jit
def _private_range(q_ptr, s_qb, s_qh, k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                   bt_ptr, s_bt, len_ptr, slot_off_ptr, ws_o, ws_lse, b, head, sp, nsplit,
                   qk_scale, cap_in, cap_out, window, S, HQ,
                   QPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEAD_D: tl.constexpr, PAGE: tl.constexpr, DOT_PREC: tl.constexpr,
                   SLOT_OFF: tl.constexpr, SOFTCAP: tl.constexpr):
    """Request b, kv head, split sp of nsplit (even in blocks): its QPK query heads (M padded)
    over block-table row b, tokens [lo, len[b]) with lo = max(0, len[b] - window) when
    ``window > 0`` else 0; one partial into slot (offset +) sp."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    rowok = offs_m < QPK
    qh = head * QPK + tl.where(rowok, offs_m, 0)
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + qh[:, None] * s_qh + offs_d[None, :],
                mask=rowok[:, None], other=0.0)
    n = tl.load(len_ptr + b)
    lo = tl.where(window > 0, tl.maximum(n - window, 0), 0)
    first = lo // PAGE
    cols = tl.cdiv(tl.cdiv(n, PAGE) - first, nsplit)
    tok0 = (first + sp * cols) * PAGE
    tok1 = tl.minimum(tok0 + cols * PAGE, n)
    tok0 = tl.maximum(tok0, lo)
    acc, m_i, l_i = _attend(q, k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                            bt_ptr + b.to(tl.int64) * s_bt, head, tok0, tok1, qk_scale,
                            cap_in, cap_out, BLOCK_M, BLOCK_N, HEAD_D, PAGE, DOT_PREC, SOFTCAP)
    slot = sp
    if SLOT_OFF:
        slot += tl.load(slot_off_ptr + b)
    req = tl.zeros([BLOCK_M], tl.int32) + b
    _store_partial(ws_o, ws_lse, req, slot, qh, rowok, acc, m_i, l_i, S, HQ, HEAD_D)


@triton.jit
def _fca_attend_kernel(
        q_ptr, s_qb, s_qh, k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
        bt_ptr, s_bt, sl_ptr,
        n_shared_ptr, sh_row, sh_c0, sh_c1, sh_slot, sh_nmem, sh_mem,
        pv_bt, s_pv, pv_len, n_sh_slots, B,
        ws_o, ws_lse, counter_ptr, qk_scale, cap_in, cap_out, S, HQ, HKV, G,
        QPK: tl.constexpr, NSUB: tl.constexpr, MSUB: tl.constexpr, NSPLIT: tl.constexpr,
        BLOCK_M_SH: tl.constexpr, BLOCK_M_PV: tl.constexpr, BLOCK_N_SH: tl.constexpr,
        BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, PAGE: tl.constexpr,
        DOT_PREC: tl.constexpr, DO_SHARED: tl.constexpr, DO_PRIVATE: tl.constexpr,
        DYNAMIC: tl.constexpr, INTERLEAVE: tl.constexpr, SOFTCAP: tl.constexpr):
    """Persistent FCA pass over shared units (item, member sub-tile, kv head) and private
    units (request, split, kv head) of the plan's virtual private rows; each writes one
    partial per member. Shared units come first, or spread evenly among the private ones
    (``INTERLEAVE``); ``DYNAMIC`` takes units from an atomic counter."""
    n_sh = 0
    n_pv = 0
    if DO_SHARED:
        n_sh = tl.load(n_shared_ptr) * (NSUB * HKV)
    if DO_PRIVATE:
        n_pv = B * (NSPLIT * HKV)
    n_tot = n_sh + n_pv
    if DYNAMIC:
        w = tl.atomic_add(counter_ptr, 1)
    else:
        w = tl.program_id(0)
    while w < n_tot:
        if DO_SHARED and DO_PRIVATE:
            if INTERLEAVE:  # unit w is shared iff floor(w * n_sh / n_tot) steps up at w
                s0 = (w.to(tl.int64) * n_sh // n_tot).to(tl.int32)
                s1 = ((w + 1).to(tl.int64) * n_sh // n_tot).to(tl.int32)
                is_sh = s1 > s0
                i_sh = s0
                u = w - s0
            else:
                is_sh = w < n_sh
                i_sh = w
                u = w - n_sh
            if is_sh:
                _shared_unit(i_sh, q_ptr, s_qb, s_qh, k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt,
                             s_vh, bt_ptr, s_bt, sl_ptr, sh_row, sh_c0, sh_c1, sh_slot,
                             sh_nmem, sh_mem, ws_o, ws_lse, qk_scale, cap_in, cap_out, S, HQ, HKV,
                             G, QPK, NSUB, MSUB, BLOCK_M_SH, BLOCK_N_SH, HEAD_D, PAGE, DOT_PREC,
                             SOFTCAP)
            else:
                _private_range(q_ptr, s_qb, s_qh, k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt,
                               s_vh, pv_bt, s_pv, pv_len, n_sh_slots, ws_o, ws_lse,
                               u // (NSPLIT * HKV), u % HKV, (u // HKV) % NSPLIT, NSPLIT,
                               qk_scale, cap_in, cap_out, 0, S, HQ, QPK, BLOCK_M_PV, BLOCK_N,
                               HEAD_D, PAGE, DOT_PREC, True, SOFTCAP)
        elif DO_SHARED:
            _shared_unit(w, q_ptr, s_qb, s_qh, k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt,
                         s_vh, bt_ptr, s_bt, sl_ptr, sh_row, sh_c0, sh_c1, sh_slot,
                         sh_nmem, sh_mem, ws_o, ws_lse, qk_scale, cap_in, cap_out, S, HQ, HKV,
                         G, QPK, NSUB, MSUB, BLOCK_M_SH, BLOCK_N_SH, HEAD_D, PAGE, DOT_PREC,
                         SOFTCAP)
        else:
            _private_range(q_ptr, s_qb, s_qh, k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt,
                           s_vh, pv_bt, s_pv, pv_len, n_sh_slots, ws_o, ws_lse,
                           w // (NSPLIT * HKV), w % HKV, (w // HKV) % NSPLIT, NSPLIT,
                           qk_scale, cap_in, cap_out, 0, S, HQ, QPK, BLOCK_M_PV, BLOCK_N,
                           HEAD_D, PAGE, DOT_PREC, True, SOFTCAP)
        if DYNAMIC:
            w = tl.atomic_add(counter_ptr, 1)
        else:
            w += tl.num_programs(0)


@triton.jit
def _paged_decode_kernel(
        q_ptr, s_qb, s_qh, k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
        bt_ptr, s_bt, sl_ptr, out_ptr, s_ob, s_oh, lse_ptr, ws_o, ws_lse, slot_off_ptr,
        qk_scale, cap_in, cap_out, window, S, HQ,
        QPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_D: tl.constexpr, PAGE: tl.constexpr, DOT_PREC: tl.constexpr,
        SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr, SLOT_OFF: tl.constexpr,
        SOFTCAP: tl.constexpr):
    """Plain paged decode, no sharing: program (request, kv head, split) reads its own blocks.
    With SPLIT it writes a partial per split into slot (offset +) split, for
    ``_merge_partials_kernel``; FCA runs it on the plan's virtual private rows."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.program_id(2)
    if SPLIT:
        _private_range(q_ptr, s_qb, s_qh, k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                       bt_ptr, s_bt, sl_ptr, slot_off_ptr, ws_o, ws_lse, b, head, sp,
                       tl.num_programs(2), qk_scale, cap_in, cap_out, window, S, HQ, QPK,
                       BLOCK_M, BLOCK_N, HEAD_D, PAGE, DOT_PREC, SLOT_OFF, SOFTCAP)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_D)
        rowok = offs_m < QPK
        qh = head * QPK + tl.where(rowok, offs_m, 0)
        q = tl.load(q_ptr + b.to(tl.int64) * s_qb + qh[:, None] * s_qh + offs_d[None, :],
                    mask=rowok[:, None], other=0.0)
        n = tl.load(sl_ptr + b)
        lo = tl.where(window > 0, tl.maximum(n - window, 0), 0)
        acc, m_i, l_i = _attend(q, k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                                bt_ptr + b.to(tl.int64) * s_bt, head, lo, n,
                                qk_scale, cap_in, cap_out, BLOCK_M, BLOCK_N, HEAD_D, PAGE,
                                DOT_PREC, SOFTCAP)
        out = acc / l_i[:, None]
        tl.store(out_ptr + b.to(tl.int64) * s_ob + qh[:, None] * s_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rowok[:, None])
        if WRITE_LSE:
            tl.store(lse_ptr + b * HQ + qh, (m_i + tl.log2(l_i)) * 0.6931471805599453,
                     mask=rowok)


@triton.jit
def _merge_partials_kernel(ws_o, ws_lse, n_slots_ptr, out_ptr, s_ob, s_oh, lse_ptr,
                           counter_ptr, S, HQ,
                           QPK: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_D: tl.constexpr,
                           HAS_NSLOTS: tl.constexpr, NSLOT_ADD: tl.constexpr,
                           WRITE_LSE: tl.constexpr, RESET: tl.constexpr):
    """out[b, heads of kv head h] = exact log-sum-exp merge of the request's partials
    (slots ``0 .. n_slots[b] + NSLOT_ADD``; empty partials carry lse = -inf)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    if RESET:
        if (b == 0) & (head == 0):
            tl.store(counter_ptr, 0)
            tl.store(counter_ptr + 1, 0)
    n = NSLOT_ADD
    if HAS_NSLOTS:
        n += tl.load(n_slots_ptr + b)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_D)
    hm = offs_h < QPK
    qh = head * QPK + tl.where(hm, offs_h, 0)
    m_run = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_D], tl.float32)
    for s in range(n):
        base = (b.to(tl.int64) * S + s) * HQ + qh
        lse_s = tl.load(ws_lse + base, mask=hm, other=float("-inf"))
        o_s = tl.load(ws_o + base[:, None] * HEAD_D + offs_d[None, :], mask=hm[:, None],
                      other=0.0)
        m_new = tl.maximum(m_run, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)
        w_s = tl.exp2(lse_s - m_safe)
        l_run = l_run * alpha + w_s
        acc = acc * alpha[:, None] + w_s[:, None] * o_s
        m_run = m_new
    out = acc / l_run[:, None]
    tl.store(out_ptr + b.to(tl.int64) * s_ob + qh[:, None] * s_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hm[:, None])
    if WRITE_LSE:
        tl.store(lse_ptr + b * HQ + qh, (m_run + tl.log2(l_run)) * 0.6931471805599453, mask=hm)
