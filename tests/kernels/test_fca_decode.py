"""fca_decode / paged_decode against the fp32 reference, on fresh random paged caches.

CPU: the reference against an fp64 per-request loop; the CPU fallback; input errors; the Triton
kernels under ``TRITON_INTERPRET=1`` on tiny fp32 shapes (in a child process, since the
interpreter must be chosen before Triton kernels are defined; bf16 dots are wrong there).
GPU (``-m gpu``): every dtype, head dims 64/128/256, block sizes 16/32/64, GQA, ragged
forests; bf16/fp16 must be within 2x the error of torch's own low-precision attention; CUDA
graph capture of plan + decode must replay to the eager result on a new batch.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from polynya.kernels.fca import DecodeConfig, fca_decode, paged_decode, plan_forest
from polynya.kernels.fca.reference import paged_decode_reference
from polynya.kernels.fca.testing import build_forest, random_kv
from triton_interp import run_under_interpreter

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def loop_reference(q, k, v, bt, sl, scale=None, softcap=None, window=None):
    """Independent fp64 oracle: one request at a time, K/V gathered token by token (the last
    ``window`` of them when given; scores soft-capped when ``softcap``)."""
    B, Hq, D = q.shape
    bs, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    lse = torch.empty(B, Hq, dtype=torch.float64)
    for b in range(B):
        n = int(sl[b])
        keep = range(max(0, n - window) if window else 0, n)
        ks = torch.stack([k[int(bt[b, t // bs]), t % bs] for t in keep]).double()
        vs = torch.stack([v[int(bt[b, t // bs]), t % bs] for t in keep]).double()
        for h in range(Hq):
            s = ks[:, h // (Hq // Hkv)] @ q[b, h].double() * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            lse[b, h] = torch.logsumexp(s, 0)
            out[b, h] = torch.softmax(s, 0) @ vs[:, h // (Hq // Hkv)]
    return out, lse


def make_case(levels, bs, hq, hkv, d, dtype, device, seed):
    bt, sl, nb = build_forest(levels, bs, seed=seed, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    k, v = random_kv(nb, bs, hkv, d, dtype, device, g)
    q = torch.randn(bt.shape[0], hq, d, device=device, generator=g).to(dtype)
    return q, k, v, bt, sl


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
def test_reference_matches_loop(hq, hkv):
    q, k, v, bt, sl = make_case([(2, 9), (3, (1, 10))], 4, hq, hkv, 8, torch.float32, "cpu", 1)
    out, lse = paged_decode_reference(q, k, v, bt, sl, scale=0.3, return_lse=True)
    ref, ref_lse = loop_reference(q, k, v, bt, sl, scale=0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap,window", [(0.7, None), (None, 5), (1.5, 9), (None, 1)])
def test_reference_softcap_and_window_match_loop(softcap, window):
    q, k, v, bt, sl = make_case([(2, 9), (3, (1, 10))], 4, 6, 2, 8, torch.float32, "cpu", 6)
    q = q * 3  # scores well past the cap
    out, lse = paged_decode_reference(q, k, v, bt, sl, scale=0.3, return_lse=True,
                                      softcap=softcap, window=window)
    ref, ref_lse = loop_reference(q, k, v, bt, sl, 0.3, softcap, window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    plain = paged_decode_reference(q, k, v, bt, sl, scale=0.3)
    assert (out - plain).abs().max() > 1e-3  # the modifier changed the answer
    if softcap is not None and window is None:  # FCA: soft-caps (windows run paged)
        plan = plan_forest(bt, sl, 4, min_shared_tokens=4)
        torch.testing.assert_close(fca_decode(q, k, v, plan, scale=0.3, softcap=softcap), out)
    torch.testing.assert_close(paged_decode(q, k, v, bt, sl, scale=0.3, softcap=softcap,
                                            window=window), out)


@pytest.mark.parametrize("bad", [dict(softcap=0.0), dict(softcap=-1), dict(window=0),
                                 dict(window=2.5), dict(window=True)])
def test_bad_modifiers_are_rejected(bad):
    q, k, v, bt, sl = make_case([(2, 8), (2, 5)], 4, 4, 2, 16, torch.float32, "cpu", 3)
    with pytest.raises(ValueError, match="softcap|window"):
        paged_decode(q, k, v, bt, sl, **bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_fallback(dtype):
    q, k, v, bt, sl = make_case([(2, 12), (3, (1, 10))], 4, 4, 2, 16, dtype, "cpu", 2)
    plan = plan_forest(bt, sl, 4, min_shared_tokens=4)
    out, lse = fca_decode(q, k, v, plan, return_lse=True)
    out2 = paged_decode(q, k, v, bt, sl)
    ref, ref_lse = loop_reference(q, k, v, bt, sl)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == q.shape[:2]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(out2.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def _bad_inputs(kind):
    q, k, v, bt, sl = make_case([(2, 8), (2, 5)], 4, 4, 2, 16, torch.float32, "cpu", 3)
    if kind == "dtype":
        q = q.to(torch.int32)
    elif kind == "mixed":
        k = k.to(torch.bfloat16)
    elif kind == "kv_shape":
        v = v[:, :, :1]
    elif kind == "gqa":
        q = q[:, :3]
    elif kind == "head_dim":
        q = q[..., :8]
    elif kind == "batch":
        q = q[:-1]
    elif kind == "id_high":
        bt[1, 0] = k.shape[0]
    elif kind == "id_neg":
        bt[0, 1] = -2
    elif kind == "device":
        q = q.to("meta")
    elif kind == "rank":
        q = q[0]
    return q, k, v, bt, sl


@pytest.mark.parametrize("kind", ["dtype", "mixed", "kv_shape", "gqa", "head_dim", "batch",
                                  "id_high", "id_neg", "device", "rank"])
def test_input_errors(kind):
    q, k, v, bt, sl = _bad_inputs(kind)
    with pytest.raises(ValueError):
        paged_decode(q, k, v, bt, sl)
    with pytest.raises(ValueError):
        fca_decode(q, k, v, plan_forest(bt, sl, 4))


def test_plan_mismatch_errors():
    q, k, v, bt, sl = make_case([(2, 8), (2, 5)], 4, 4, 2, 16, torch.float32, "cpu", 4)
    with pytest.raises(ValueError):
        fca_decode(q, k, v, plan_forest(bt, sl, 2))  # plan for another block size
    with pytest.raises(ValueError):
        fca_decode(q, k, v, (bt, sl))
    sl0 = sl.clone()
    sl0[0] = 0
    with pytest.raises(ValueError):
        paged_decode(q, k, v, bt, sl0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter is on")
def test_triton_backend_on_cpu_needs_interpreter():
    q, k, v, bt, sl = make_case([(2, 8), (2, 5)], 4, 4, 2, 16, torch.float32, "cpu", 5)
    with pytest.raises(ValueError):
        paged_decode(q, k, v, bt, sl, backend="triton")


def _interp_cases():
    """Runs in the child process (TRITON_INTERPRET=1): the Triton kernels on tiny fp32 cases."""
    from polynya.kernels.fca.plan import classes_triton
    from polynya.kernels.fca.plan import _classes_torch

    cases = [
        # levels, bs, hq, hkv, d, plan kwargs, config
        ([(2, 24), (3, (5, 11))], 4, 4, 2, 16, {"chunk_tokens": 8},
         DecodeConfig(block_n=16, block_m_shared=16, progs_per_sm=1)),
        ([(1, 16), (2, 12), (3, (1, 9))], 8, 8, 1, 32, {"max_group": 4},
         DecodeConfig(block_n=16, block_m_shared=16, dynamic=False, mode="split")),
        ([(5, (3, 30))], 4, 2, 2, 16, {}, DecodeConfig(block_n=32, num_stages=1, mode="streams")),
        ([(2, 13), (2, 7), (2, (1, 6))], 4, 6, 3, 16, {"chunk_tokens": 4},
         DecodeConfig(block_n=16, block_m_shared=32, interleave=True, block_n_shared=32)),
        # shared nodes of 1, 2 and 3 tiles with ragged last tiles, 2 levels, chunked
        ([(2, 40), (2, 13), (3, (5, 11))], 4, 4, 2, 16, {},
         DecodeConfig(block_n=16, block_m_shared=16, progs_per_sm=1)),
        ([(2, 36), (2, 7), (2, (1, 6))], 4, 6, 3, 16, {"chunk_tokens": 24},
         DecodeConfig(block_n=16, block_m_shared=32, mode="split", block_n_shared=16)),
    ]
    for i, (levels, bs, hq, hkv, d, pkw, cfg) in enumerate(cases):
        q, k, v, bt, sl = make_case(levels, bs, hq, hkv, d, torch.float32, "cpu", 10 + i)
        plan = plan_forest(bt, sl, bs, min_shared_tokens=4, **pkw)
        assert int(plan.n_shared.item()) > 0 or i == 2
        ref, ref_lse = paged_decode_reference(q, k, v, bt, sl, return_lse=True)
        for _ in range(2):  # twice: the scheduler's counters must be reset by the merge
            out, lse = fca_decode(q, k, v, plan, return_lse=True, backend="triton", config=cfg)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
        for splits in (None, 3):
            out, lse = paged_decode(q, k, v, bt, sl, return_lse=True, backend="triton",
                                    config=cfg, num_splits=splits)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
        cap, win = (0.8, None) if i % 2 else (None, 2 * bs + 3)
        q3 = q * 3  # scores past the cap; the window cuts mid-page
        for mod in (dict(softcap=cap, window=win), dict(softcap=1.3, window=bs)):
            ref_m, ref_m_lse = paged_decode_reference(q3, k, v, bt, sl, return_lse=True, **mod)
            for splits in (None, 1, 3):
                out, lse = paged_decode(q3, k, v, bt, sl, return_lse=True, backend="triton",
                                        config=cfg, num_splits=splits, **mod)
                torch.testing.assert_close(out, ref_m, atol=2e-5, rtol=2e-5)
                torch.testing.assert_close(lse, ref_m_lse, atol=2e-5, rtol=2e-5)
        ref_c = paged_decode_reference(q3, k, v, bt, sl, softcap=0.9)
        out = fca_decode(q3, k, v, plan, backend="triton", config=cfg, softcap=0.9)
        torch.testing.assert_close(out, ref_c, atol=2e-5, rtol=2e-5)
        full = (torch.arange(bt.shape[1])[None] + 1) * bs <= sl[:, None]
        cnt, rep, rank = _classes_torch(bt, full)
        got = classes_triton(bt, sl, bs)
        live = cnt > 0
        for a, b in zip(got, (cnt, rep, rank)):
            assert torch.equal(torch.where(live, a, 0), torch.where(live, b, 0))
    print("INTERP OK", len(cases))


def test_triton_kernels_under_interpreter():
    run_under_interpreter(__file__)


# ---------------------------------------------------------------- GPU

def lowp_reference(q, k, v, bt, sl):
    """torch's own attention in q.dtype (low-precision matmuls), for the error budget."""
    B, Hq, D = q.shape
    bs, Hkv = k.shape[1], k.shape[2]
    T = bt.shape[1] * bs
    kk = k[bt.long().clamp(min=0)].reshape(B, T, Hkv, D).repeat_interleave(Hq // Hkv, 2)
    vv = v[bt.long().clamp(min=0)].reshape(B, T, Hkv, D).repeat_interleave(Hq // Hkv, 2)
    s = torch.einsum("bhd,bthd->bht", q, kk).float() / math.sqrt(D)
    keep = torch.arange(T, device=q.device)[None, :] < sl[:, None]
    p = torch.softmax(s.masked_fill(~keep[:, None], float("-inf")), -1).to(q.dtype)
    return torch.einsum("bht,bthd->bhd", p, vv)


def assert_within_budget(out, q, k, v, bt, sl):
    ref = paged_decode_reference(q, k, v, bt, sl).float() if q.dtype == torch.float32 else \
        paged_decode_reference(q.float(), k.float(), v.float(), bt, sl)
    err = (out.float() - ref).abs().max().item()
    assert not math.isnan(err)
    if q.dtype == torch.float32:
        assert err < 1e-4, err
    else:
        budget = (lowp_reference(q, k, v, bt, sl).float() - ref).abs().max().item()
        assert err <= 2 * budget + 1e-6, (err, budget)


GPU_FORESTS = [[(4, (200, 700)), (6, (1, 300))],
               [(1, 300), (3, 150), (4, (1, 120))],
               [(12, (1, 900))]]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d,bs,hq,hkv,forest", [(128, 16, 32, 8, 0), (64, 32, 8, 8, 1),
                                                (256, 64, 16, 2, 2), (128, 16, 8, 1, 1),
                                                (128, 32, 32, 8, 2), (256, 16, 8, 4, 0)])
