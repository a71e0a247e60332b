"""``polynya.compiled_layers``: which layers ``compile_layers`` routes, that it refuses models it
does not know and layers or sub-modules someone else patched (nothing changed then), that it is
idempotent and reversible, and that a compiled model's log-probs, entropy and every gradient
equal the eager model's (fp32, gradient checkpointing off, non-reentrant and reentrant, ZoRRo and the packed naive
layout, ragged batches of new lengths each call, all four families) — with the attention called
eagerly, the checkpoint's recompute running the compiled regions again, and calls the regions do
not cover (a KV cache, hooks on the attention) running the class's own forward. The plumbing is checked with
the ``aot_eager`` backend (the graphs, no code generation: seconds); Inductor itself (the
default backend) once on the CPU and on a GPU in ``test_compiled_layers_gpu.py``."""
import copy
import dataclasses

import polynya
import pytest
import torch
from polynya.compiled_layers import (
    compile_layers,
    compile_reason,
    compiled_modules,
    uncompile_layers,
)
from polynya.fused import fuse_model, unfuse_model
from polynya.logprobs import compute_logprobs
from polynya.models import load_model



def _batch(P, R, G, seed):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(5, 400, (P,), generator=g).tolist()
    resp = [torch.randint(5, 400, (R - 2 * i,), generator=g).tolist() for i in range(G)]
    return polynya.RolloutBatch([prompt] * G, resp)


def _run(model, batch, zorro):
    model.zero_grad(set_to_none=True)
    s = compute_logprobs(model, batch, zorro=zorro, entropy=True, temperature=0.7)
    (s.logprobs[s.mask].sum() + 0.1 * s.entropy[s.mask].sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return s.logprobs.detach(), s.entropy.detach(), grads


def _pair(family="qwen3", checkpointing=True):
    torch.manual_seed(0)
    eager = load_model(f"tiny:{family}", dtype="float32")
    if checkpointing:  # True: non-reentrant (HF's default here), "reentrant": torch's old kind
        eager.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    eager.train()
    return eager, copy.deepcopy(eager)


def _count_regions(model, calls):
    """Spy on one layer's compiled regions: ``calls`` gets "before" / "after" per call."""
    layer = model.model.layers[1]
    regions = layer._polynya_compiled

    def spy(tag, fn):
        return lambda *a, **k: (calls.append(tag), fn(*a, **k))[1]
    layer._polynya_compiled = dataclasses.replace(regions, before=spy("before", regions.before),
                                                  after=spy("after", regions.after))


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "mistral"])
def test_routes_every_decoder_layer_and_nothing_else(family):
    model = load_model(f"tiny:{family}", dtype="float32")
    n = model.config.num_hidden_layers
    want = [f"model.layers.{i}" for i in range(n)]
    got = compile_layers(model, backend="aot_eager")
    assert sorted(got) == sorted(want)
    assert compile_layers(model, backend="aot_eager") == got  # idempotent
    assert compiled_modules(model) == got
    patched = [name for name, m in model.named_modules() if "forward" in m.__dict__]
    assert sorted(patched) == sorted(want)
    assert sorted(uncompile_layers(model)) == sorted(want)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert uncompile_layers(model) == []


@pytest.mark.parametrize("family", ["gemma2", "qwen3-moe"])
def test_refuses_families_it_does_not_verify_and_changes_nothing(family):
    model = load_model(f"tiny:{family}", dtype="float32")
    with pytest.raises(ValueError, match="is not verified"):
        compile_layers(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_refuses_sub_modules_that_already_have_an_instance_forward():
    model = load_model("tiny:qwen3", dtype="float32")
    fuse_model(model)
    assert "polynya.fused" in compile_reason(model)
    with pytest.raises(ValueError, match="instance-level forward"):
        compile_layers(model)
    assert compiled_modules(model) == []
    unfuse_model(model)
    assert compile_reason(model) is None
    layer = model.model.layers[0]
    layer.forward = layer.forward  # someone else's instance-level forward on the layer itself
    with pytest.raises(ValueError, match="instance-level forward"):
        compile_layers(model)
    assert compiled_modules(model) == []
    del layer.forward
    for bad in (dict(backend=3), dict(dynamic="yes")):
        with pytest.raises(ValueError, match="backend must be a str"):
            compile_layers(model, **bad)
    assert compiled_modules(model) == []
    with pytest.raises(ValueError, match="torch.nn.Module"):
        compile_layers("tiny:qwen3")
    with pytest.raises(ValueError, match="uncompile_layers needs a torch.nn.Module"):
        uncompile_layers("tiny:qwen3")
    plain = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="needs a Hugging Face model"):
        compile_layers(plain)
    assert "forward" not in plain.__dict__


@pytest.mark.parametrize(("family", "checkpointing"), [
    ("qwen3", True), ("qwen3", False), ("qwen3", "reentrant"), ("llama", True), ("qwen2", True),
    ("mistral", True),  # mistral: window 8 on every layer
])
@pytest.mark.parametrize("zorro", [True, False], ids=["zorro", "packed"])
def test_compiled_model_equals_eager(zorro, family, checkpointing):
    eager, compiled = _pair(family, checkpointing)
    compile_layers(compiled, backend="aot_eager")
    calls = []
    _count_regions(compiled, calls)
    for i, (P, R, G) in enumerate([(21, 9, 4), (34, 13, 3), (17, 7, 4)]):  # a new length each call
        batch = _batch(P, R, G, seed=i)
        lp_e, ent_e, g_e = _run(eager, batch, zorro)
        calls.clear()
        lp_c, ent_c, g_c = _run(compiled, batch, zorro)
        # forward (+ the checkpoint's recompute), both regions each time
        assert calls == ["before", "after"] * (2 if checkpointing else 1)
        torch.testing.assert_close(lp_c, lp_e, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent_c, ent_e, atol=1e-5, rtol=0)
        for name, g in g_e.items():
            assert g.abs().max() > 0, name
            torch.testing.assert_close(g_c[name], g, atol=1e-4 * g.abs().max().item(), rtol=1e-4,
                                       msg=name)


