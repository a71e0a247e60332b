"""The compiled decode step (``SamplerConfig.compile_decode``, Inductor on CPU) equals the eager
one, for a full-attention family with q/k norms (Qwen3) and a windowed, soft-capped one
(Gemma 2), in both compile scopes (one decoder layer's graph reused by every layer, or the
whole model): every step's full logits over a teacher-forced multi-step decode (ragged rows,
shared pages, the batch shrinking to one row; FCA and paged), and greedy tokens + log-probs
over generates with forks, ragged prompts and a batch of one (padded to two rows). One
compile per attention path (and layer kind, per layer scope) serves every CUDA-graph bucket
and every layer, however many; a model whose layers cannot be found compiles whole; past the
compile bound, or when a compile fails, the runner decodes eagerly with a warning and the
same numbers.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from polynya import SamplingParams
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine
from polynya.engines.sample.native import compiled
from polynya.models import TINY_SLIDING_WINDOW
from torch._dynamo.exc import Unsupported

NEW = 6
# compiles of a runner that decoded both attention paths (FCA, paged): one graph per path, and
# in the layer scope per layer kind too (Gemma 2 alternates windowed and full layers, whose
# graphs differ in the window and, on FCA steps, in the op: windowed layers decode paged)
COMPILES = {("qwen3", "layers"): 2, ("gemma2", "layers"): 4, ("qwen3", "model"): 2,
            ("gemma2", "model"): 2}


def make_engine(family: str, compile_decode: bool, scope: str = "layers",
                compile_prefill: bool | None = None) -> SamplingEngine:
    return SamplingEngine(SamplerConfig(f"tiny:{family}", dtype="float32", device="cpu", num_blocks=64,
                                        max_num_seqs=8, fca_min_shared_tokens=0,
                                        compile_decode=compile_decode, compile_scope=scope,
                                        compile_prefill=compile_prefill))


def calls(seed: int) -> list[tuple[list[list[int]], SamplingParams]]:
    """Forks of ragged prompts behind a shared system prompt longer than the window (FCA
    steps), then one prompt alone (a plain paged step of one row)."""
    g = np.random.default_rng(seed)
    system = g.integers(4, 500, size=2 * TINY_SLIDING_WINDOW + 3).tolist()
    ragged = [system + g.integers(4, 500, size=5).tolist(), system + g.integers(4, 500, size=2).tolist(),
              g.integers(4, 500, size=3).tolist()]
    params = {"temperature": 0, "max_tokens": NEW, "logprobs": True, "stop_token_ids": ()}
    return [(ragged, SamplingParams(n=2, **params)),
            ([g.integers(4, 500, size=19).tolist()], SamplingParams(n=1, **params))]


def teacher_forced(runner, forward, fca: bool) -> list[torch.Tensor]:
    """Decode three ragged rows token by token from position 0, every position fed its own
    token (as a prompt would be): rows 0 and 1 share their first 32 tokens and pages, the
    batch shrinks 3 -> 2 -> 1 as rows end. Every slot a step reads was written by the same
    ``forward`` earlier in the run, so two runs over the same pages are independent (the run
    overwrites pages 1-8: call it last). Returns each step's ``[B, V]`` logits (fp32)."""
    g = np.random.default_rng(5)
    vocab = runner.vocab_size - 4
    shared = g.integers(4, vocab, size=32).tolist()
    rows = [shared + g.integers(4, vocab, size=18).tolist(), shared + g.integers(4, vocab, size=28).tolist(),
            g.integers(4, vocab, size=23).tolist()]
    pages = [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 0, 0]]
    bs, dev = runner.block_size, runner.device
    out = []
    with torch.inference_mode():  # as the engine's steps
        for t in range(max(map(len, rows))):
            live = [i for i, r in enumerate(rows) if t < len(r)]
            tables = torch.tensor([pages[i] for i in live], dtype=torch.int32, device=dev)
            slots = tables[:, t // bs].long() * bs + t % bs
            ids = torch.tensor([[rows[i][t] for i in live]], device=dev)
            pos = torch.full_like(ids, t)
            lens = torch.full((len(live),), t + 1, dtype=torch.int32, device=dev)
            out.append(forward(ids, pos, slots, tables, lens, fca).float())
    return out


@pytest.mark.parametrize("scope", ["layers", "model"])
@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_compiled_decode_equals_eager(family, scope, monkeypatch):
    eager, comp = make_engine(family, False), make_engine(family, True, scope)
    for prompts, params in calls(len(family)):
        want = eager.generate(prompts, params)
        got = comp.generate(prompts, params)
        assert [[s.token_ids for s in o] for o in got] == [[s.token_ids for s in o] for o in want]
        np.testing.assert_allclose([s.logprobs for o in got for s in o],
                                   [s.logprobs for o in want for s in o], rtol=1e-5, atol=1e-5)
    runner = comp.backend.runner
    for fca in (True, False):  # every step's full logits, on the same pages
        ref = teacher_forced(runner, runner._decode_eager, fca)
        torch.testing.assert_close(teacher_forced(runner, runner.compiled, fca), ref,
                                   rtol=1e-5, atol=1e-5)
    stats = comp.stats()
    assert runner.compiled.error is None
    assert 0 < stats["fca_steps"] < stats["decode_steps"]  # both attention paths ran compiled
    # one graph per attention path (and layer kind) serves every batch size and table width
    assert stats["compiles"] == COMPILES[family, scope] and stats["compile_s"] > 0
    assert (stats["compile_scope"], stats["compile_scope_reason"]) == (scope, None)
    assert eager.stats()["compiles"] == 0 and eager.backend.runner.compiled is None
    assert eager.stats()["compile_scope"] is None

    # past the bound a recompile is refused (here: int64 block tables fail a dtype guard), and
    # the runner decodes eagerly from then on, with a warning and the same logits
    monkeypatch.setattr(compiled, "MAX_COMPILES", stats["compiles"] // runner.compiled.layer_kinds)
    ref = teacher_forced(runner, runner._decode_eager, False)

    def wide(ids, pos, slots, tables, lens, fca):
        return runner.compiled(ids, pos, slots, tables.long(), lens, fca)

    with pytest.warns(RuntimeWarning, match="cannot be compiled.*recompile"):
        torch.testing.assert_close(teacher_forced(runner, wide, False), ref, rtol=0, atol=0)
    assert runner.compiled.error is not None and comp.stats()["compiles"] == stats["compiles"]


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_layer_graphs_serve_every_layer(family, monkeypatch):
    """Six decoder layers instead of two: the layer scope compiles exactly as often (each
    layer kind's graph serves all its layers: parameters and the layer index are graph
    inputs, not guards), and every step's logits equal the eager step's."""
    from polynya import models

    monkeypatch.setitem(models._TINY, family, dict(models._TINY[family], num_hidden_layers=6))
    engine = make_engine(family, True)
    runner = engine.backend.runner
    assert runner.num_layers == 6 and len(runner.compiled._layers) == 6
    for fca in (True, False):
        ref = teacher_forced(runner, runner._decode_eager, fca)
        torch.testing.assert_close(teacher_forced(runner, runner.compiled, fca), ref,
                                   rtol=1e-5, atol=1e-5)
    assert runner.compiled.error is None
    assert engine.stats()["compiles"] == COMPILES[family, "layers"]


def test_layers_not_found_compile_the_whole_model(monkeypatch):
    """Decoder layers of more than one class (here the last one re-classed) share no layer
    graph: the runner compiles the whole model, says why in ``stats()``, and decodes the same
    numbers as the eager step."""
    from polynya.engines.sample.native import model_runner
    from polynya.models import load_model

    def mixed(*args, **kwargs):
        model = load_model(*args, **kwargs)
        last = model.model.layers[-1]
        last.__class__ = type("OtherDecoderLayer", (type(last),), {})
        return model

    monkeypatch.setattr(model_runner, "load_model", mixed)
    comp = make_engine("qwen3", True)
    runner = comp.backend.runner
    stats = comp.stats()
    assert stats["compile_scope"] == "model" and runner.compiled._layers is None
    assert "no decoder layers found" in stats["compile_scope_reason"]
    for fca in (True, False):
        ref = teacher_forced(runner, runner._decode_eager, fca)
        torch.testing.assert_close(teacher_forced(runner, runner.compiled, fca), ref,
                                   rtol=1e-5, atol=1e-5)
    assert runner.compiled.error is None and comp.stats()["compiles"] == 2


@pytest.mark.parametrize("scope", ["layers", "model"])
def test_compile_failure_decodes_eagerly_with_a_warning(scope, monkeypatch):
    calls_made = []

    def broken(*args, **kwargs):
        calls_made.append(1)
        raise Unsupported("graph break in some model code\nmore detail")

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: broken)
    prompts, params = calls(0)[0]
    want = make_engine("qwen3", False).generate(prompts, params)
    comp = make_engine("qwen3", True, scope, compile_prefill=False)  # the decode's failure alone
    with pytest.warns(RuntimeWarning, match=r"cannot be compiled \(Unsupported: graph break in "
                                            r"some model code\); decoding with the eager model"):
        got = comp.generate(prompts, params)
    assert [[s.token_ids for s in o] for o in got] == [[s.token_ids for s in o] for o in want]
    assert calls_made == [1]  # tried once, then eager for every later step
    assert comp.backend.runner.compiled.error.startswith("Unsupported: graph break")
    assert comp.stats()["compiles"] == 0


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"),
                                   ValueError("the attention refused its inputs")])
