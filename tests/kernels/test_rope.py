"""The fused rotary embedding (polynya.kernels.rope) against HF's own ``apply_rotary_pos_emb``
(Qwen3's; Llama/Qwen2/Mistral/Qwen3-MoE carry the same code and ``fuse_model`` probes each),
forward and the gradients of ``q`` and ``k``, on fresh random inputs.

Every result of the kernel is one product or one sum of two products, rounded where HF's ops
and autograd round (and without FMA contraction), so the test asks for equality bit for bit
in fp32, bf16 and fp16, and for HF's output layout (strides). The Triton kernel runs under
``TRITON_INTERPRET=1`` in a child process on CPU and compiled on a GPU (``gpu`` marker).
"""
import os
import sys

import pytest
import torch
from polynya.kernels.rope import kernel_applies, rope, rope_reference
from triton_interp import check_under_interpreter


def hf_rope(q, k, cos, sin):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


def _inputs(b, t, hq, hk, d, dtype, device, seed, cos_batch=None):
    """q/k as HF makes them (transposed views of [B, T, H, D]); cos/sin from positions that
    differ per row (RL's packed rows restart positions), in the tensors' dtype as HF casts."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hq, d, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(b, t, hk, d, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
    rows = b if cos_batch is None else cos_batch
    pos = torch.randint(0, 4096, (rows, t), generator=g).float()
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)
    return q, k, cos, sin


def _run(fn, q, k, cos, sin, seed=0):
    q = q.detach().clone().requires_grad_()
    k = k.detach().clone().requires_grad_()
    qo, ko = fn(q, k, cos, sin)
    g = torch.Generator().manual_seed(seed)
    gq = torch.randn(qo.shape, generator=g).to(device=qo.device, dtype=qo.dtype)
    gk = torch.randn(ko.shape, generator=g).to(device=ko.device, dtype=ko.dtype)
    torch.autograd.backward((qo, ko), (gq, gk))
    return qo.detach(), ko.detach(), q.grad, k.grad


def assert_equals_hf(q, k, cos, sin) -> None:
    got, want = _run(rope, q, k, cos, sin), _run(hf_rope, q, k, cos, sin)
    for name, a, b in zip(("q_embed", "k_embed", "dq", "dk"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), (name, float((a.float() - b.float()).abs().max()))
        if name.endswith("embed"):  # HF's layout (the stride of a size-1 dim is arbitrary)
            sa, sb = ([s for s, n in zip(x.stride(), x.shape) if n > 1] for x in (a, b))
            assert sa == sb, (name, a.stride(), b.stride())


def check_kernel(device: str) -> None:
    shapes = [(2, 5, 4, 2, 16), (1, 7, 3, 1, 10), (3, 4, 16, 8, 128), (2, 3, 5, 5, 6)]
    if device == "cuda":
        shapes += [(8, 384, 16, 8, 128), (1, 3072, 16, 8, 128), (2, 100, 32, 8, 80)]
    seed = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in shapes:
            seed += 1
            q, k, cos, sin = _inputs(*shape, dtype, device, seed)
            assert kernel_applies(q, k, cos, sin)
            assert_equals_hf(q, k, cos, sin)
    # cos/sin shared by the batch ([1, T, D], as one packed row's positions broadcast)
    q, k, cos, sin = _inputs(3, 6, 4, 2, 32, torch.bfloat16, device, 77, cos_batch=1)
    assert kernel_applies(q, k, cos, sin)
    assert_equals_hf(q, k, cos, sin)
    # contiguous [B, H, T, D] inputs and a non-unit last stride are handled too
    q, k, cos, sin = _inputs(2, 5, 4, 2, 16, torch.bfloat16, device, 78)
    assert_equals_hf(q.contiguous(), k.contiguous(), cos, sin)
    wide = torch.randn(2, 4, 5, 32).to(device=device, dtype=torch.bfloat16)
    assert_equals_hf(wide[..., ::2], k, cos, sin)
    before = q.clone()
    _run(rope, q, k, cos, sin)
    assert torch.equal(q, before)  # inputs are never written


# ------------------------------------------------------------------ CPU (reference path)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_hf_bit_for_bit(dtype):
    q, k, cos, sin = _inputs(2, 5, 4, 2, 16, dtype, "cpu", 1)
    for a, b in zip(_run(rope_reference, q, k, cos, sin), _run(hf_rope, q, k, cos, sin)):
        assert torch.equal(a, b)


def test_what_the_kernel_does_not_take_goes_to_the_reference():
    q, k, cos, sin = _inputs(2, 5, 4, 2, 16, torch.bfloat16, "cpu", 2)
    assert not kernel_applies(q, k, cos, sin)  # CPU tensors
    from polynya.kernels.rope import op

    old, op.KERNEL_ON_CPU = op.KERNEL_ON_CPU, True
    try:
        assert kernel_applies(q, k, cos, sin)
        assert not kernel_applies(q, k, cos.float(), sin.float())       # mixed dtypes
        assert not kernel_applies(q, k, cos.double(), sin.double())
        assert not kernel_applies(q[..., :15], k[..., :15], cos[..., :15], sin[..., :15])  # odd D
        assert not kernel_applies(q, k, cos[:, :4], sin[:, :4])           # T mismatch
        assert not kernel_applies(q, k, cos.clone().requires_grad_(), sin)  # cos needs a grad
    finally:
        op.KERNEL_ON_CPU = old
    for a, b in zip(_run(rope, q, k, cos, sin), _run(hf_rope, q, k, cos, sin)):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ Triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter is on")
def test_triton_kernel_under_interpreter():
    check_under_interpreter(__file__)


def _interp():
    from polynya.kernels.rope import op

    op.KERNEL_ON_CPU = True
    check_kernel("cpu")
    print("INTERP OK")


@pytest.mark.gpu
def test_kernel_on_gpu():
    check_kernel("cuda")


if __name__ == "__main__" and sys.argv[1:] == ["interp"]:
    _interp()
