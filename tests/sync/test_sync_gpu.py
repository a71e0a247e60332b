"""GPU truth for the sync checksum: the Triton digest equals the torch reference on CUDA, for
views scattered over one storage (the span layout) and ragged sizes."""
import pytest
import torch

from polynya.checksum import checksum_named_tensors, checksum_views

pytestmark = pytest.mark.gpu


def one_group(vocab: int):
    """Two random responses of 6 tokens behind one prompt of 12, advantages +1 / -1."""
    from polynya import RolloutBatch

    g = torch.Generator().manual_seed(0)
    return RolloutBatch([torch.randint(0, vocab, (12,), generator=g).tolist()] * 2,
                        [torch.randint(0, vocab, (6,), generator=g).tolist() for _ in range(2)],
                        advantages=torch.tensor([1.0, -1.0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_checksum_views_on_cuda(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    flat = (torch.randn(3_000_017, generator=g, device="cuda") * 50).to(dtype)
    starts, lens = [0, 4096, 100_000, 1_000_001, 2_999_000], [4096, 95_904, 900_001, 1_998_999, 1017]
    views = [(f"w{i}", flat[s:s + n].view(-1, 1)) for i, (s, n) in enumerate(zip(starts, lens))]
    assert checksum_views(views) == checksum_named_tensors(views)


def test_layout_checksums_on_cuda():
    """The cached layouts' kernel path (trainer spans with padding, receiver buckets, a tensor
    of many thousand blocks) equals the CPU reference."""
    from polynya.sync import StagedUpdate, build_manifest
    from polynya.spans import span_layout

    g = torch.Generator(device="cuda").manual_seed(1)
    module = torch.nn.Module()
    shapes = [(5000, 4096), (3, 7), (1,), (4096,), (1000, 1001)]  # 20M elements: > RBLOCK blocks
    flat = torch.empty(sum(torch.Size(s).numel() + 9 for s in shapes), device="cuda",
                       dtype=torch.bfloat16)
    pos = 0
    for i, s in enumerate(shapes):
        n = torch.Size(s).numel()
        view = flat[pos:pos + n].view(s)
        view.copy_(torch.randn(s, generator=g, device="cuda") * 30)
        module.register_parameter(f"w{i}", torch.nn.Parameter(view, requires_grad=False))
        pos += n + 9
    want = checksum_named_tensors([(n, p.cpu()) for n, p in module.named_parameters()])
    trainer = type("T", (), {"module": module})()
    m = build_manifest(trainer, version=1, bucket_bytes=1 << 20, layout="spans")
    assert m.checksum == want and m.buckets[0].offsets is not None
    layout, spans = span_layout(module)
    assert layout.plan.kernel_ok(spans)
    staged = StagedUpdate(m)
    staged.put(0, spans[0].clone())
    assert staged.checksum() == m.checksum
    staged.flats[0][17] += 1
    assert staged.checksum() != want


@pytest.mark.parametrize("bucket_bytes", [1 << 16, 1 << 30])
def test_sampler_takes_a_sync_through_the_fused_kernel(bucket_bytes):
    """A native sampler on CUDA applies a packed sync with the compiled check + copy kernels
    (``VerifiedBucketCopy``): weights equal the sent ones bit for bit, a one-bit corruption is
    refused and leaves every weight and the version as they were."""
    from polynya.checksum import checksum_named_tensors
    from polynya.config import SamplerConfig
    from polynya.engines import SamplingEngine
    from polynya.sync import StagedUpdate, SyncError, SyncManifest, apply_update, plan_buckets
    from polynya.verified_copy import VerifiedBucketCopy

    sampler = SamplingEngine(SamplerConfig("tiny:qwen3", dtype="bfloat16", device="cuda",
                                           num_blocks=32, block_size=8, cuda_graphs=False))
    named = list(sampler.backend.runner.model.named_parameters())
    g = torch.Generator(device="cuda").manual_seed(2)
    new = [(n, (p.detach() + torch.randn(p.shape, generator=g, device="cuda") * 0.01)
            .to(p.dtype)) for n, p in named]
    specs = plan_buckets([(n, tuple(t.shape)) for n, t in new], 2, bucket_bytes)
    by_name = dict(new)
    flats = [torch.cat([by_name[n].reshape(-1) for n in s.names]) for s in specs]
    manifest = SyncManifest(1, "torch.bfloat16", checksum_named_tensors(new), specs)

    def staged(bufs):
        out = StagedUpdate(manifest)
        for i, f in enumerate(bufs):
            out.put(i, f)
        return out

    before = sampler.weight_checksum()
    bad = [f.clone() for f in flats]
    bad[-1].view(torch.int16)[-3] ^= 1
    with pytest.raises(SyncError, match="checksum mismatch"):
        apply_update(sampler, staged(bad))
    assert sampler.weight_checksum() == before and sampler.weight_version == 0
    plans = [p for p in sampler.backend.runner._copy_plans.values()
             if isinstance(p, VerifiedBucketCopy)]
    assert len(plans) == 1 and plans[0].plan.kernel_ok(flats, copy=True)
    assert apply_update(sampler, staged(flats)) == 1
    assert sampler.weight_checksum() == manifest.checksum
    params = dict(sampler.backend.runner.model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in new)


def test_trainer_digest_launched_by_step_is_the_checksum():
    """A ZeRO-2 bf16 trainer on CUDA: ``step()`` launches the weight digest on a side stream;
    the next manifest takes it, and it equals ``weight_checksum()`` computed afresh, after
    every step; an offload drops it (the manifest then computes the checksum itself)."""
    from polynya.config import TrainConfig
    from polynya.engines import TrainingEngine
    from polynya.sync import build_manifest

    engine = TrainingEngine(TrainConfig("tiny:qwen3", dtype="bfloat16", zero_stage=2, lr=1e-2,
                                        device="cuda"))
    batch = one_group(engine.module.config.vocab_size)
    assert engine.ready_checksum() is None
    seen = []
    for v in range(2):
        engine.forward_backward(batch)
        engine.step()
        ready = engine.ready_checksum()
        assert ready is not None and ready == engine.weight_checksum()
        assert build_manifest(engine, version=v + 1, bucket_bytes=1 << 20,
                              layout="spans").checksum == ready
        seen.append(ready)
    assert seen[0] != seen[1]
    engine.offload()
    engine.onload()
    assert engine.ready_checksum() is None
    assert build_manifest(engine, version=3, bucket_bytes=1 << 20,
                          layout="packed").checksum == seen[1]
    # weights moved behind the engine's back after a step (new values, new storage): the
    # manifest sees the move and computes the checksum of what it will share, not the digest
    # launched before; first into one new flat storage (same layout), then one storage each
    params = list(engine.module.parameters())
    for move in ("flat", "apart"):
        engine.forward_backward(batch)
        engine.step()
        assert engine.ready_checksum() is not None
        with torch.no_grad():
            if move == "flat":  # each flat storage to a new one, same offsets
                new = {}
                for p in params:
                    st = p.untyped_storage()
                    if st.data_ptr() not in new:
                        new[st.data_ptr()] = torch.zeros(st.nbytes() // p.element_size(),
                                                         dtype=p.dtype, device=p.device)
                    o, n = p.storage_offset(), p.numel()
                    dst = new[st.data_ptr()][o:o + n]
                    dst.copy_(p.reshape(-1) * 1.5)
                    p.data = dst.view(p.shape)
            else:
                for p in params:
                    p.data = p.data * 1.5
        m = build_manifest(engine, version=4, bucket_bytes=1 << 20, layout="spans")
        assert m.checksum == engine.weight_checksum() != seen[1], move
        assert (m.buckets[0].offsets is not None) == (move == "flat")


def test_logprob_engine_takes_a_sync_through_the_fused_kernel():
    """A ZeRO-2 bf16 trainer's span buckets into a ZeRO-0 bf16 log-prob engine on CUDA: the
    verified plan's compiled check + copy kernels run (not the tensor-by-tensor path), the
    engine's weights and log-probs equal the trainer's, and a one-bit corruption or a NaN is
    refused with the weights and the version unchanged."""
    from polynya.config import TrainConfig
    from polynya.config.logprob import LogProbConfig
    from polynya.engines import TrainingEngine
    from polynya.engines.logprob import LogProbEngine
    from polynya.sync import StagedUpdate, SyncError, apply_update, build_manifest
    from polynya.sync.manifest import flat_spans
    from polynya.verified_copy import VerifiedBucketCopy

    trainer = TrainingEngine(TrainConfig("tiny:qwen3", dtype="bfloat16", zero_stage=2, lr=1e-2,
                                         device="cuda"))
    engine = LogProbEngine(LogProbConfig("tiny:qwen3", dtype="bfloat16", zero_stage=0,
                                         device="cuda"))
    batch = one_group(trainer.module.config.vocab_size)

    def staged(version, corrupt=None):
        m = build_manifest(trainer, version=version, bucket_bytes=1 << 20, layout="spans")
        out = StagedUpdate(m)
        for i, (span, _) in enumerate(flat_spans(trainer.module)):
            out.put(i, span if corrupt is None else corrupt(span.clone()))
        return out

    for v in (1, 2):
        trainer.forward_backward(batch)
        trainer.step()
        assert apply_update(engine, staged(v)) == v
        assert engine.weight_checksum() == trainer.weight_checksum()
    (plan,) = engine._copy_plans.values()
    assert isinstance(plan, VerifiedBucketCopy) and plan.fits
    assert plan.plan.kernel_ok(staged(3).flats, copy=True)
    general = LogProbEngine(LogProbConfig("tiny:qwen3", dtype="bfloat16", zero_stage=0,
                                          device="cuda"))
    general.load_weights([(n, p.detach()) for n, p in trainer.module.named_parameters()])
    assert not general._copy_plans  # (name, tensor) pairs: the tensor-by-tensor path
    torch.testing.assert_close(engine.compute_logprobs(batch).logprobs,
                               general.compute_logprobs(batch).logprobs, rtol=0, atol=0)
    del general

    def flip(span):
        span.view(torch.int16)[5] ^= 1
        return span

    def nan(span):
        span[9] = float("nan")
        return span

    trainer.forward_backward(batch)
    trainer.step()
    before = engine.weight_checksum()
    for bad, needle in ((flip, "checksum mismatch"), (nan, "NaN or inf")):
        with pytest.raises(SyncError, match=needle):
            apply_update(engine, staged(3, bad))
        assert engine.weight_checksum() == before and engine.weight_version == 2
    assert apply_update(engine, staged(3)) == 3
    assert engine.weight_checksum() == trainer.weight_checksum()