def test_other_errors_are_raised_and_the_compiled_step_stays_on(monkeypatch, error):
    """Out of memory, or an error of the step's own in a call that compiled nothing, is not a
    compile failure: it reaches the caller as the eager step would raise it, and later decodes
    still run compiled, with the eager step's numbers."""
    prompts, params = calls(0)[0]
    comp = make_engine("qwen3", True, compile_prefill=False)
    comp.generate(prompts, params)  # compiled once
    runner = comp.backend.runner.compiled
    compiled_step, compiles = runner._step, comp.stats()["compiles"]

    def raising(*args, **kwargs):
        raise error

    monkeypatch.setattr(runner, "_step", raising)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "cannot be compiled" warning
        with pytest.raises(type(error), match=str(error)):
            comp.generate(prompts, params)
    assert runner.error is None
    monkeypatch.setattr(runner, "_step", compiled_step)
    want = make_engine("qwen3", False).generate(prompts, params)
    got = comp.generate(prompts, params)
    assert [[s.token_ids for s in o] for o in got] == [[s.token_ids for s in o] for o in want]
    assert runner.error is None and comp.stats()["compiles"] == compiles  # no recompile either


def test_compiled_steps_of_engines_in_threads_take_turns(monkeypatch):
    """Dynamo's stance and limits are process-wide: while one engine's compiled step runs
    (under them) another thread cannot enter its own, and after both the settings are
    Dynamo's own again."""
    import threading

    import torch._dynamo

    default_limit = torch._dynamo.config.recompile_limit
    engines = [make_engine("qwen3", True) for _ in range(2)]
    seen = []

    def try_enter():
        got = compiled._DYNAMO_SETTINGS.acquire(blocking=False)
        if got:
            compiled._DYNAMO_SETTINGS.release()
        seen.append(got)

    def wrap(step):
        def guarded(*args):
            probe = threading.Thread(target=try_enter)
            probe.start()
            probe.join()
            assert torch._dynamo.config.recompile_limit == compiled.MAX_COMPILES
            return step(*args)
        return guarded

    for e in engines:
        runner = e.backend.runner
        runner.compiled._step = wrap(runner.compiled.make_step())
    prompts, params = calls(3)[0]
    outs = [None, None]
    threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, engines[i].generate(prompts, params)))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen and not any(seen)  # no other thread ever got in during a compiled step
    assert [[s.token_ids for s in o] for o in outs[0]] == [[s.token_ids for s in o] for o in outs[1]]
    assert all(e.backend.runner.compiled.error is None for e in engines)
    assert torch._dynamo.config.recompile_limit == default_limit


