"""Weight sync: shared-memory and broadcast transports move exactly the trainer's parameters to
two sampler replicas; corrupted, truncated, partial and stale syncs are rejected and the
sampler keeps serving its previous weights."""

import threading

import pytest
import torch

from polynya import RolloutBatch, SamplingParams
from polynya.config import SamplerConfig, TrainConfig
from polynya.config.train import OptimConfig
from polynya.distributed import free_port
from polynya.engines import SamplingEngine, TrainingEngine
from polynya.sync import (
    SharedExport,
    StagedUpdate,
    SyncError,
    SyncGroup,
    SyncManifest,
    apply_update,
    build_manifest,
    open_shared,
    recv_weights,
    send_weights,
)
from polynya.sync.shared import BucketHandle

MODEL = "tiny:qwen3"
BUCKET = 1 << 15  # several buckets for the tiny model


@pytest.fixture(scope="module")
def trainer():
    t = TrainingEngine(
        TrainConfig(MODEL, dtype="float32", zero_stage=0, lr=5e-2, optim=OptimConfig(grad_clip=0.0))
    )
    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch(
        [[5, 6, 7, 8]] * 2 + [[9, 10, 11]] * 2,
        [torch.randint(2, 500, (5,), generator=g).tolist() for _ in range(4)],
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
    )
    t.forward_backward(batch)
    t.step()  # weights now differ from the samplers' initial (same-seed) weights
    return t


def make_sampler() -> SamplingEngine:
    return SamplingEngine(
        SamplerConfig(MODEL, dtype="float32", device="cpu", num_blocks=32, block_size=8)
    )