def test_gpu_matches_reference(dtype, d, bs, hq, hkv, forest):
    q, k, v, bt, sl = make_case(GPU_FORESTS[forest], bs, hq, hkv, d, dtype, "cuda", forest)
    plan = plan_forest(bt, sl, bs)
    out = fca_decode(q, k, v, plan)
    assert_within_budget(out, q, k, v, bt, sl)
    assert_within_budget(paged_decode(q, k, v, bt, sl), q, k, v, bt, sl)
    _, lse = fca_decode(q, k, v, plan, return_lse=True)
    _, ref_lse = paged_decode_reference(q.float(), k.float(), v.float(), bt, sl,
                                        return_lse=True)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("softcap,window", [(30.0, None), (None, 256), (20.0, 100)])
def test_gpu_softcap_and_window(dtype, softcap, window):
    """Gemma-2-style soft-caps (FCA and paged) and sliding windows (paged) vs the fp32
    reference; bf16 within 2x of torch's own bf16 attention under the same modifiers."""
    q, k, v, bt, sl = make_case(GPU_FORESTS[0], 16, 16, 4, 128, dtype, "cuda", 3)
    q = q * 4  # scores reach the cap
    mod = dict(softcap=softcap, window=window)
    ref = paged_decode_reference(q.float(), k.float(), v.float(), bt, sl, **mod)
    outs = [paged_decode(q, k, v, bt, sl, **mod)]
    if window is None:
        outs.append(fca_decode(q, k, v, plan_forest(bt, sl, 16), softcap=softcap))
    for out in outs:
        err = (out.float() - ref).abs().max().item()
        if dtype == torch.float32:
            assert err < 1e-4, err
        else:  # torch's own bf16 computation of the same modified attention
            budget = (_lowp_modified(q, k, v, bt, sl, **mod).float() - ref).abs().max().item()
            assert err <= 2 * budget + 1e-6, (err, budget)


