"""``polynya.fused``: which modules ``fuse_model`` patches, that it is idempotent, reversible and
survives ``.to``, deepcopy and pickling, that it refuses a class whose math changed, that CPU
numbers do not move, and (under ``TRITON_INTERPRET=1`` in a child process, and on a GPU) that
a fused model's loss and every gradient match HF's with gradient checkpointing on, the fused
kernels running in the forward and again in the checkpoint's recompute."""
import copy
import io
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from polynya import fused
from polynya.fused import fuse_model, fused_modules, unfuse_model
from polynya.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from triton_interp import check_under_interpreter  # noqa: E402

PREFIX = {"qwen3": "Qwen3", "llama": "Llama", "qwen3-moe": "Qwen3Moe", "qwen2": "Qwen2",
          "mistral": "Mistral"}


def _names(model, *cls_names):
    return [n for n, m in model.named_modules() if type(m).__name__ in cls_names]


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _ids(n_rows=2, n_tok=12, seed=0):
    return torch.randint(3, 500, (n_rows, n_tok), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", sorted(PREFIX))
def test_fuses_every_listed_norm_and_attention_and_nothing_else(family):
    model = load_model(f"tiny:{family}", dtype="float32")
    p = PREFIX[family]
    want = _names(model, p + "RMSNorm", p + "Attention")
    layers = model.config.num_hidden_layers
    assert len(_names(model, p + "Attention")) == layers
    assert len(want) >= 1 + 3 * layers  # final norm + two norms and an attention per layer
    assert fuse_model(model) == want
    others = [n for n, m in model.named_modules() if "forward" in m.__dict__ and n not in want]
    assert others == []
    assert fused_modules(model) == want


def test_gemma_is_not_fused():
    model = load_model("tiny:gemma2", dtype="float32")
    assert any("RMSNorm" in type(m).__name__ for m in model.modules())
    assert any("Attention" in type(m).__name__ for m in model.modules())
    assert fuse_model(model) == []
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_cpu_numbers_do_not_move_and_unfuse_restores():
    model = load_model("tiny:qwen3", dtype="float32")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = _ids()
    loss0, grads0 = _loss_and_grads(model, ids)
    names = fuse_model(model)
    assert fuse_model(model) == names  # idempotent: the same modules, the same objects
    fwd = {n: m.forward for n, m in model.named_modules() if n in names}
    assert fuse_model(model) == names
    assert all(m.forward is fwd[n] for n, m in model.named_modules() if n in names)
    loss1, grads1 = _loss_and_grads(model, ids)
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(grads0[k], grads1[k]) for k in grads0)
    assert unfuse_model(model) == names
    assert fused_modules(model) == [] and unfuse_model(model) == []
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_fusion_survives_to_deepcopy_and_pickle():
    model = load_model("tiny:qwen3", dtype="float32")
    names = fuse_model(model)
    model.to(torch.bfloat16)
    assert fused_modules(model) == names
    twin = copy.deepcopy(model)
    assert fused_modules(twin) == names
    norm = twin.model.norm
    assert norm.forward.args[0] is norm  # the copy's forward is bound to the copy
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert fused_modules(loaded) == names
    ids = _ids()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert torch.equal(twin(input_ids=ids).logits, want)
        assert torch.equal(loaded(input_ids=ids).logits, want)


