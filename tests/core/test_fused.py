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
from triton_interp import interpreter_test  # noqa: E402

NORMS = {"qwen3": "Qwen3RMSNorm", "llama": "LlamaRMSNorm", "qwen3-moe": "Qwen3MoeRMSNorm",
         "qwen2": "Qwen2RMSNorm", "mistral": "MistralRMSNorm"}


def _norm_names(model, cls_name):
    return [n for n, m in model.named_modules() if type(m).__name__ == cls_name]


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _ids(n_rows=2, n_tok=12, seed=0):
    return torch.randint(3, 500, (n_rows, n_tok), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", sorted(NORMS))
def test_fuses_every_listed_norm_and_nothing_else(family):
    model = load_model(f"tiny:{family}", dtype="float32")
    want = _norm_names(model, NORMS[family])
    assert len(want) >= 1 + 2 * model.config.num_hidden_layers  # final norm + two per layer
    assert fuse_model(model) == want
    others = [n for n, m in model.named_modules() if "forward" in m.__dict__ and n not in want]
    assert others == []
    assert fused_modules(model) == want


def test_gemma_norms_are_not_fused():
    model = load_model("tiny:gemma2", dtype="float32")
    assert any("RMSNorm" in type(m).__name__ for m in model.modules())
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
def check_fused_model(device: str, family: str = "qwen3") -> None:
    """A fused model's loss and every gradient against the same model unfused, fp32, gradient
    checkpointing on (HF's non-reentrant): the kernels run in the forward and in the recompute."""
    from polynya.kernels.norm import op

    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd = op.rms_norm_forward, op.rms_norm_backward

    def count(key, fn):
        def inner(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return inner

    op.rms_norm_forward, op.rms_norm_backward = count("fwd", fwd), count("bwd", bwd)
    try:
        model = load_model(f"tiny:{family}", dtype="float32", device=device)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        ids = _ids(3, 17).to(device)
        loss0, grads0 = _loss_and_grads(model, ids)
        assert calls == {"fwd": 0, "bwd": 0}
        names = fuse_model(model)
        loss1, grads1 = _loss_and_grads(model, ids)
    finally:
        op.rms_norm_forward, op.rms_norm_backward = fwd, bwd
    in_layers = sum(".layers." in n for n in names)
    assert calls == {"fwd": len(names) + in_layers, "bwd": len(names)}, (calls, len(names))
    assert abs(float(loss1 - loss0)) <= 1e-5 * abs(float(loss0))
    for k, g in grads0.items():
        scale = float(g.abs().max())
        assert float((grads1[k] - g).abs().max()) <= 1e-4 * scale + 1e-7, k


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter is on")
def test_fused_model_under_interpreter():
    interpreter_test(__file__, "test_fused_model_on_gpu")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fused_model_on_gpu(family):
    check_fused_model("cuda", family)


def _interp():
    from polynya.kernels.norm import op

    op.KERNEL_ON_CPU = True
    check_fused_model("cpu")
    print("INTERP OK")


if __name__ == "__main__" and sys.argv[1:] == ["interp"]:
    _interp()
