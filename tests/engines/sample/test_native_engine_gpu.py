"""GPU truth for the native sampler on a random Qwen3-0.6B-shaped model (skipped without CUDA).

fp32: greedy tokens equal HF ``generate`` exactly, with FCA + CUDA graphs and without.
bf16: every greedy token is within twice HF's own bf16 error of the fp32 model's best (exact
agreement with HF's bf16 ``generate`` breaks at the random model's near-ties; printed).
The decode step is compiled (``compile_decode``, on by default on CUDA) in every test but the
one that compares it with the eager step.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from polynya import SamplingParams
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine

from .test_compiled_decode import teacher_forced

pytestmark = pytest.mark.gpu
MODEL = "random:qwen3-0.6b"
NEW = 24


def prompts() -> list[list[int]]:
    g = np.random.default_rng(0)
    return [g.integers(100, 150000, size=n).tolist() for n in (37, 300, 129, 513)]


def make_engine(dtype: str, fca: bool = True, graphs: bool = True,
                compile_decode: bool | None = None) -> SamplingEngine:
    return SamplingEngine(SamplerConfig(MODEL, dtype=dtype, device="cuda", fca=fca, cuda_graphs=graphs,
                                        kv_cache_memory_gb=4, max_num_seqs=64, fca_min_shared_tokens=0,
                                        compile_decode=compile_decode))


def hf_greedy(engine: SamplingEngine) -> list[list[int]]:
    """HF ``generate`` with the engine's own weights (same module, switched to SDPA)."""
    model = engine.backend.runner.model
    model.set_attn_implementation("sdpa")
    out = []
    try:
        for p in prompts():
            ids = torch.tensor([p], device="cuda")
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    finally:
        model.set_attn_implementation("polynya_paged")
    return out


def engine_greedy(engine: SamplingEngine, n: int = 1) -> list[list[list[int]]]:
    before = engine.stats()["prefill_tokens"]
    out = engine.generate(prompts(), SamplingParams(n=n, temperature=0, max_tokens=NEW, stop_token_ids=()))
    assert engine.stats()["prefill_tokens"] - before == sum(map(len, prompts()))  # once per prompt
    return [[s.token_ids for s in o] for o in out]


def test_fp32_greedy_equals_hf_generate():
    for fca, graphs in ((True, True), (False, True), (True, False)):
        engine = make_engine("float32", fca, graphs)
        ref = hf_greedy(engine)
        for r, samples in zip(ref, engine_greedy(engine, n=3)):
            assert all(s == r for s in samples), (fca, graphs)
        stats = engine.stats()  # the prefill ran compiled (compile_prefill's default on CUDA)
        assert stats["prefill_compile_reason"] is None and stats["prefill_compiles"] >= 2
        del engine
        torch.cuda.empty_cache()


def near_argmax_slack(engine: SamplingEngine, runs: list[tuple[list[int], list[int]]]
                      ) -> list[list[float]]:
    """Per ``(prompt, greedy tokens)`` run and generated step: how far (in fp32 logits) the
    engine's greedy token lies below the fp32 model's best token, *minus* twice HF's own bf16
    error at that position
    (``max |bf16 logits - fp32 logits|``, HF's SDPA forward over the same tokens with the
    engine's bf16 weights and with the fp32 weights they were cast from). A value <= 0 means a
    bf16 model could pick that token; a wrong cache, position or prefill gives tokens far below
    the best (a random token sits several logits lower)."""
    from polynya.models import load_model

    model16 = engine.backend.runner.model
    model32 = load_model(MODEL, dtype="float32", device="cuda", attn_implementation="sdpa")
    model16.set_attn_implementation("sdpa")
    out = []
    try:
        with torch.no_grad():
            for p, toks in runs:
                ids = torch.tensor([p + toks[:-1]], device="cuda")
                at = slice(len(p) - 1, None)  # the positions whose logits chose the tokens
                l32 = model32(ids).logits[0, at].float()
                l16 = model16(ids).logits[0, at].float()
                err = (l16 - l32).abs().amax(-1)
                chosen = l32.gather(-1, torch.tensor(toks, device="cuda")[:, None])[:, 0]
                out.append((l32.amax(-1) - chosen - 2 * err).tolist())
    finally:
        model16.set_attn_implementation("polynya_paged")
        del model32
    return out


