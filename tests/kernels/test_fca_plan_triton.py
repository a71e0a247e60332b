"""The forest planner in Triton (``plan_forest(backend="triton")``, ``plan_kernel.py``) against
the torch planner, field by field, on random forests.

CPU: the kernels under ``TRITON_INTERPRET=1`` (in a child process) on handcrafted and random
forests — ragged, multi-level, shuffled ids, tables padded far past the longest request (as the
sampler's CUDA graphs pass them; also with every scratch buffer handed over full of junk), int64
tables, every cost-model knob — each plan also checked
for its invariants and run through the plain-torch executor against the fp32 reference, and
through ``fca_decode``'s Triton kernels; the kernels compiled for sm_90 (no GPU needed: the
interpreter does not check types the compiler does); the backend's input errors.
GPU (``-m gpu``): the same comparison at the sampler's sizes, and the plan captured in a CUDA
graph replaying to the eager plan on new tables.
"""
from __future__ import annotations

import os
import random
import sys

import pytest
import torch
from polynya.kernels.fca import DecodeConfig, fca_decode, plan_forest
from polynya.kernels.fca.reference import paged_decode_reference
from polynya.kernels.fca.testing import build_forest, plan_difference
from test_fca_plan import check_invariants, execute_plan
from triton_interp import check_under_interpreter

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def assert_same_plan(want, got) -> int:
    """Every work-list field equal (entries past ``n_shared`` and the dump slot are scratch);
    returns the number of shared items."""
    assert (got.max_shared_slots, got.cap, got.max_group) == \
        (want.max_shared_slots, want.cap, want.max_group)
    diff = plan_difference(want, got)
    assert diff is None, f"torch != triton in {diff}"
    return int(want.n_shared.item())


def random_levels(rng: random.Random) -> list:
    """1-4 levels of (fanout, tokens), lengths sometimes ragged."""
    levels = []
    for _ in range(rng.randint(1, 4)):
        lo = rng.randint(1, 20)
        tokens = (lo, lo + rng.randint(0, 25)) if rng.random() < 0.5 else lo
        levels.append((rng.randint(1, 4), tokens))
    return levels


def cases():
    """(block tables, seq lens, block size, plan kwargs) for the interpreter child."""
    rng = random.Random(2026)
    fixed = [[(2, 24), (3, (5, 11))], [(1, 16), (3, 12), (2, (1, 9))], [(5, (3, 30))],
             [(2, 13), (3, 7), (2, (1, 6))], [(1, 8), (2, 8), (1, 8), (2, 8), (2, 5)],
             [(1, 16), (11, (1, 7))], [(1, 2)] + [(2, 2)] * 5 + [(1, 3)]]
    knobs = [{"min_shared_tokens": 4}, {"min_shared_tokens": 0, "chunk_tokens": 8},
             {"min_shared_tokens": 4, "max_group": 2}, {"min_shared_tokens": 2, "max_levels": 1},
             {"min_shared_tokens": 12, "max_levels": 2, "chunk_tokens": 16, "max_group": 3}, {}]
    out = []
    for i, levels in enumerate(fixed + [random_levels(rng) for _ in range(14)]):
        bs = (2, 4, 8)[i % 3]
        bt, sl, _ = build_forest(levels, bs, seed=i)
        if i % 4 == 1:  # padded far past the longest row, as the sampler's graphs pass tables
            pad = torch.full((bt.shape[0], 3 * bt.shape[1] + 5), -1 if i % 8 == 1 else 0,
                             dtype=torch.int32)
            bt = torch.cat([bt, pad], 1)
        if i % 5 == 2:
            bt, sl = bt.long(), sl.long()
        out.append((bt, sl, bs, knobs[i % len(knobs)]))
    return out


