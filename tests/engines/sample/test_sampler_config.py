"""SamplerConfig validation and backend dispatch."""
from __future__ import annotations

import importlib.util

import pytest
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine


def test_defaults_validate():
    cfg = SamplerConfig("tiny:qwen3")
    assert cfg.backend == "native" and cfg.fca and cfg.block_size == 16
    assert cfg.torch_device in ("cpu", "cuda")


@pytest.mark.parametrize("field, value", [
    ("model", ""), ("model", None), ("dtype", "int8"), ("backend", "sglang"), ("device", "tpu"),
    ("block_size", 0), ("block_size", 2.5), ("num_blocks", 0), ("kv_cache_memory_gb", -1),
    ("max_num_seqs", 0), ("max_num_batched_tokens", 0), ("max_model_len", 0), ("fca", "yes"),
    ("cuda_graphs", 1), ("seed", 1.5), ("seed", True), ("fca_min_shared_tokens", -1),
    ("fca_min_shared_tokens", 2.0), ("fca_min_shared_tokens", True), ("async_scheduling", 1),
    ("async_scheduling", None), ("fca_chunk_tokens", 0), ("fca_chunk_tokens", 512.0),
    ("fca_shared_progs_per_sm", 0), ("fca_shared_progs_per_sm", True),
    ("compile_decode", 1), ("compile_decode", "auto"), ("compile_scope", "layer"),
    ("compile_scope", None),
])
def test_bad_fields_raise_value_error(field, value):
    kwargs = {"model": "tiny:qwen3", field: value}
    with pytest.raises(ValueError, match=field if field != "model" else "model"):
        SamplerConfig(**kwargs)


def test_compile_decode_default_is_on_for_cuda_only():
    auto = SamplerConfig("tiny:qwen3")
    assert auto.compile_decode is None and auto.compile_scope == "layers"
    assert auto.decode_compiled("cuda") and not auto.decode_compiled("cpu")
    for forced in (True, False):
        cfg = SamplerConfig("tiny:qwen3", compile_decode=forced)
        assert cfg.decode_compiled("cuda") is forced and cfg.decode_compiled("cpu") is forced


def test_engine_needs_a_sampler_config():
    with pytest.raises(ValueError, match="SamplerConfig"):
        SamplingEngine({"model": "tiny:qwen3"})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_backend_without_vllm_names_the_extra():
    with pytest.raises(ImportError, match=r"pip install polynya\[vllm\]"):
        SamplingEngine(SamplerConfig("tiny:qwen3", backend="vllm"))


def test_kv_budget_sizes_the_cache():
    engine = SamplingEngine(SamplerConfig("tiny:qwen3", dtype="float32", device="cpu",
                                          kv_cache_memory_gb=0.001, block_size=8))
    runner = engine.backend.runner
    per_block = 2 * 2 * 8 * 2 * 16 * 4  # layers * (k, v) * block * kv heads * head dim * fp32
    assert runner.num_blocks == int(0.001 * 2**30) // per_block
    assert engine.stats()["num_blocks"] == runner.num_blocks


def test_vllm_weight_pieces_split_by_hf_shapes():
    """What the vLLM backend hands vLLM: buckets split by the HF shapes, every name checked
    before vLLM sees any piece (its own loader would stop half-way on an unknown name)."""
    import torch
    from polynya.weights import checked_pairs

    shapes = {"a": torch.Size([2, 3]), "b": torch.Size([4]), "c": torch.Size([1])}
    flat = torch.arange(10.0)
    pairs = dict(checked_pairs([(["a", "b"], flat), ("c", torch.ones(1))], shapes))
    assert pairs["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and pairs["b"].tolist() == [6, 7, 8, 9]
    assert pairs["c"].tolist() == [1.0]
    with pytest.raises(ValueError, match="flat bucket"):
        checked_pairs([(["a", "b"], flat[:-1])], shapes)
    with pytest.raises(ValueError, match="unknown"):
        checked_pairs([(["zz"], flat)], shapes)
    with pytest.raises(ValueError, match="unknown"):
        checked_pairs([("c", torch.ones(1)), ("zz", torch.ones(1))], shapes)



def test_default_cache_is_sized_from_the_model_and_the_machine(monkeypatch):
    """No budget given: enough blocks for max_num_seqs full-length sequences, capped at a share
    of the available memory; the tiny model no longer gets a 4 GiB cache."""
    import time

    from polynya.engines.sample.native import model_runner as mr

    per_block = 2 * 2 * 16 * 2 * 16 * 4  # layers * (k, v) * block * kv heads * head dim * fp32
    t0 = time.perf_counter()
    engine = SamplingEngine(SamplerConfig("tiny:qwen3", dtype="float32", device="cpu",
                                          max_num_seqs=8, max_model_len=1000))
    runner = engine.backend.runner
    assert runner.num_blocks == 8 * 63 and runner.max_model_len == 1000  # ceil(1000 / 16) = 63
    assert time.perf_counter() - t0 < 30
    monkeypatch.setattr(mr, "available_memory", lambda device: 100 * per_block)
    small = SamplingEngine(SamplerConfig("tiny:qwen3", dtype="float32", device="cpu"))
    assert small.backend.runner.num_blocks == int(100 * per_block * mr.KV_AUTO_FRACTION["cpu"]) // per_block
    assert small.backend.runner.max_model_len == small.backend.runner.num_blocks * 16
    out = small.generate([[5, 6, 7]], __import__("polynya").SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0][0].token_ids) == 4
    monkeypatch.setattr(mr, "available_memory", lambda device: per_block)
    with pytest.raises(ValueError, match="holds no KV block"):
        SamplingEngine(SamplerConfig("tiny:qwen3", dtype="float32", device="cpu"))


@pytest.mark.parametrize("budget, why", [
    ({"num_blocks": 8}, "KV cache holds 32 tokens"),
    ({"num_blocks": 4096, "max_model_len": 9000}, "model's window is 8192"),
])
def test_an_explicit_max_model_len_that_cannot_be_served_is_refused(budget, why):
    """A ``max_model_len`` the cache (or the model's window) cannot hold is refused at build
    time. It used to be lowered in silence: a 5-token prompt asked for 30 tokens came back
    with 27 and ``finish_reason="length"``, a rollout cut short with no error. Without
    ``max_model_len`` the window is still what the cache holds."""
    kw = {"model": "tiny:qwen3", "dtype": "float32", "device": "cpu", "block_size": 4,
          "max_model_len": 40, **budget}
    with pytest.raises(ValueError, match=f"max_model_len={kw['max_model_len']}.*{why}"):
        SamplingEngine(SamplerConfig(**kw))
    fits = SamplingEngine(SamplerConfig(**{**kw, "max_model_len": 32, "num_blocks": 8}))
    assert fits.backend.max_model_len == 32
    auto = SamplingEngine(SamplerConfig(**{**kw, "max_model_len": None, "num_blocks": 8}))
    assert auto.backend.max_model_len == 32