def test_bf16_greedy_tokens_are_near_argmax_of_the_fp32_model():
    """bf16 greedy decoding (compiled prefill and decode, CUDA graphs, FCA forks) picks, at
    every step, a token within twice HF's own bf16 error of the fp32 model's best: a random
    model's top logits lie within a few bf16 ulps (the first step's top two differ by 0.024 at
    logits near 2.8 for the first prompt, where one ulp is 0.016), so two bf16
    implementations may pick different tokens there, and exact agreement with HF's bf16
    ``generate`` is not a property of a correct engine (that assertion passed on the H200 on
    2026-12-03 and failed on the first token on an H100 on 2026-12-07, same code). The agreement
    is printed for the record."""
    engine = make_engine("bfloat16")
    got = engine_greedy(engine, n=2)
    ref = hf_greedy(engine)
    agree = [next((i for i, (a, b) in enumerate(zip(r, o[0])) if a != b), NEW) for r, o in zip(ref, got)]
    slack = near_argmax_slack(engine, [(p, toks) for p, o in zip(prompts(), got) for toks in o])
    worst = max(max(s) for s in slack)
    print(f"bf16 greedy agreement with HF generate (tokens of {NEW}): {agree}; "
          f"worst slack {worst:.4f}")
    assert worst <= 1e-3, [[round(x, 4) for x in s] for s in slack]


def test_sleep_wake_keeps_graphs_and_tokens():
    """Level-1 sleep releases the KV cache's memory; after wake the same greedy tokens come
    back, and with a virtual-memory cache (``KVMemory.stable``) no graph is captured again."""
    engine = make_engine("bfloat16")
    runner = engine.backend.runner
    first = engine_greedy(engine, n=2)
    captures = engine.stats()["graph_captures"]
    assert captures >= 1
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep(1)
    torch.cuda.synchronize()
    freed = torch.cuda.mem_get_info()[0] - free_awake
    assert freed >= 0.9 * runner.kv_bytes(), (freed, runner.kv_bytes())
    filler = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # the trainer's turn
    engine.wake()
    del filler
    assert engine_greedy(engine, n=2) == first
    if runner._kv_memory.stable:
        assert engine.stats()["graph_captures"] == captures


def test_compiled_decode_equals_eager():
    """``compile_decode``: fp32 greedy tokens of the compiled engine (through its CUDA graphs,
    n=3 forks = FCA steps, n=1 = paged steps) equal the eager engine's, with one compile per
    attention path for every batch bucket; teacher-forced decode logits (ragged rows, shared
    pages, down to one row) of the compiled step equal the eager step's in fp32 (1e-4), and in
    bf16 the compiled step's error against the fp32 logits is at most twice the eager bf16
    step's own error (same weights, cast)."""
    eager = make_engine("float32", compile_decode=False)
    comp = make_engine("float32", compile_decode=True)
    weights = list(eager.backend.runner.model.named_parameters())
    comp.load_weights(weights)
    for n in (3, 1):  # forks: FCA steps; distinct prompts alone: paged steps (prefix cache hits)
        params = SamplingParams(n=n, temperature=0, max_tokens=NEW, stop_token_ids=())
        want, got = (e.generate(prompts(), params) for e in (eager, comp))
        assert [[s.token_ids for s in o] for o in got] == [[s.token_ids for s in o] for o in want], n
    st = comp.stats()
    assert comp.backend.runner.compiled.error is None
    assert 0 < st["fca_steps"] < st["decode_steps"] and st["graph_captures"] >= 2
    assert st["compiles"] == 2, st  # FCA and paged graphs; every bucket shares them
    print(f"compiled decode: {st['compiles']} compiles in {st['compile_s']:.1f} s, "
          f"{st['graph_captures']} graph captures in {st['graph_capture_s']:.1f} s")

    runner = comp.backend.runner
    ref32 = {fca: teacher_forced(runner, runner._decode_eager, fca) for fca in (True, False)}
    for fca, ref in ref32.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        got = teacher_forced(runner, runner.compiled, fca)
        extra = torch.cuda.max_memory_allocated() - base
        # the op writes the cache in place: Inductor must not work on a copy of it
        assert extra < 0.25 * runner.kv_bytes(), (extra, runner.kv_bytes())
        worst = max((a - b).abs().max().item() for a, b in zip(got, ref))
        print(f"fp32 fca={fca}: compiled vs eager max |dlogit| {worst:.2e}")
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    del eager, comp
    torch.cuda.empty_cache()

    bf16 = make_engine("bfloat16", compile_decode=True)
    bf16.load_weights([(n, p.to(torch.bfloat16)) for n, p in weights])
    runner = bf16.backend.runner
    for fca, ref in ref32.items():
        err = {}
        for name, forward in (("eager", runner._decode_eager), ("compiled", runner.compiled)):
            got = teacher_forced(runner, forward, fca)
            err[name] = max((a - b).abs().max().item() for a, b in zip(got, ref))
        print(f"bf16 fca={fca}: max |dlogit| vs fp32: eager {err['eager']:.3e}, "
              f"compiled {err['compiled']:.3e}")
        assert err["compiled"] <= 2 * err["eager"], err
    assert runner.compiled.error is None