def _lowp_modified(q, k, v, bt, sl, softcap=None, window=None):
    B, Hq, D = q.shape
    bs, Hkv = k.shape[1], k.shape[2]
    T = bt.shape[1] * bs
    kk = k[bt.long().clamp(min=0)].reshape(B, T, Hkv, D).repeat_interleave(Hq // Hkv, 2)
    vv = v[bt.long().clamp(min=0)].reshape(B, T, Hkv, D).repeat_interleave(Hq // Hkv, 2)
    s = (torch.einsum("bhd,bthd->bht", q, kk) / math.sqrt(D))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(T, device=q.device)[None, :]
    keep = (pos < sl[:, None]) & ((pos >= sl[:, None] - window) if window else True)
    p = torch.softmax(s.float().masked_fill(~keep[:, None], float("-inf")), -1).to(q.dtype)
    return torch.einsum("bht,bthd->bhd", p, vv)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cfg", [DecodeConfig(dynamic=False), DecodeConfig(mode="split"),
                                 DecodeConfig(mode="streams", shared_num_warps=8),
                                 DecodeConfig(block_n=32, num_stages=3, block_m_shared=128),
                                 DecodeConfig(interleave=True, block_n_shared=32),
                                 DecodeConfig(mode="fused", block_n_shared=32)])
