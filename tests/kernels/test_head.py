"""LM-head statistics kernels (polynya.kernels.head) against their torch reference.

The Triton kernels run under ``TRITON_INTERPRET=1`` in a child process on CPU (fp32, a
vocabulary that is not a multiple of the block, temperatures != 1, with and without entropy);
on the GPU in bf16 against the fp32 reference (bf16 rule: the error of the reference run on the
same bf16 logits is the budget — both read the same rounded logits, so they must agree closely).
"""
import os
import sys

import pytest
import torch
from triton_interp import run_under_interpreter

from polynya.kernels.head import logit_grad, row_stats
from polynya.kernels.head.reference import logit_grad_reference, row_stats_reference


def make(n, vocab, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 3).to(device, dtype)
    target = torch.randint(0, vocab, (n,), generator=g).to(device)
    g_lp = torch.randn(n, generator=g).to(device)
    g_ent = torch.randn(n, generator=g).to(device)
    return logits, target, g_lp, g_ent


def check(n, vocab, dtype, device, seed, atol):
    logits, target, g_lp, g_ent = make(n, vocab, dtype, device, seed)
    for temp in (1.0, 0.7):
        for entropy in (False, True):
            want = row_stats_reference(logits, target, temp, entropy)
            got = row_stats(logits, target, temp, entropy)
            for a, b in zip(got, want):
                if b is not None:
                    torch.testing.assert_close(a, b, atol=atol, rtol=atol)
            _, lse, ent = want
            ge = g_ent if entropy else None
            want_dz = logit_grad_reference(logits, target, lse, ent, g_lp, ge, temp)
            got_dz = logit_grad(logits.clone(), target, lse, ent, g_lp, ge, temp)
            torch.testing.assert_close(got_dz.float(), want_dz.float(), atol=atol, rtol=atol)


def test_cpu_path_is_the_reference():
    logits, target, g_lp, _ = make(5, 37, torch.float32, "cpu", 0)
    assert torch.equal(row_stats(logits, target, 1.0, False)[0],
                       row_stats_reference(logits, target, 1.0, False)[0])


def test_bad_inputs_are_rejected():
    logits, target, g_lp, g_ent = make(5, 37, torch.float32, "cpu", 0)
    _, lse, ent = row_stats(logits, target, 1.0, True)
    for args in ((logits[0], target), (logits, target[:4]), (logits, target[:, None])):
        with pytest.raises(ValueError, match="target"):
            row_stats(*args, 1.0, False)
    with pytest.raises(ValueError, match="temperature"):
        row_stats(logits, target, 0.0, False)
    with pytest.raises(ValueError, match="per-row"):
        logit_grad(logits, target, lse[:4], None, g_lp, None, 1.0)
    with pytest.raises(ValueError, match="both ent and g_ent"):
        logit_grad(logits, target, lse, ent, g_lp, None, 1.0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter is on")
def test_triton_kernels_under_interpreter():
    run_under_interpreter(__file__)


def _interp():
    import polynya.kernels.head.op as op

    op._rows_ok = lambda logits: logits.dim() == 2 and logits.shape[0] > 0  # run Triton on CPU
    op.BLOCK_V = 32
    check(6, 101, torch.float32, "cpu", 1, 1e-5)
    print("INTERP OK")


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [151936, 32003])
def test_kernels_on_gpu(vocab):
    check(300, vocab, torch.float32, "cuda", 2, 1e-4)
    logits, target, g_lp, g_ent = make(300, vocab, torch.bfloat16, "cuda", 3)
    logp, lse, ent = row_stats(logits, target, 0.9, True)
    ref = row_stats_reference(logits, target, 0.9, True)
    for a, b in zip((logp, lse, ent), ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    dz = logit_grad(logits.clone(), target, lse, ent, g_lp, g_ent, 0.9)
    want = logit_grad_reference(logits, target, lse, ent, g_lp, g_ent, 0.9)
    assert (dz.float() - want.float()).abs().max() <= 2 * want.float().abs().max() * 2 ** -8


if __name__ == "__main__" and sys.argv[1:] == ["interp"]:
    _interp()