def _interp_cases():
    """Runs in the child process (TRITON_INTERPRET=1)."""
    shared_total = 0
    for i, (bt, sl, bs, kw) in enumerate(cases()):
        want = plan_forest(bt, sl, bs, backend="torch", **kw)
        got = plan_forest(bt, sl, bs, backend="triton", **kw)
        shared_total += assert_same_plan(want, got)
        check_invariants(got, bt, sl, bs)
        g = torch.Generator().manual_seed(i)
        nb = int(bt.max()) + 1
        q = torch.randn(bt.shape[0], 4, 16, generator=g)
        k, v = torch.randn(nb, bs, 2, 16, generator=g), torch.randn(nb, bs, 2, 16, generator=g)
        ref = paged_decode_reference(q, k, v, bt.clamp(min=0), sl)
        torch.testing.assert_close(execute_plan(got, q, k, v), ref, atol=1e-5, rtol=1e-5)
        if i < 4:  # the decode kernels on the Triton plan (slow under the interpreter)
            cfg = DecodeConfig(block_n=16, block_m_shared=16, progs_per_sm=1, mode="split")
            out = fca_decode(q, k, v, got, backend="triton", config=cfg)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert shared_total > 50, shared_total  # the cases do share
    _poisoned_scratch()
    print("INTERP OK", len(cases()))


def _poisoned_scratch():
    """The plan does not depend on what its buffers held: every ``torch.empty`` the Triton
    planner makes comes filled with junk (flag bits and small counts that look like real
    item numbers and slots), as a CUDA graph's pool
    hands back a longer step's scratch; no pass may read a cell it did not write this call."""
    real_empty = torch.empty
    g = torch.Generator().manual_seed(99)

    def junk(*size, **kw):
        t = real_empty(*size, **kw)
        if t.dtype in (torch.int32, torch.int64):
            t.copy_(torch.randint(0, 4, t.shape, generator=g).to(t.dtype))
        return t

    for bt, sl, bs, kw in [c for i, c in enumerate(cases()) if i % 4 == 1][:4]:
        want = plan_forest(bt, sl, bs, backend="torch", **kw)
        torch.empty = junk
        try:
            got = plan_forest(bt, sl, bs, backend="triton", **kw)
        finally:
            torch.empty = real_empty
        assert_same_plan(want, got)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter is on")
def test_triton_planner_under_interpreter():
    check_under_interpreter(__file__)


def test_planner_kernels_compile_for_hopper():
    """Compiled for sm_90 on this machine (PTX and cubin; no GPU): catches the type errors the
    interpreter lets through, e.g. loop-carried scalars, 1-specialised sizes."""
    triton = pytest.importorskip("triton")
    from polynya.kernels.fca import plan_kernel as pk
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptrs = {"rows": ["cnt_ptr", "rank_ptr", "bt_ptr", "sl_ptr", "run_end_ptr", "flags_ptr",
                     "slot_ptr", "tpre_ptr", "end_ptr", "n_sh_slots_ptr", "pv_bt_ptr",
                     "pv_len_ptr", "row_tiles_ptr", "row_ids_ptr"],
            "offsets": ["row_tiles_ptr", "row_ids_ptr", "row_off_ptr", "n_shared_ptr",
                        "id_range_ptr"],
            "items": ["cnt_ptr", "rank_ptr", "rep_ptr", "flags_ptr", "slot_ptr", "tpre_ptr",
                      "end_ptr", "row_off_ptr", "sh_mem_ptr", "sh_fields_ptr", "sl_ptr"],
            "classes": ["bt_ptr", "sl_ptr", "cnt_ptr", "rep_ptr", "rank_ptr"]}
    ints = {"rows": ["MB", "C", "G", "min_tokens", "max_levels"], "offsets": ["B"],
            "items": ["MB", "G", "cap"], "classes": ["B", "MB"]}
    consts = {"rows": {"PAGE": 16, "BLOCK_J": 128}, "offsets": {"BLOCK_B": 128},
              "items": {"PAGE": 16, "BLOCK_J": 128}, "classes": {"PAGE": 16, "BLOCK_B": 64, "BLOCK_J": 128,
                                                                  "BLOCK_C": 64}}
    kernels = {"rows": pk._plan_rows_kernel, "offsets": pk._plan_offsets_kernel,
               "items": pk._plan_items_kernel, "classes": pk._fca_classes_kernel}
    for name, fn in kernels.items():
        for ones in (False, True):  # plain int arguments, and every one specialised to 1
            sig = {p: "*i32" for p in ptrs[name]}
            sig.update({i: ("constexpr" if ones else "i32") for i in ints[name]})
            sig.update({c: "constexpr" for c in consts[name]})
            const = dict(consts[name], **({i: 1 for i in ints[name]} if ones else {}))
            compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                                      target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            assert ".target sm_90" in compiled.asm["ptx"] and compiled.asm["cubin"], name