def test_gpu_configs(cfg):
    q, k, v, bt, sl = make_case([(1, 500), (5, 200), (8, (1, 200))], 16, 32, 8, 128,
                                torch.bfloat16, "cuda", 7)
    plan = plan_forest(bt, sl, 16, max_group=8)
    assert_within_budget(fca_decode(q, k, v, plan, config=cfg), q, k, v, bt, sl)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["fused", "streams"])
def test_cuda_graph_capture_plan_and_decode(mode):
    levels = [(3, (300, 600)), (5, (1, 200))]
    bs, hq, hkv, d = 16, 32, 8, 128
    cases = [make_case(levels, bs, hq, hkv, d, torch.bfloat16, "cuda", s) for s in (20, 21)]
    width = max(c[3].shape[1] for c in cases)
    nb = max(c[1].shape[0] for c in cases)

    def padded(c):
        q, k, v, bt, sl = c
        bt = torch.nn.functional.pad(bt, (0, width - bt.shape[1]), value=-1)
        k2, v2 = random_kv(nb, bs, hkv, d, torch.bfloat16, "cuda")
        k2[:k.shape[0]], v2[:v.shape[0]] = k, v
        return q, k2, v2, bt, sl

    (q0, k0, v0, bt0, sl0), (q1, k1, v1, bt1, sl1) = padded(cases[0]), padded(cases[1])
    sq, sk, sv, sbt, ssl = (t.clone() for t in (q0, k0, v0, bt0, sl0))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    cfg = DecodeConfig(mode=mode, shared_progs_per_sm=1)
    with torch.cuda.stream(stream):  # warm-up compiles every kernel outside the capture
        fca_decode(sq, sk, sv, plan_forest(sbt, ssl, bs), return_lse=True, config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = plan_forest(sbt, ssl, bs)
        out, lse = fca_decode(sq, sk, sv, plan, return_lse=True, config=cfg)
    for q, k, v, bt, sl in ((q1, k1, v1, bt1, sl1), (q0, k0, v0, bt0, sl0)):
        for dst, src in zip((sq, sk, sv, sbt, ssl), (q, k, v, bt, sl)):
            dst.copy_(src)
        graph.replay()
        eager, eager_lse = fca_decode(q, k, v, plan_forest(bt, sl, bs), return_lse=True,
                                      config=cfg)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
        torch.testing.assert_close(lse, eager_lse, atol=0, rtol=0)
        assert_within_budget(out, q, k, v, bt, sl)


if __name__ == "__main__" and sys.argv[1:] == ["interp"]:
    _interp_cases()
