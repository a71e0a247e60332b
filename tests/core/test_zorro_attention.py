"""The ZoRRo attention switch: path choice, the mask object transformers must pass through,
and the ``zorro_attention`` option's validation (the kernels are in tests/kernels)."""
import random

import numpy as np
import pytest
import torch
from polynya import compute_logprobs
from polynya.config.logprob import LogProbConfig
from polynya.config.train import TrainConfig
from polynya.models import load_model
from polynya.zorro.attention import MAX_INNER, ZorroMask, _split_pays, zorro_mask
from transformers.masking_utils import _preprocess_mask_arguments

from .batches import random_batch


def two_level(groups, prompt, responses, length):
    """Node table of `groups` trees: a prompt node with `responses` leaves of `length` each."""
    rows, cur = [], 0
    for _ in range(groups):
        stop = cur + prompt + responses * length
        rows.append([cur, cur + prompt, stop])
        rows += [[s, s + length, s + length] for s in range(cur + prompt, stop, length)]
        cur = stop
    return np.array(rows)


def test_auto_takes_split_where_it_was_measured_ahead():
    assert _split_pays(two_level(4, 4096, 8, 512))        # shared/own work 33
    assert _split_pays(two_level(4, 1024, 8, 1024))       # 2.2
    assert not _split_pays(two_level(4, 256, 8, 512))     # 1.06: FlexAttention was faster
    assert not _split_pays(np.array([[0, 5, 5], [5, 9, 9]]))  # nothing shared
    assert not _split_pays(two_level(MAX_INNER + 1, 4096, 2, 8))  # too many calls


def test_zorro_mask_passes_through_transformers_untouched():
    tin = torch.zeros(2, 16, dtype=torch.int32)
    mask = ZorroMask(tin, tin, None, "auto")
    assert mask.shape == (2, 1, 16, 16) and "flex" in repr(mask)
    model = load_model("tiny:qwen3", seed=0)
    embeds = torch.zeros(2, 16, model.config.hidden_size)
    early, out, *_ = _preprocess_mask_arguments(model.config, embeds, mask, None, None, None)
    assert early and out is mask


@pytest.mark.parametrize("bad", ["cudnn", "", None, "Split"])
def test_bad_zorro_attention_is_rejected(bad):
    model = load_model("tiny:qwen3", seed=0)
    batch = random_batch(random.Random(0), model.config.vocab_size, groups=2)
    with pytest.raises(ValueError, match="zorro_attention"):
        compute_logprobs(model, batch, zorro_attention=bad)
    with pytest.raises(ValueError, match="zorro_attention"):
        zorro_mask(torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32),
                   attention=bad)
    with pytest.raises(ValueError, match="zorro_attention"):
        TrainConfig(model="tiny:qwen3", zorro_attention=bad)
    with pytest.raises(ValueError, match="zorro_attention"):
        LogProbConfig(model="tiny:qwen3", zorro_attention=bad)


def test_cpu_ignores_the_gpu_path_choice():
    model = load_model("tiny:qwen3", seed=0)
    batch = random_batch(random.Random(1), model.config.vocab_size, groups=3)
    runs = [compute_logprobs(model, batch, zorro_attention=a).logprobs for a in ("auto", "split", "flex")]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


def test_split_plan_is_chosen_per_input_and_refused_with_a_reason():
    rows = torch.zeros(1, 16, dtype=torch.int32)
    nodes = two_level(1, 8, 2, 4)
    q, k = torch.zeros(1, 4, 16, 8), torch.zeros(1, 2, 16, 8)
    assert ZorroMask(rows, rows, nodes, "auto").split_plan(q, k) is None   # CPU: not the kernels
    assert ZorroMask(rows, rows, nodes, "flex").split_plan(q, k) is None
    with pytest.raises(ValueError, match="CUDA"):
        ZorroMask(rows, rows, nodes, "split").split_plan(q, k)