def test_plan_backend_errors():
    bt, sl, _ = build_forest([(2, 8), (2, 3)], 4, seed=11)
    with pytest.raises(ValueError, match="backend must be"):
        plan_forest(bt, sl, 4, backend="cuda")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            plan_forest(bt, sl, 4, backend="triton")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("levels, width", [
    ([(8, 4096), (16, (1, 512))], 2560),       # the sampler's G16 P4096 step, 40,960-token tables
    ([(8, 256), (8, (1, 128))], 2560),          # GSM8K-like
    ([(1, 2048), (64, 512), (8, 512)], None),
    ([(3, (100, 900)), (5, (1, 300)), (3, (1, 200))], 512),
])
def test_triton_planner_matches_torch_on_gpu(levels, width):
    bs = 16
    bt, sl, _ = build_forest(levels, bs, seed=12)
    if width is not None:
        bt = torch.cat([bt, torch.zeros(bt.shape[0], width - bt.shape[1], dtype=torch.int32)], 1)
    bt, sl = bt.cuda(), sl.cuda()
    want = plan_forest(bt, sl, bs, backend="torch")
    got = plan_forest(bt, sl, bs, backend="triton")
    assert assert_same_plan(want, got) > 0
    assert_same_plan(want, plan_forest(bt, sl, bs))  # "auto" is the Triton planner on CUDA
    assert_same_plan(plan_forest(bt.cpu(), sl.cpu(), bs), got)
    if bt.shape[0] <= 200:
        check_invariants(got, bt, sl, bs)
    # captured in a CUDA graph (as the sampler runs it): replays to the eager plan on new tables
    bt2, sl2, _ = build_forest(levels, bs, seed=13)
    bt2 = torch.cat([bt2, torch.zeros(bt2.shape[0], bt.shape[1] - bt2.shape[1], dtype=torch.int32)], 1)
    static_bt, static_sl = bt.clone(), sl.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        plan_forest(static_bt, static_sl, bs, backend="triton", validate=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = plan_forest(static_bt, static_sl, bs, backend="triton", validate=False)
    static_bt.copy_(bt2.cuda())
    static_sl.copy_(sl2.cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert_same_plan(plan_forest(bt2.cuda(), sl2.cuda(), bs, backend="torch"), captured)
    # then a step of the same rows with a quarter of the lengths: the replay reuses the longer
    # step's scratch, which the passes (bounded by each row's own columns) must not read
    quarter = [(f, tuple(max(1, x // 4) for x in t) if isinstance(t, tuple) else max(1, t // 4))
               for f, t in levels]
    bt3, sl3, _ = build_forest(quarter, bs, seed=14)
    assert bt3.shape[0] == bt.shape[0] and int(sl3.max()) < int(sl2.max())
    static_bt.zero_()[:, :bt3.shape[1]].copy_(bt3.cuda())
    static_sl.copy_(sl3.cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert_same_plan(plan_forest(static_bt, static_sl, bs, backend="torch"), captured)


if __name__ == "__main__" and sys.argv[1:] == ["interp"]:
    _interp_cases()
