"""The trainer-side span layout cache (``polynya.spans``) is never served stale.

``span_layout`` validates its cached layout with a walk of the module tree and a pointer /
shape / stride / dtype key instead of ``named_parameters()``; each test changes the weights
one way (values, storage, parameter objects, names, the tree, dtypes) and checks that the
manifest's checksum and names equal those computed from scratch, so no change can leave a
checksum that describes other bytes than the module's."""

import gc

import pytest
import torch
from polynya import RolloutBatch
from polynya.checksum import checksum_named_tensors
from polynya.config import SamplerConfig, TrainConfig
from polynya.engines import SamplingEngine, TrainingEngine
from polynya.spans import SpanLayout, cached_layout, span_layout
from polynya.sync import SharedExport, apply_update, build_manifest, open_shared

from .test_layout import BB, FlatTrainer


def manifest_is_fresh(t: FlatTrainer, version: int):
    """Build a spans manifest and check it against a from-scratch reference."""
    m = build_manifest(t, version=version, bucket_bytes=BB, layout="spans")
    named = list(t.module.named_parameters())
    assert m.checksum == checksum_named_tensors(named)
    assert sorted(n for b in m.buckets for n in b.names) == sorted(n for n, _ in named)
    fresh = SpanLayout.build(named)
    if m.buckets[0].offsets is not None:
        assert fresh is not None and m.buckets == fresh.specs
    return m


def test_values_and_moves_as_a_whole_keep_the_layout():
    t = FlatTrainer(dtype=torch.bfloat16)
    m1 = manifest_is_fresh(t, 1)
    layout = span_layout(t.module)[0]
    t.perturb()
    m2 = manifest_is_fresh(t, 2)
    assert span_layout(t.module)[0] is layout and m2.checksum != m1.checksum
    seen = layout.seen
    t.rehome()  # offload / onload: new storage, same offsets -> same layout object
    m3 = manifest_is_fresh(t, 3)
    assert span_layout(t.module)[0] is layout and m3.checksum == m2.checksum
    # what TrainingEngine.ready_checksum looks at: the move is seen, a digest launched
    # before it is not taken as current
    assert cached_layout(t.module) is layout and layout.seen is not seen
    assert layout.recheck(seen) is None and layout.recheck() is not None
    seen = layout.seen
    span_layout(t.module)
    assert layout.seen is seen  # nothing moved: the same key object
    t.rehome(gap=5)  # other offsets: another layout
    manifest_is_fresh(t, 4)
    assert span_layout(t.module)[0] is not layout and cached_layout(t.module) is not layout
    with torch.no_grad():  # one storage each: not spans any more
        for p in t.module.parameters():
            p.data = p.data.clone()
    assert span_layout(t.module) is None and cached_layout(t.module) is None


@pytest.mark.parametrize("change", ["replace_other_storage", "replace_same_place", "swap_data",
                                    "rename", "new_parameter", "delete_parameter",
                                    "dtype_view", "strides"])
def test_every_change_is_seen(change):
    t = FlatTrainer(dtype=torch.bfloat16, seed=int(torch.randint(100, (1,))))
    before = manifest_is_fresh(t, 1).checksum
    mlp = t.module.model.layers[0].mlp
    attn = t.module.model.layers[1].self_attn
    with torch.no_grad():
        if change == "replace_other_storage":  # a new Parameter in its own storage
            mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight * 2)
        elif change == "replace_same_place":  # a new object, same bytes: checksum unchanged
            mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight.detach())
        elif change == "swap_data":  # two same-shape weights trade storage places
            a, b = attn.q_norm.weight, attn.k_norm.weight
            a.data, b.data = b.data, a.data
        elif change == "rename":  # the same object under another name
            w = attn.q_norm._parameters.pop("weight")
            attn.q_norm._parameters["weight2"] = w
        elif change == "new_parameter":
            attn.q_norm.register_parameter("extra", torch.nn.Parameter(
                torch.randn(8, dtype=torch.bfloat16)))
        elif change == "delete_parameter":
            del attn.q_norm._parameters["weight"]
        elif change == "dtype_view":  # same bytes, same place, read as float16
            p = attn.k_norm.weight
            p.data = p.data.view(torch.float16)
        elif change == "strides":  # same place and shape, transposed strides
            p = mlp.down_proj.weight
            p.data = p.data.as_strided((p.shape[0], p.shape[1]), (1, p.shape[0]))
    if change == "dtype_view":  # the layout sees two dtypes now; a sync refuses them
        assert span_layout(t.module) is None  # one storage, two dtypes: not spans
        with pytest.raises(ValueError, match="one dtype"):
            build_manifest(t, version=2, bucket_bytes=BB, layout="spans")
        return
    after = manifest_is_fresh(t, 2)  # equals the reference whatever the change
    if change == "replace_same_place":
        assert after.checksum == before
    else:
        assert after.checksum != before


def test_zero2_offload_onload_then_sync_verifies():
    """A real ZeRO-2 engine: after an update and an offload / onload the cached layout still
    gives a checksum the sampler verifies, and the sampler ends with the trainer's bytes."""
    t = TrainingEngine(TrainConfig("tiny:qwen3", dtype="bfloat16", zero_stage=2, lr=5e-2, seed=1))
    sampler = SamplingEngine(SamplerConfig("tiny:qwen3", dtype="bfloat16", device="cpu",
                                           num_blocks=32, block_size=8))
    batch = RolloutBatch([[5, 6, 7]] * 2, [[8, 9, 10], [11]], advantages=torch.tensor([1.0, -1.0]))

    def sync(version):
        m = build_manifest(t, version=version, bucket_bytes=BB, layout="spans")
        assert m.buckets[0].offsets is not None
        assert m.checksum == checksum_named_tensors(t.module.named_parameters())
        export = SharedExport.from_trainer(t, m, BB)
        try:
            opened = open_shared(m, export.handles)
            assert apply_update(sampler, opened.staged) == version
            opened.close()
        finally:
            export.release()
        mine = dict(t.module.named_parameters())
        theirs = dict(sampler.backend.runner.model.named_parameters())
        assert all(torch.equal(p, theirs[n]) for n, p in mine.items())
        return m.checksum

    first = sync(1)
    t.forward_backward(batch)
    t.step()
    t.offload()
    t.onload()
    gc.collect()
    second = sync(2)
    assert second != first
    t.offload()
    t.onload()
    assert sync(3) == second