@pytest.mark.parametrize("window,softcap", [(None, 0.8), (6, None), (9, 1.5)])
def test_flex_path_with_window_and_softcap_equals_dense_on_cpu(window, softcap):
    """The GPU path's math (windowed block mask + soft-cap score_mod through FlexAttention,
    uncompiled: forward only on CPU) equals the dense CPU path on a packed forest."""
    from polynya.eager_attention import eager_attention
    from polynya.zorro import pack_rows
    from polynya.zorro.attention import FLEX_BLOCK, softcap_score_mod
    from torch.nn.attention.flex_attention import flex_attention

    batch = random_batch(random.Random(3), 50, groups=3, max_group=3, max_prompt=20,
                         max_response=12)
    rows = pack_rows(batch, pad_multiple=FLEX_BLOCK)
    mask = ZorroMask(rows.tin, rows.tout, rows.nodes, "flex", rows.position_ids)
    g = torch.Generator().manual_seed(0)
    r, length = rows.tin.shape
    q = torch.randn(r, 4, length, 16, generator=g) * 2
    k, v = (torch.randn(r, 2, length, 16, generator=g) for _ in range(2))
    got = flex_attention(q, k, v, score_mod=softcap_score_mod(softcap),
                         block_mask=mask.flex_mask(window), scale=0.3, enable_gqa=True)
    ref = eager_attention(q, k, v, mask.dense(window), 0.3, softcap)
    real = rows.tin[0] != np.iinfo(np.int32).max
    torch.testing.assert_close(got[:, :, real], ref[:, :, real], atol=1e-5, rtol=1e-5)
    plain = eager_attention(q, k, v, mask.dense(), 0.3)
    assert (ref - plain)[:, :, real].abs().max() > 1e-3


def test_compiled_flex_is_one_copy_per_configuration(monkeypatch):
    """Each FlexAttention configuration gets its own compiled copy (its own recompile budget;
    tests/core/test_dynamo.py shows why), keyed on what Dynamo specialises on: a new batch's
    mask (new tensors, same rule) reuses the copy, a new window, dtype or grad mode does not;
    the least recently used copy goes past ``_FLEX_CONFIGS``."""
    import polynya.zorro.attention as att
    from polynya.zorro import pack_rows

    monkeypatch.setattr(att, "_COMPILED_FLEX", type(att._COMPILED_FLEX)())
    monkeypatch.setattr(att, "_FLEX_CONFIGS", 3)

    def key(seed, window=None, dtype=torch.float32, softcap=None):
        batch = random_batch(random.Random(seed), 50, groups=2, max_group=3, max_prompt=20,
                             max_response=12)
        rows = pack_rows(batch, pad_multiple=att.FLEX_BLOCK)
        mask = ZorroMask(rows.tin, rows.tout, rows.nodes, "flex", rows.position_ids)
        q, k = torch.zeros(1, 4, 8, 16, dtype=dtype), torch.zeros(1, 2, 8, 16, dtype=dtype)
        return att.flex_key(q, k, mask.flex_mask(window), 0.25, softcap)

    base = att.compiled_flex(key(1))
    assert att.compiled_flex(key(2)) is base  # another batch: same code, captures are tensors
    others = [att.compiled_flex(key(1, window=6)), att.compiled_flex(key(1, dtype=torch.bfloat16))]
    with torch.no_grad():
        others.append(att.compiled_flex(key(1)))
    assert len({id(f) for f in [base, *others]}) == 4
    assert key(1, window=6) != key(1, window=9) and key(1, softcap=0.5) != key(1)
    assert len(att._COMPILED_FLEX) == 3 and key(1) not in att._COMPILED_FLEX  # least recent out
    assert att.compiled_flex(key(1, window=6)) is others[0]


def test_flex_head_dims_below_16_are_refused_on_cuda():
    """FlexAttention's CUDA kernels need head dim >= 16: polynya names the way out instead of
    torch's compiler error; the CPU path (no FlexAttention) is unaffected."""
    from polynya.zorro.attention import check_flex_head_dim

    with pytest.raises(ValueError, match="head dim 8 is below 16.*naive_layout='padded'"):
        check_flex_head_dim(8, torch.device("cuda", 0), torch.float32)
    check_flex_head_dim(16, "cuda", torch.bfloat16)
    check_flex_head_dim(8, "cpu", torch.float32)
