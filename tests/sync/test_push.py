"""polynya.sync.push.WeightPush: a module's weights into a native sampler in the same process.

Random tiny Qwen3 weights pushed into a sampler, both ways: directly (same dtype) and through
the flat staging buffer (a cast, a chunked ZeRO-3-style gather): afterwards the sampler's
checksum equals the module's (cast to the sampler's dtype) and every weight is bit-equal; the
staging buffer is reused while the layout stays. Refusals leave the sampler unchanged (its
checksum and version): a NaN weight, a corrupted staging buffer (a transport flipping one
value), and a load whose result differs (caught by the checksum after). A push's aten op count
does not grow with the number of tensors on the kernel path (``TRITON_INTERPRET=1`` child on
CPU; compiled and bounded on a GPU).
"""
from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
from polynya.checksum import checksum_named_tensors
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine
from polynya.models import load_model, tiny_tokenizer
from polynya.sync import SyncError, WeightPush
from polynya.weights import FlatBuckets

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
from op_count import OpCount
from triton_interp import check_under_interpreter


def model_dir(root, layers: int) -> str:
    d = os.path.join(str(root), f"tiny_qwen3_{layers}")
    if not os.path.isdir(d):
        load_model("tiny:qwen3", seed=1, num_hidden_layers=layers).save_pretrained(d)
        tiny_tokenizer().save_pretrained(d)
    return d


def setup(root, dtype: str, device: str = "cpu", layers: int = 2, seed: int = 2):
    """A sampler in ``dtype`` and a policy of the same shape with other random weights
    (fp32 on the sampler's device)."""
    d = model_dir(root, layers)
    engine = SamplingEngine(SamplerConfig(d, dtype=dtype, device=device, block_size=4,
                                          num_blocks=32, seed=0))
    policy = load_model("tiny:qwen3", seed=seed, num_hidden_layers=layers).to(device)
    return engine, policy


def cast_checksum(policy, dtype: str) -> str:
    dt = getattr(torch, dtype)
    return checksum_named_tensors([(n, p.detach().to(dt)) for n, p in policy.named_parameters()])


def sampler_state(engine):
    return engine.weight_checksum(), engine.weight_version


def perturb(policy, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * 1e-2)


@pytest.mark.parametrize("dtype, path", [("float32", "direct"), ("bfloat16", "staged"),
                                         ("fp32", "direct"), ("bf16", "staged"), (torch.bfloat16, "staged")])
def test_push_makes_sampler_equal_policy(tmp_path, dtype, path):
    """Every dtype spelling SamplerConfig takes (the push crashed on "bf16", "fp32", torch dtypes)."""
    engine, policy = setup(tmp_path, dtype)
    dtype = {"fp32": "float32", "bf16": "bfloat16", torch.bfloat16: "bfloat16"}.get(dtype, dtype)
    push = WeightPush()
    ptr = None
    for step in range(3):
        got = push(engine, policy.named_parameters())
        assert push.last_path == path
        assert got == cast_checksum(policy, dtype) == engine.weight_checksum()
        served = dict(engine.backend.runner.model.named_parameters())
        for n, p in policy.named_parameters():
            assert torch.equal(served[n], p.detach().to(getattr(torch, dtype))), n
        if path == "staged":
            ptr = ptr or push._stage.flat.data_ptr()
            assert push._stage.flat.data_ptr() == ptr  # the staging buffer is reused
        perturb(policy, step)
    push.release()
    assert push._stage is None


def test_stage_follows_the_layout(tmp_path):
    """One WeightPush into samplers of two dtypes: the staging buffer is rebuilt for the new
    dtype (the old one dropped first) and each sampler equals the policy cast to its dtype."""
    bf16, policy = setup(tmp_path, "bfloat16")
    f16 = setup(tmp_path, "float16")[0]
    push = WeightPush()
    for engine, dtype in ((bf16, "bfloat16"), (f16, "float16"), (bf16, "bfloat16")):
        assert push(engine, policy.named_parameters()) == cast_checksum(policy, dtype)
        assert push._stage.flat.dtype == getattr(torch, dtype)
        assert engine.weight_checksum() == cast_checksum(policy, dtype)


