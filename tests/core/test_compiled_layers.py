"""``polynya.compiled_layers``: which sub-modules ``compile_layers`` routes, that it refuses
models it does not know and sub-modules someone else patched (nothing changed then), that it is
idempotent and reversible, and that a compiled model's log-probs, entropy and every gradient
equal the eager model's (fp32, gradient checkpointing on, ZoRRo and the packed naive layout,
ragged batches of new lengths each call) — with the attention left outside the graph and the
checkpoint's recompute running the compiled sub-modules again. The plumbing is checked with
the ``aot_eager`` backend (the graphs, no code generation: seconds); Inductor itself (the
default backend) once on the CPU and on a GPU in ``test_compiled_layers_gpu.py``."""
import copy

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

SUB = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")


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


def _pair(family="qwen3"):
    torch.manual_seed(0)
    eager = load_model(f"tiny:{family}", dtype="float32")
    eager.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    eager.train()
    return eager, copy.deepcopy(eager)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "mistral"])
def test_routes_the_sub_modules_of_every_decoder_layer_and_nothing_else(family):
    model = load_model(f"tiny:{family}", dtype="float32")
    n = model.config.num_hidden_layers
    want = [f"model.layers.{i}.{s}" for i in range(n) for s in SUB]
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
    for bad in (dict(backend=3), dict(dynamic="yes")):
        with pytest.raises(ValueError, match="backend must be a str"):
            compile_layers(model, **bad)
    assert compiled_modules(model) == []
    with pytest.raises(ValueError, match="torch.nn.Module"):
        compile_layers("tiny:qwen3")
    plain = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="needs a Hugging Face model"):
        compile_layers(plain)
    assert "forward" not in plain.__dict__


@pytest.mark.parametrize("family", ["qwen3", "mistral"])  # mistral: window 8 on every layer
@pytest.mark.parametrize("zorro", [True, False], ids=["zorro", "packed"])
def test_compiled_model_equals_eager_with_checkpointing(zorro, family):
    eager, compiled = _pair(family)
    compile_layers(compiled, backend="aot_eager")
    calls = []
    mlp = compiled.model.layers[1].mlp
    inner = mlp._polynya_compiled
    mlp._polynya_compiled = lambda *a, **k: (calls.append(1), inner(*a, **k))[1]
    for i, (P, R, G) in enumerate([(21, 9, 4), (34, 13, 3), (17, 7, 4)]):  # a new length each call
        batch = _batch(P, R, G, seed=i)
        lp_e, ent_e, g_e = _run(eager, batch, zorro)
        calls.clear()
        lp_c, ent_c, g_c = _run(compiled, batch, zorro)
        assert len(calls) == 2  # forward + the checkpoint's recompute, both through the compiled mlp
        torch.testing.assert_close(lp_c, lp_e, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent_c, ent_e, atol=1e-5, rtol=0)
        for name, g in g_e.items():
            assert g.abs().max() > 0, name
            torch.testing.assert_close(g_c[name], g, atol=1e-4 * g.abs().max().item(), rtol=1e-4,
                                       msg=name)


def test_attention_runs_outside_the_graph():
    """The "polynya" attention is not traced: the mask object and its plans stay eager."""
    from polynya.zorro import attention

    _, compiled = _pair()
    compile_layers(compiled, backend="aot_eager")
    seen = []
    inner = attention._outside_graph

    def spy(*args, **kwargs):  # what the graph break runs: the attention, eagerly
        seen.append(torch.compiler.is_compiling())
        return attention.polynya_attention_forward(*args, **kwargs)

    attention._outside_graph = torch.compiler.disable(spy)
    try:
        _run(compiled, _batch(19, 8, 3, seed=5), zorro=True)
    finally:
        attention._outside_graph = inner
    layers = compiled.config.num_hidden_layers
    assert len(seen) == 2 * layers and not any(seen)  # forward + recompute, every layer, eagerly


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