def test_plan_travels_as_tensors():
    """The FCA op rebuilds the step's plan from ``work_tensors`` (on the GPU its kernels read
    every field; the CPU reference reads only the tables): every field comes back."""
    from dataclasses import fields

    from polynya.kernels.fca import ForestPlan, plan_forest

    g = torch.Generator().manual_seed(0)
    tables = torch.randint(1, 40, (5, 9), generator=g, dtype=torch.int32)
    tables[1, :4] = tables[0, :4]  # a shared prefix
    lens = torch.tensor([140, 70, 33, 9, 129], dtype=torch.int32)
    plan = plan_forest(tables, lens, 16, min_shared_tokens=16)
    back = ForestPlan.from_tensors(plan.block_tables, plan.seq_lens, plan.block_size,
                                   plan.max_shared_slots, plan.work_tensors(), plan.counters)
    assert plan.stats()["shared_items"] > 0
    for f in fields(ForestPlan):
        a, b = getattr(plan, f.name), getattr(back, f.name)
        assert (a is b) if isinstance(a, torch.Tensor) else a == b, f.name


def test_one_compile_serves_every_bucket():
    """Inputs shaped as ``DecodeGraphs`` passes them (views of static buffers made outside
    inference mode, block tables as wide as the cache allows): after the first call of each
    attention path, no batch bucket compiles again (a batch of one included); logits equal
    the eager step's."""
    from polynya.engines.sample.native.cuda_graph import buckets

    engine = SamplingEngine(SamplerConfig("tiny:qwen3", dtype="float32", device="cpu", num_blocks=80,
                                          max_num_seqs=40, compile_decode=True))
    runner = engine.backend.runner
    n, bs = 40, runner.block_size
    width = -(-runner.max_model_len // bs)
    ids, pos = torch.zeros((1, n), dtype=torch.int64), torch.zeros((1, n), dtype=torch.int64)
    slots, lens = torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.int32)
    tables = torch.zeros((n, width), dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    for fca in (False, True):
        first = None
        for b in buckets(n):
            with torch.inference_mode():  # rows share two pages, then one page each
                ids[0, :b] = torch.randint(4, 500, (b,), generator=g)
                tables[:b, :2] = torch.tensor([1, 2], dtype=torch.int32)
                tables[:b, 2] = torch.arange(3, 3 + b)
                lens[:b] = 40
                pos[0, :b] = 39
                slots[:b] = tables[:b, 2].long() * bs + 39 % bs
                args = (ids[:, :b], pos[:, :b], slots[:b], tables[:b], lens[:b], fca)
                got = runner._decode_forward(*args)
                torch.testing.assert_close(got, runner._decode_eager(*args), rtol=1e-5, atol=1e-5)
            first = runner.compiled.compiles if first is None else first
            assert runner.compiled.compiles == first, (fca, b)
    assert runner.compiled.error is None and runner.compiled.compiles == 2