def test_attention_is_called_eagerly_with_the_class_arguments(monkeypatch):
    """The configured attention function runs outside the regions (never traced), once per
    layer and pass, with the arguments the class's own forward passes it."""
    from transformers import AttentionInterface

    eager, compiled = _pair("mistral")
    compile_layers(compiled, backend="aot_eager")
    inner = AttentionInterface._global_mapping[polynya.zorro.attention.NAME]
    seen = []

    def spy(module, q, k, v, mask, **kwargs):
        seen.append((torch.compiler.is_compiling(), module.layer_idx, sorted(kwargs),
                     kwargs.get("sliding_window")))
        return inner(module, q, k, v, mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, polynya.zorro.attention.NAME, spy)
    batch = _batch(19, 8, 3, seed=5)
    _run(eager, batch, zorro=True)
    want, seen[:] = list(seen), []
    _run(compiled, batch, zorro=True)
    layers = compiled.config.num_hidden_layers
    assert len(seen) == 2 * layers and not any(s[0] for s in seen)  # forward + recompute, eagerly
    assert seen == want and {s[3] for s in seen} == {8}


def test_calls_the_regions_do_not_cover_run_the_class_forward():
    """A KV cache (generation) and a hook on the attention module take the eager class forward:
    same outputs as the eager model, the regions not entered, the hook fired."""
    from transformers import DynamicCache

    eager, compiled = _pair(checkpointing=False)
    compile_layers(compiled, backend="aot_eager")
    calls = []
    _count_regions(compiled, calls)
    ids = torch.randint(5, 400, (2, 11), generator=torch.Generator().manual_seed(3))
    eager.eval(), compiled.eval()
    with torch.no_grad():
        want = eager(ids, past_key_values=DynamicCache(config=eager.config), use_cache=True).logits
        got = compiled(ids, past_key_values=DynamicCache(config=compiled.config), use_cache=True).logits
        assert calls == []
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        fired = []
        handle = compiled.model.layers[1].self_attn.register_forward_hook(lambda *a: fired.append(1))
        got = compiled(ids, use_cache=False).logits  # no cache: only the hook sends it eager
        handle.remove()
        assert fired == [1] and calls == []
        torch.testing.assert_close(got, eager(ids, use_cache=False).logits, atol=1e-6, rtol=0)
        compiled(ids, use_cache=False)
        assert calls == ["before", "after"]  # hook gone: the regions again
        handle = compiled.model.layers[1].self_attn.register_full_backward_hook(lambda *a: None)
        compiled(ids, use_cache=False)
        handle.remove()
        assert calls == ["before", "after"]  # a backward hook, too, sends it to the class forward


def test_inductor_on_cpu_equals_eager():
    """The default backend generates code; one shape pair on the CPU (fp32)."""
    eager, compiled = _pair()
    compile_layers(compiled)
    for i, (P, R, G) in enumerate([(23, 9, 3), (30, 11, 2)]):
        batch = _batch(P, R, G, seed=10 + i)
        lp_e, ent_e, g_e = _run(eager, batch, True)
        lp_c, ent_c, g_c = _run(compiled, batch, True)
        torch.testing.assert_close(lp_c, lp_e, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent_c, ent_e, atol=1e-5, rtol=0)
        for name, g in g_e.items():
            torch.testing.assert_close(g_c[name], g, atol=1e-4 * g.abs().max().item(), rtol=1e-4,
                                       msg=name)


def test_a_users_torch_compile_leaves_the_polynya_attention_eager():
    """A user's ``torch.compile`` over a model with the "polynya" attention (not
    ``compile_layers``): Dynamo breaks the graph at the attention (its ``torch.compiler.disable``'d
    copy) instead of tracing the ZoRRo mask and plans; log-probs and gradients equal eager."""
    from torch._dynamo.utils import counters

    eager, compiled = _pair("qwen3")
    compiled.model.forward = torch.compile(compiled.model.forward, backend="aot_eager")
    counters.clear()
    batch = _batch(19, 8, 3, seed=5)
    lp_e, ent_e, g_e = _run(eager, batch, zorro=True)
    lp_c, ent_c, g_c = _run(compiled, batch, zorro=True)
    breaks = [reason for reason in counters["graph_break"] if "torch.compiler.disable" in reason]
    assert breaks, dict(counters["graph_break"])
    torch.testing.assert_close(lp_c, lp_e, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_c, ent_e, atol=1e-5, rtol=0)
    for name, g in g_e.items():
        torch.testing.assert_close(g_c[name], g, atol=1e-4 * g.abs().max().item(), rtol=1e-4, msg=name)


def test_refuses_transformers_releases_it_does_not_verify(monkeypatch):
    import transformers

    model = load_model("tiny:qwen3", dtype=torch.float32, seed=0)
    for version in ("5.9.0", "5.25.0", "6.0.0.dev0"):
        monkeypatch.setattr(transformers, "__version__", version)
        with pytest.raises(ValueError, match=f"transformers {version} is not verified"):
            compile_layers(model)
        assert compiled_modules(model) == []
    monkeypatch.setattr(transformers, "__version__", "5.10.4")
    assert len(compile_layers(model)) == model.config.num_hidden_layers