def test_chunked_gather_stages_every_parameter_once(tmp_path):
    engine, policy = setup(tmp_path, "float32")
    seen: list[list[str]] = []
    ids = {id(p): n for n, p in policy.named_parameters()}

    @contextlib.contextmanager
    def gather(params):  # as TRL's DistributedBackend.gather_params under ZeRO-3
        seen.append([ids[id(p)] for p in params])
        yield

    push = WeightPush(chunk_bytes=20_000)
    push(engine, policy.named_parameters(), gather=gather)
    assert push.last_path == "staged"  # a gather always stages (the shards are released)
    assert engine.weight_checksum() == cast_checksum(policy, "float32")
    assert [n for c in seen for n in c] == [n for n, _ in policy.named_parameters()]
    assert 2 < len(seen) < len(ids)  # several chunks, several parameters each
    with pytest.raises(ValueError, match="chunk_bytes"):
        WeightPush(chunk_bytes=0)


def pushed_once(root, dtype: str):
    """A sampler that got one push of the policy, the policy perturbed since, its push and the
    sampler's (checksum, version) after that first push."""
    engine, policy = setup(root, dtype)
    push = WeightPush()
    push(engine, policy.named_parameters())
    perturb(policy, 7)
    return engine, policy, push, sampler_state(engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nan_weight_is_refused_sampler_unchanged(tmp_path, dtype):
    engine, policy, push, before = pushed_once(tmp_path, dtype)
    with torch.no_grad():
        policy.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    with pytest.raises(SyncError, match="NaN or inf"):
        push(engine, policy.named_parameters())
    assert sampler_state(engine) == before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_corrupted_transfer_is_refused_sampler_unchanged(tmp_path, dtype):
    """A transport that flips one value of what it carries (the staging buffer, or a pair)."""
    engine, policy, push, before = pushed_once(tmp_path, dtype)
    load = engine.load_weights

    def faulty(weights, version=None, **kw):
        if isinstance(weights, FlatBuckets):
            flat = weights.flats[0].clone()
            flat[weights.specs[0].offsets[4] + 2] += 1.0
            weights = FlatBuckets(weights.specs, [flat])
        else:
            weights = [(n, t.clone() if i == 4 else t) for i, (n, t) in enumerate(weights)]
            weights[4][1].view(-1)[2] += 1.0
        return load(weights, version=version, **kw)

    engine.load_weights = faulty
    with pytest.raises(SyncError, match="checksum mismatch"):
        push(engine, policy.named_parameters())
    assert sampler_state(engine) == before


def test_wrong_result_after_load_is_caught(tmp_path):
    """A load that reports success but leaves other weights: the checksum after catches it."""
    engine, policy = setup(tmp_path, "bfloat16")
    load = engine.load_weights

    def lossy(weights, version=None, **kw):
        out = load(weights, version=version, **kw)
        with torch.no_grad():
            next(engine.backend.runner.model.parameters()).view(-1)[0] += 1.0
        return out

    engine.load_weights = lossy
    with pytest.raises(SyncError, match="after the push hash"):
        WeightPush()(engine, policy.named_parameters())


def push_ops(root, dtype: str, device: str, layers: int) -> int:
    """aten ops of the third push (layouts cached) of a ``layers``-layer model."""
    engine, policy = setup(root, dtype, device, layers=layers)
    push = WeightPush()
    for seed in range(2):
        push(engine, policy.named_parameters())
        perturb(policy, seed)
    with OpCount() as c:
        push(engine, policy.named_parameters())
    assert engine.weight_checksum() == cast_checksum(policy, dtype)
    return c.ops


def check_op_count(root, device: str, bound: int | None) -> None:
    """Both ways, a push of 6 layers (69 tensors) costs as many aten ops as one of 2 (25)."""
    for dtype in ("float32", "bfloat16"):
        few, many = push_ops(root, dtype, device, 2), push_ops(root, dtype, device, 6)
        assert few == many, (dtype, few, many)
        if bound is not None:
            assert many <= bound, (dtype, many)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter is on")
def test_op_count_under_interpreter():
    check_under_interpreter(__file__)


def _interp():
    import tempfile

    from polynya.kernels.digest import op

    op.KERNEL_ON_CPU = True
    check_op_count(tempfile.mkdtemp(), "cpu", None)
    print("INTERP OK")


@pytest.mark.gpu
def test_op_count_on_gpu(tmp_path):
    check_op_count(tmp_path, "cuda", 80)


if __name__ == "__main__" and sys.argv[1:] == ["interp"]:
    _interp()