def test_changed_math_is_refused(monkeypatch):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    class CastAfterWeight(Qwen3RMSNorm):  # Gemma's order: (x * w) rounded once
        def forward(self, x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (self.weight.float() * h).to(x.dtype)

    name = f"{CastAfterWeight.__module__}.{CastAfterWeight.__qualname__}"
    monkeypatch.setattr(fused, "RMS_NORM_CLASSES", (*fused.RMS_NORM_CLASSES, name))
    model = torch.nn.Sequential(Qwen3RMSNorm(32), CastAfterWeight(32))
    with pytest.warns(UserWarning, match="no longer computes HF's"):
        assert fuse_model(model) == ["0"]
    assert "forward" not in model[1].__dict__


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """GPT-J's interleaved pairing (x0, x1), (x2, x3), ...: not HF Llama's rotate_half."""
    def rot(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


class InterleavedAttention(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)


def test_changed_rope_math_is_refused(monkeypatch):
    name = f"{InterleavedAttention.__module__}.{InterleavedAttention.__qualname__}"
    monkeypatch.setattr(fused, "ATTENTION_CLASSES", (*fused.ATTENTION_CLASSES, name))
    model = torch.nn.Sequential(InterleavedAttention())
    with pytest.warns(UserWarning, match="no longer computes HF's"):
        assert fuse_model(model) == []
    assert apply_rotary_pos_emb.__name__ == "apply_rotary_pos_emb"
    assert not hasattr(sys.modules[__name__].apply_rotary_pos_emb, "polynya_original")


def test_someone_elses_forward_is_left_alone():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(32)
    hooked = norm.forward
    norm.forward = lambda x: hooked(x)  # as accelerate's hooks wrap a module's forward
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fuse_model(torch.nn.Sequential(norm)) == []
    with pytest.raises(ValueError, match="torch.nn.Module"):
        fuse_model("model")


# ------------------------------------------------------------------ the fused path itself
def _counted(calls: dict):
    """Count the kernels' launches (norm forward/backward, RoPE forward/backward) in ``calls``;
    -> a function that puts the launchers back."""
    from polynya.kernels.norm import op as norm_op
    from polynya.kernels.rope import op as rope_op

    saved = (norm_op.rms_norm_forward, norm_op.rms_norm_backward, rope_op.rope_launch)

    def count(key, fn):
        def inner(*a, **k):
            calls[key(k) if callable(key) else key] += 1
            return fn(*a, **k)
        return inner

    norm_op.rms_norm_forward = count("norm_fwd", saved[0])
    norm_op.rms_norm_backward = count("norm_bwd", saved[1])
    rope_op.rope_launch = count(lambda k: "rope_bwd" if k["backward"] else "rope_fwd", saved[2])

    def restore():
        norm_op.rms_norm_forward, norm_op.rms_norm_backward, rope_op.rope_launch = saved
    return restore


def check_fused_model(device: str, family: str = "qwen3") -> None:
    """A fused model's loss and every gradient against the same model unfused, fp32, gradient
    checkpointing on (HF's non-reentrant): the kernels run in the forward, the recompute and the
    backward; a second, unfused model in the same process, and the model after ``unfuse_model``,
    launch none of them."""
    calls = dict.fromkeys(("norm_fwd", "norm_bwd", "rope_fwd", "rope_bwd"), 0)
    zero = dict(calls)
    restore = _counted(calls)
    try:
        model = load_model(f"tiny:{family}", dtype="float32", device=device)
        other = load_model(f"tiny:{family}", dtype="float32", device=device)
        for m in (model, other):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            m.train()
        ids = _ids(3, 17).to(device)
        loss0, grads0 = _loss_and_grads(model, ids)
        assert calls == zero
        names = fuse_model(model)
        loss1, grads1 = _loss_and_grads(model, ids)
        seen = dict(calls)

        def same(loss):  # HF's code again: equal (to fp32 noise of a second GPU run)
            return abs(float(loss - loss0)) <= (0 if device == "cpu" else 1e-6 * abs(float(loss0)))
        assert same(_loss_and_grads(other, ids)[0]) and calls == seen
        unfuse_model(model)
        assert same(_loss_and_grads(model, ids)[0]) and calls == seen
    finally:
        restore()
    layers = model.config.num_hidden_layers
    norms = len(names) - layers
    in_layers = sum(".layers." in n for n in names) - layers
    assert seen == {"norm_fwd": norms + in_layers, "norm_bwd": norms,  # + checkpoint recompute
                    "rope_fwd": 2 * layers, "rope_bwd": layers}, (seen, names)
    assert abs(float(loss1 - loss0)) <= 1e-5 * abs(float(loss0))
    for k, g in grads0.items():
        scale = float(g.abs().max())
        assert float((grads1[k] - g).abs().max()) <= 1e-4 * scale + 1e-7, k


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter is on")
def test_fused_model_under_interpreter():
    check_under_interpreter(__file__)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fused_model_on_gpu(family):
    check_fused_model("cuda", family)


def _interp():
    from polynya.kernels.norm import op as norm_op
    from polynya.kernels.rope import op as rope_op

    norm_op.KERNEL_ON_CPU = rope_op.KERNEL_ON_CPU = True
    check_fused_model("cpu")
    print("INTERP OK")


if __name__ == "__main__" and sys.argv[1:] == ["interp"]:
    _interp()
