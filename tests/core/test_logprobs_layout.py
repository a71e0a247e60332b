"""Which layout ``compute_logprobs`` runs (``TokenStats.layout``) and the rule that sends a batch
too small for the GPU from ZoRRo to the packed naive layout (``polynya.logprobs.zorro_pays``)."""
import random

import pytest
import torch
from transformers import AutoConfig

from polynya import RolloutBatch, compute_logprobs
from polynya import logprobs as lp_mod
from polynya.models import load_model

from .batches import random_batch


def test_layer_weights_of_qwen3_0_6b_and_unknown_for_moe():
    cfg = load_model("random:qwen3-0.6b", num_hidden_layers=1).config
    # q, o: 1024 x 2048 each; k, v: 1024 x 1024 each; gate, up, down: 1024 x 3072 each
    assert lp_mod.layer_weights(cfg) == 2 * 1024 * 2048 + 2 * 1024 * 1024 + 3 * 1024 * 3072 == 15_728_640
    moe = load_model("tiny:qwen3-moe").config
    assert lp_mod.layer_weights(moe) is None
    assert lp_mod.layer_weights(AutoConfig.for_model("gpt2")) is None  # no intermediate_size


def test_enough_work_threshold():
    w = 15_728_640
    assert not lp_mod.enough_work(12288, w)   # measured: ZoRRo 0.86x the packed naive step here
    assert lp_mod.enough_work(20480, w)       # 1.34x
    assert lp_mod.enough_work(16384, w) and not lp_mod.enough_work(16383, w)
    assert lp_mod.enough_work(1, None)        # unknown layer size: ZoRRo as asked


def test_cpu_runs_what_was_asked_and_reports_it():
    rng = random.Random(4)
    model = load_model("tiny:qwen3", seed=1)
    batch = random_batch(rng, model.config.vocab_size, groups=2, max_group=3, max_prompt=20, max_response=9)
    z = compute_logprobs(model, batch)
    p = compute_logprobs(model, batch, zorro=False)
    d = compute_logprobs(model, batch, zorro=False, naive_layout="padded")
    assert (z.layout, p.layout, d.layout) == ("zorro", "packed", "padded")
    torch.testing.assert_close(z.logprobs, d.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(p.logprobs, d.logprobs, atol=1e-5, rtol=0)


def test_small_batch_on_a_gpu_would_run_packed(monkeypatch):
    """The decision on a CUDA device, without one: ``zorro_pays`` sees the device type only."""
    model = load_model("random:qwen3-0.6b", num_hidden_layers=1)
    rng = random.Random(5)
    small = random_batch(rng, 1000, groups=1, max_group=8, max_prompt=256, max_response=128)
    monkeypatch.setattr(lp_mod, "_device", lambda m: torch.device("cuda"))
    assert not lp_mod.zorro_pays(model, small, "auto")
    assert lp_mod.zorro_pays(model, small, "split")  # forced: ZoRRo as asked
    monkeypatch.setattr(lp_mod, "ZORRO_MIN_WORK", 0)
    assert lp_mod.zorro_pays(model, small, "auto")


def groups_batch(rng: random.Random, groups: int, P: int, R: int, G: int = 8) -> RolloutBatch:
    prompts, responses = [], []
    for _ in range(groups):
        prompt = [rng.randrange(151936) for _ in range(P)]
        for _ in range(G):
            prompts.append(prompt)
            responses.append([rng.randrange(151936) for _ in range(rng.randint(R // 2, R))])
    return RolloutBatch(prompts, responses)


@pytest.mark.gpu
def test_auto_sends_a_small_batch_to_packed_and_a_large_one_to_zorro_on_cuda():
    model = load_model("random:qwen3-0.6b", num_hidden_layers=2, device="cuda", dtype="bfloat16")
    rng = random.Random(6)
    small, large = groups_batch(rng, 1, 256, 128), groups_batch(rng, 4, 2048, 512)  # ~2.8k / ~74k tokens
    for batch, want in ((small, "packed"), (large, "zorro")):
        auto = compute_logprobs(model, batch)
        forced = compute_logprobs(model, batch, zorro_attention="flex")
        assert auto.layout == want and forced.layout == "zorro"
        torch.testing.assert_close(auto.logprobs, forced.logprobs, atol=0.1, rtol=0)  # bf16