def assert_exact_copy(trainer, sampler) -> None:
    theirs = dict(sampler.backend.runner.model.named_parameters())
    mine = dict(trainer.module.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, p in mine.items():
        assert torch.equal(p.detach(), theirs[name].detach()), name
    assert sampler.weight_checksum() == trainer.weight_checksum()


def greedy(sampler) -> list[int]:
    return sampler.generate([[17, 3, 99, 250]], SamplingParams(temperature=0, max_tokens=6))[0][
        0
    ].token_ids


def test_manifest_matches_export(trainer):
    m = build_manifest(trainer, version=1, bucket_bytes=BUCKET)
    pieces = list(trainer.export_weights(BUCKET))
    assert len(m.buckets) == len(pieces) > 2
    for spec, (names, flat) in zip(m.buckets, pieces):
        assert spec.names == tuple(names) and spec.numel == flat.numel()
    assert SyncManifest.from_dict(m.to_dict()) == m
    assert m.num_tensors == len(list(trainer.module.named_parameters()))
    with pytest.raises(ValueError, match="manifest"):
        SyncManifest.from_dict({"version": 1, "buckets": []})


def test_shared_memory_sync_two_replicas(trainer):
    samplers = [make_sampler(), make_sampler()]
    m = build_manifest(trainer, version=1, bucket_bytes=BUCKET)
    export = SharedExport.from_trainer(trainer, m, BUCKET)
    assert len(export.handles) == len(m.buckets) and all(h.kind == "shm" for h in export.handles)
    try:
        for s in samplers:
            opened = open_shared(m, export.handles)
            assert apply_update(s, opened.staged) == 1
            opened.close()
    finally:
        export.release()
    for s in samplers:
        assert_exact_copy(trainer, s)
        assert s.stats()["weight_version"] == 1
    with pytest.raises(SyncError, match="vanished"):
        open_shared(m, [BucketHandle("shm", "polynya-missing-segment", 1, m.dtype)])


def test_broadcast_sync_two_replicas(trainer):
    samplers = [make_sampler(), make_sampler()]
    m = build_manifest(trainer, version=3, bucket_bytes=BUCKET)
    port, results, errors = free_port(), {}, []

    def member(rank):
        try:
            group = SyncGroup(
                "127.0.0.1", port, rank=rank, world_size=3, device="cpu", timeout_s=60
            )
            if rank == 0:
                results[0] = send_weights(group, trainer, m, BUCKET)
            else:
                results[rank] = apply_update(samplers[rank - 1], recv_weights(group, m, "cpu"))
            group.close()
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not errors, errors
    assert results == {0: m.nbytes, 1: 3, 2: 3}
    for s in samplers:
        assert_exact_copy(trainer, s)


def test_corrupted_in_transit_is_rejected(trainer):
    sampler = make_sampler()
    before, tokens = sampler.weight_checksum(), greedy(sampler)
    m = build_manifest(trainer, version=1, bucket_bytes=BUCKET)
    port, errors, staged = free_port(), [], {}

    def flip(i, flat):
        if i == 1:
            flat = flat.clone()
            flat[3] += 1e-3
        return flat

    def member(rank):
        try:
            group = SyncGroup(
                "127.0.0.1", port, rank=rank, world_size=2, device="cpu", timeout_s=60
            )
            if rank == 0:
                send_weights(group, trainer, m, BUCKET, corrupt=flip)
            else:
                staged["u"] = recv_weights(group, m, "cpu")
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not errors, errors
    with pytest.raises(SyncError, match="checksum mismatch"):
        apply_update(sampler, staged["u"])
    assert sampler.weight_checksum() == before and sampler.stats()["weight_version"] == 0
    assert greedy(sampler) == tokens  # still serving the old weights


def test_bad_syncs_keep_old_version(trainer):
    sampler = make_sampler()
    good = build_manifest(trainer, version=1, bucket_bytes=BUCKET)
    pieces = [flat.clone() for _, flat in trainer.export_weights(BUCKET)]
    staged = StagedUpdate(good)
    for i, flat in enumerate(pieces):
        staged.put(i, flat)
    apply_update(sampler, staged)
    v1_sum, v1_tokens = sampler.weight_checksum(), greedy(sampler)

    m2 = SyncManifest(2, good.dtype, good.checksum, good.buckets)
    with pytest.raises(SyncError, match="truncated"):
        StagedUpdate(m2).put(0, pieces[0][:-1])
    with pytest.raises(SyncError, match="dtype"):
        StagedUpdate(m2).put(0, pieces[0].double())
    partial = StagedUpdate(m2)
    partial.put(0, pieces[0])
    with pytest.raises(SyncError, match="partial"):
        apply_update(sampler, partial)
    corrupted = StagedUpdate(m2)
    for i, flat in enumerate(pieces):
        corrupted.put(i, flat.clone())
    corrupted.flats[-1][0] = corrupted.flats[-1][0] * 2 + 1  # one corrupted element
    with pytest.raises(SyncError, match="checksum"):
        apply_update(sampler, corrupted)
    big = max(range(len(pieces)), key=lambda i: pieces[i].numel())
    assert pieces[big].numel() > 8192
    def swap(f):
        f[[0, 8191]] = f[[8191, 0]].clone()

    for name, damage in (("swap 8191 apart", swap),
                         ("+k/-k pair", lambda f: (f[5].add_(0.25), f[5 + 8191].sub_(0.25))),
                         ("NaN", lambda f: f[7].fill_(float("nan")))):
        bad = StagedUpdate(m2)
        for i, flat in enumerate(pieces):
            bad.put(i, flat.clone())
        if torch.equal(bad.flats[big][0], bad.flats[big][8191]) and name.startswith("swap"):
            continue
        damage(bad.flats[big])
        with pytest.raises(SyncError, match="checksum|NaN"):
            apply_update(sampler, bad)
        assert sampler.weight_checksum() == v1_sum and sampler.weight_version == 1, name
    wrong = SyncManifest(2, good.dtype, "0" * 32, good.buckets)  # mismatched trainer checksum
    mismatched = StagedUpdate(wrong)
    for i, flat in enumerate(pieces):
        mismatched.put(i, flat)
    with pytest.raises(SyncError, match="checksum"):
        apply_update(sampler, mismatched)
    with pytest.raises(SyncError, match="stale"):
        apply_update(sampler, staged)  # version 1 again
    # a truncated shared-memory bucket is caught when it is mapped
    export = SharedExport.from_trainer(trainer, m2, BUCKET)
    try:
        short = [BucketHandle(h.kind, h.payload, h.numel - 1, h.dtype) for h in export.handles]
        with pytest.raises(SyncError, match="truncated"):
            open_shared(m2, short)
    finally:
        export.release()
    assert sampler.weight_checksum() == v1_sum and sampler.stats()["weight_version"] == 1
    assert greedy(sampler) == v1_tokens


def test_span_layout_shares_trainer_storage():
    """ZeRO-2 bf16 keeps the weights as views of one flat buffer: the manifest describes that
    buffer as it is, the shared-memory export copies it once, the sampler gets an exact copy."""
    t = TrainingEngine(TrainConfig(MODEL, dtype="bfloat16", zero_stage=2, lr=5e-2, seed=1))
    t.forward_backward(
        RolloutBatch([[5, 6, 7]] * 2, [[8, 9, 10], [11]], advantages=torch.tensor([1.0, -1.0]))
    )
    t.step()
    m = build_manifest(t, version=1, bucket_bytes=BUCKET, layout="spans")
    assert len(m.buckets) == 1 and m.buckets[0].offsets is not None  # one flat storage, not packed
    assert m.checksum == t.weight_checksum()
    assert SyncManifest.from_dict(m.to_dict()) == m
    sampler = SamplingEngine(
        SamplerConfig(MODEL, dtype="bfloat16", device="cpu", num_blocks=32, block_size=8)
    )
    export = SharedExport.from_trainer(t, m, BUCKET)
    try:
        opened = open_shared(m, export.handles)
        assert apply_update(sampler, opened.staged) == 1
        opened.close()
    finally:
        export.release()
    assert_exact_copy(t, sampler)
    packed = build_manifest(t, version=2, bucket_bytes=BUCKET)  # the same checksum either way
    assert packed.checksum == m.checksum and len(packed.buckets) > 1
