"""Fused decode projections (``SamplerConfig.fuse_projections``, CPU, Inductor on CPU).

Oracles: ``torch.cat`` of per-weight ``F.linear`` for the op; the same engine without fusion
for the compiled decode (tokens equal, log-probs within fp32 rounding), its parameters (names,
shapes, values, checksum) for the fused model; a weight load through both engines.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from polynya import SamplingParams
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine
from polynya.engines.sample.native import fused_projections as fp
from polynya.models import load_model
from polynya.weights import BucketSpec, FlatBuckets


def test_adjacent_rows_is_a_view_only_for_back_to_back_rows():
    flat = torch.randn(7, 5)
    a, b, c = flat[:2], flat[2:3], flat[3:7]
    view = fp.adjacent_rows([a, b, c])
    assert view is not None and view.data_ptr() == flat.data_ptr()
    torch.testing.assert_close(view, torch.cat([a, b, c]), rtol=0, atol=0)
    assert fp.adjacent_rows([a, c]) is None  # a gap
    assert fp.adjacent_rows([b, a]) is None  # out of order
    assert fp.adjacent_rows([a, torch.randn(1, 5)]) is None  # another storage
    assert fp.adjacent_rows([flat[:, :2], flat[:, 2:4]]) is None  # not contiguous
    bias = torch.randn(9)
    torch.testing.assert_close(fp.adjacent_rows([bias[:4], bias[4:]]), bias, rtol=0, atol=0)


@pytest.mark.parametrize("adjacent", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_linear_equals_the_separate_linears(adjacent, bias, monkeypatch):
    g = torch.Generator().manual_seed(0)
    flat, bflat = torch.randn(12, 8, generator=g), torch.randn(12, generator=g)
    ws = [flat[:6], flat[6:9], flat[9:]] if adjacent else [t.clone() for t in flat.split([6, 3, 3])]
    bs = list(bflat.split([6, 3, 3])) if bias else []
    x = torch.randn(5, 8, generator=g)
    want = torch.cat([F.linear(x, w, bs[i] if bias else None) for i, w in enumerate(ws)], -1)
    calls = []
    real = fp.F.linear
    monkeypatch.setattr(fp.F, "linear", lambda *a: calls.append(a[1].shape) or real(*a))
    got = fp.fused_linear(x, ws, bs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert calls == ([torch.Size([12, 8])] if adjacent else [torch.Size([6, 8])] + [torch.Size([3, 8])] * 2)


def test_fused_linear_refuses_no_weights_or_mismatched_biases():
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    with pytest.raises(ValueError, match="one or more weights"):
        fp.fused_linear(x, [], [])
    with pytest.raises(ValueError, match="2 weights, 1 biases"):
        fp.fused_linear(x, [w, w.clone()], [torch.randn(3)])
    assert fp.adjacent_rows([]) is None


def test_the_graph_pass_fuses_linears_on_one_input():
    def f(x, y, wq, wk, wv, wo, bq, bk):
        q, k, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
        o = F.linear(y, wo)  # alone on its input: untouched
        p, r = F.linear(y + 1, wq, bq), F.linear(y + 1, wk)  # bias on one only: untouched
        return q + 1, k * 2, v, o, p, r

    gm = torch.fx.symbolic_trace(f)
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g),
            torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g),
            torch.randn(2, 4, generator=g), torch.randn(5, 4, generator=g),
            torch.randn(6, generator=g), torch.randn(6, generator=g)]
    for node in gm.graph.nodes:  # what Dynamo records on its placeholders
        if node.op == "placeholder":
            node.meta["example_value"] = args[["x", "y", "wq", "wk", "wv", "wo", "bq", "bk"].index(node.name)]
    want = gm(*args)
    assert fp.fuse_linear_calls(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.polynya.fused_linear.default) == 1
    assert targets.count(torch._C._nn.linear) == 3
    for a, b in zip(gm(*args), want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family, groups", [("qwen3", 4), ("llama", 4), ("qwen2", 4), ("gemma2", 4)])
def test_fusing_leaves_every_parameter_as_it_was(family, groups):
    model = load_model(f"tiny:{family}", dtype="float32", seed=3)
    before = {n: (id(p), p.detach().clone()) for n, p in model.named_parameters()}
    ids = torch.randint(0, 500, (1, 9))
    want = model(ids).logits
    fused = fp.ProjectionGroups.fuse(model)
    assert len(fused) == groups and fused.intact()
    after = dict(model.named_parameters())
    assert list(after) == list(before)
    for n, p in after.items():
        assert id(p) == before[n][0]
        torch.testing.assert_close(p.detach(), before[n][1], rtol=0, atol=0)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == attn.q_proj.weight.data_ptr() + attn.q_proj.weight.nbytes
    if family == "qwen2":  # q/k/v biases share their buffer too
        assert attn.k_proj.bias.data_ptr() == attn.q_proj.bias.data_ptr() + attn.q_proj.bias.nbytes
    torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)
    with torch.no_grad():  # an in-place load lands in the buffer the fused GEMM reads
        attn.v_proj.weight.copy_(torch.ones_like(attn.v_proj.weight))
    w = fp.adjacent_rows([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert bool((w[-attn.v_proj.weight.shape[0]:] == 1).all())
    fused.to("cpu")
    model.to("cpu")
    assert fused.intact()


def engines(family: str = "qwen3", scope: str = "layers"):
    kw = {"dtype": "float32", "device": "cpu", "num_blocks": 64, "max_num_seqs": 8,
          "fca_min_shared_tokens": 0, "compile_decode": True, "compile_scope": scope}
    return (SamplingEngine(SamplerConfig(f"tiny:{family}", fuse_projections=False, **kw)),
            SamplingEngine(SamplerConfig(f"tiny:{family}", fuse_projections=True, **kw)))


def run(engine, seed: int):
    g = np.random.default_rng(seed)
    system = g.integers(4, 500, size=12).tolist()
    prompts = [system + g.integers(4, 500, size=int(n)).tolist() for n in (3, 7, 5)]
    return engine.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=6,
                                                   stop_token_ids=(), logprobs=True))


def same(a, b) -> None:
    assert [[s.token_ids for s in o] for o in a] == [[s.token_ids for s in o] for o in b]
    np.testing.assert_allclose([s.logprobs for o in a for s in o], [s.logprobs for o in b for s in o],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family, scope", [("qwen3", "layers"), ("gemma2", "layers"),
                                           ("qwen3", "model")])
def test_compiled_decode_with_fused_projections_equals_without(family, scope):
    plain, fused = engines(family, scope)
    same(run(fused, 0), run(plain, 0))
    sp, sf = plain.stats(), fused.stats()
    assert sf["fused_groups"] == 4 and sp["fused_groups"] == 0 and sp["fused_calls"] == 0
    # q/k/v and gate/up of every layer in the graph: one layer's, or the two of the model's
    per_graph = 2 if scope == "layers" else 4
    assert sf["fused_calls"] == per_graph * sf["compiles"]
    assert sf["compiles"] == sp["compiles"] and sf["fca_steps"] > 0
    assert fused.backend.weight_checksum() == plain.backend.weight_checksum()


def test_weight_loads_reach_the_fused_buffers():
    """New weights through both load paths (named pairs, verified flat buckets): the fused
    engine answers as the plain one and keeps its buffers (no parameter re-allocated)."""
    plain, fused = engines()
    new = load_model("tiny:qwen3", dtype="float32", seed=7)
    pairs = [(n, p.detach()) for n, p in new.named_parameters()]
    names = [n for n, _ in pairs]
    flat = torch.cat([t.reshape(-1) for _, t in pairs])
    spec = BucketSpec(tuple(names), tuple(tuple(t.shape) for _, t in pairs))
    for version, weights in ((1, dict(pairs)), (2, FlatBuckets([spec], [flat]))):
        checksum = None
        if version == 2:
            from polynya.checksum import checksum_views
            checksum = checksum_views(pairs)
        for engine in (plain, fused):
            engine.backend.load_weights(weights, version=version, checksum=checksum)
        assert fused.backend.runner.projections.intact()
        assert fused.backend.weight_checksum() == plain.backend.weight_checksum()
        same(run(fused, version), run(plain, version))


def test_fuse_projections_is_validated():
    with pytest.raises(ValueError, match="fuse_projections must be a bool or None"):
        SamplerConfig("tiny:qwen3", fuse_projections="yes")
    eager = SamplingEngine(SamplerConfig("tiny:qwen3", device="cpu", dtype="float32",
                                         fuse_projections=True, compile_decode=False))
    assert eager.stats()["fused_groups"] == 0  # nothing fused without the compiled step


def test_fuse_projections_defaults_to_the_compiled_step():
    default = SamplerConfig("tiny:qwen3")
    assert default.fuse_projections is None
    assert default.projections_fused("cuda") and not default.projections_fused("cpu")
    assert SamplerConfig("tiny:qwen3", compile_decode=True).projections_fused("cpu")
    assert not SamplerConfig("tiny:qwen3", compile_decode=True,
                             fuse_projections=False).projections_fused("cuda")
    assert not SamplerConfig("tiny:qwen3", compile_decode=False,
                             fuse_projections=True).projections_fused("cuda")
    kw = {"device": "cpu", "dtype": "float32", "kv_cache_memory_gb": 0.05}
    compiled = SamplingEngine(SamplerConfig("tiny:qwen3", compile_decode=True, **kw))
    assert compiled.stats()["fused_groups"] > 0 and compiled.backend.runner.projections.intact()
    kept = SamplingEngine(SamplerConfig("tiny:qwen3", compile_decode=True, fuse_projections=False,
                                        **kw))
    assert kept.stats()["fused_groups"] == 0 and kept.backend.runner.projections is None
