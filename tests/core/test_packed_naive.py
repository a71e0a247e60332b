"""The packed naive layout (``zorro=False, naive_layout="packed"``) on CPU, fp32: equal to the
padded naive rows and to ZoRRo (log-probs, entropy, parameter gradients) on random batches,
its rows laid out as verl's remove-padding does, its refusals and configuration."""
import random

import numpy as np
import pytest
import torch

from polynya import RolloutBatch, compute_logprobs
from polynya.config import LogProbConfig, TrainConfig
from polynya.models import load_model
from polynya.zorro import pack_rows

from .batches import random_batch

FAMILIES = ["tiny:qwen3", "tiny:llama", "tiny:qwen3-moe"]


def _run(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    st = compute_logprobs(model, batch, entropy=True, chunk_size=13, **kw)
    w = torch.linspace(-1, 1, st.logprobs.numel()).view_as(st.logprobs)  # non-uniform upstream grad
    ((st.logprobs * w).sum() + 0.3 * (st.entropy * st.mask).sum()).backward()
    return st, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_equals_padded_and_zorro_fp32(family, seed):
    rng = random.Random(100 + seed)
    model = load_model(family, seed=seed + 20)
    batch = random_batch(rng, model.config.vocab_size, groups=5, max_group=6, max_prompt=20,
                         max_response=15)
    padded, g_padded = _run(model, batch, zorro=False, naive_layout="padded")
    runs = {"packed": dict(zorro=False, naive_layout="packed"),
            "packed, budget 50": dict(zorro=False, naive_layout="packed", max_tokens_per_row=50),
            "auto": dict(zorro=False),
            "zorro": dict(zorro=True, max_tokens_per_row=64)}
    for name, kw in runs.items():
        st, grads = _run(model, batch, **kw)
        assert torch.equal(st.mask, padded.mask), name
        torch.testing.assert_close(st.logprobs, padded.logprobs, atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(st.entropy, padded.entropy, atol=1e-5, rtol=0, msg=name)
        assert (st.logprobs[~st.mask] == 0).all() and (st.logprobs[st.mask] < 0).all(), name
        assert grads.keys() == g_padded.keys() and len(grads) > 0
        for k, g in g_padded.items():
            rel = (grads[k] - g).norm() / g.norm().clamp_min(1e-12)
            assert rel < 1e-5, f"{name} {k}: relative grad error {rel:.2e}"


def test_packed_rows_are_samples_back_to_back():
    """share=False: every sample's prompt + response once per sample, positions restarting at 0,
    each sample its own node (a leaf); the budget cuts rows by prompt + response tokens."""
    rng = random.Random(3)
    batch = random_batch(rng, 100, groups=4, max_group=5)
    seqs = [np.concatenate([p, r]) for p, r in zip(batch.prompts, batch.responses)]
    rows = pack_rows(batch, share=False)
    assert rows.input_ids.shape == (1, sum(s.size for s in seqs)) == (1, rows.num_real_tokens)
    assert (rows.nodes[:, 1] == rows.nodes[:, 2]).all() and len(rows.nodes) == len(batch)
    for (start, end, _), s in zip(rows.nodes, seqs):  # samples in batch order
        assert np.array_equal(rows.input_ids[0, start:end].numpy(), s)
        assert np.array_equal(rows.position_ids[0, start:end].numpy(), np.arange(s.size))
    shared = pack_rows(batch)  # ZoRRo: the same batch deduplicated
    assert shared.num_real_tokens < rows.num_real_tokens
    budget = 60
    cut = pack_rows(batch, share=False, max_tokens_per_row=budget, pad_multiple=8)
    assert cut.input_ids.shape[0] > 1 and cut.input_ids.shape[1] % 8 == 0
    assert cut.num_real_tokens == rows.num_real_tokens
    per_row = np.bincount(cut.nodes[:, 0] // cut.input_ids.shape[1], cut.nodes[:, 1] - cut.nodes[:, 0])
    group_size = max(sum(s.size for s, p in zip(seqs, batch.prompts) if np.array_equal(p, q))
                     for q in batch.prompts)
    assert per_row.max() <= max(budget, group_size)  # a group over budget gets a row of its own


def test_segment_bounds_cover_padding_and_never_cross_a_row():
    from polynya.kernels.zorro import segment_bounds

    nodes = np.array([[0, 3, 3], [3, 7, 7], [10, 12, 12], [12, 15, 15]])  # rows of 10 tokens
    assert segment_bounds(nodes, 20, 10).tolist() == [0, 3, 7, 10, 12, 15, 20]
    with pytest.raises(ValueError, match="segments only"):
        segment_bounds(np.array([[0, 3, 7], [3, 7, 7]]), 10, 10)


def test_varlen_reference_equals_a_block_diagonal_mask():
    """The kernel's reference (the oracle of the GPU test) == SDPA under a dense block-diagonal
    causal mask, outputs and gradients, with GQA."""
    from polynya.kernels.zorro import varlen_attention

    torch.manual_seed(0)
    lens = [5, 1, 9, 4]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    t = sum(lens)
    q = torch.randn(t, 4, 8, requires_grad=True)
    k, v = (torch.randn(t, 2, 8, requires_grad=True) for _ in range(2))
    out = varlen_attention(q, k, v, cu, max(lens), 0.3)
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    idx = torch.arange(t)
    mask = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.3,
        enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    w = torch.randn_like(out)
    g1 = torch.autograd.grad((out * w).sum(), (q, k, v))
    g2 = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(q, k, v, cu.long(), max(lens), 0.3)


def test_varlen_is_refused_for_rows_that_share():
    model = load_model("tiny:qwen3", seed=0)
    batch = RolloutBatch([[5, 6, 7]] * 3, [[8], [9, 10], [11]])
    with pytest.raises(ValueError, match="zorro_attention='varlen' needs rows of separate samples"):
        compute_logprobs(model, batch, zorro=True, zorro_attention="varlen")
    a = compute_logprobs(model, batch, zorro=False, zorro_attention="varlen")  # CPU: exact anyway
    b = compute_logprobs(model, batch, zorro=False, naive_layout="padded")
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_naive_layout_is_validated_everywhere():
    model = load_model("tiny:qwen3", seed=0)
    batch = RolloutBatch([[5, 6, 7]], [[8]])
    with pytest.raises(ValueError, match="naive_layout must be one of"):
        compute_logprobs(model, batch, zorro=False, naive_layout="ragged")
    for cls in (TrainConfig, LogProbConfig):
        with pytest.raises(ValueError, match=f"{cls.__name__}.naive_layout must be one of"):
            cls("tiny:qwen3", naive_layout="ragged")
        assert cls("tiny:qwen3").naive_layout == "auto"
        assert cls("tiny:qwen3", zorro_attention="varlen").zorro_attention == "varlen"


def test_auto_picks_cudnn_for_long_near_equal_segments_and_varlen_otherwise():
    from polynya.zorro.attention import ZorroMask, _leaf_batch_pays

    def leaves(lens):
        ends = np.cumsum(lens)
        return np.stack([ends - np.array(lens), ends, ends], 1)

    assert _leaf_batch_pays(leaves([4608] * 32))           # equal: no padding at all
    assert _leaf_batch_pays(leaves([2000, 2048, 2010, 1990]))  # long, near-equal
    assert not _leaf_batch_pays(leaves([700, 768, 740, 760]))  # near-equal but short: varlen
    assert not _leaf_batch_pays(leaves([4608, 100, 90, 300, 120]))  # ragged: varlen
    t = torch.zeros(1, 4096, dtype=torch.int32)
    for lens, path in (([2048, 2048], "split"), ([64, 64], "varlen"), ([1, 70], "varlen")):
        assert f"path={path}" in repr(ZorroMask(t, t, leaves(lens), "auto"))
    assert "path=varlen" in repr(ZorroMask(t, t, leaves([64, 64]), "varlen"))
    assert "path=flex" in repr(ZorroMask(t, t, leaves([64, 64]), "flex"))
