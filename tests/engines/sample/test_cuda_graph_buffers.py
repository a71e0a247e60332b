"""DecodeGraphs' bucketing and static-buffer filling, checked on CPU with capture stubbed out
(the real capture/replay runs in test_native_engine_gpu.py)."""
from __future__ import annotations

import numpy as np
import torch
from polynya.engines.sample.native import cuda_graph
from polynya.engines.sample.native.cuda_graph import DecodeGraphs, buckets


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert buckets(128)[-3:] == [96, 112, 128]


class _CPUGraphs(DecodeGraphs):
    """Replays by calling ``forward`` on the static buffers, as a captured graph would."""

    def _capture(self, b, fca):
        graphs = self

        class Replay:
            def replay(self):
                graphs.last = graphs.forward(graphs.ids[:, :b], graphs.pos[:, :b], graphs.slots[:b],
                                             graphs.tables[:b], graphs.lens[:b], fca)

        return Replay(), torch.zeros(b, 3)


def test_buffers_hold_the_batch_and_padding_rows(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    seen = []

    def forward(ids, pos, slots, tables, lens, fca):
        seen.append((ids.clone(), pos.clone(), slots.clone(), tables.clone(), lens.clone(), fca))
        return torch.zeros(ids.shape[1], 3)

    g = _CPUGraphs(forward, max_batch=16, width=5, block_size=4, scratch_block=77,
                   device=torch.device("cpu"))
    tables = np.array([[3, 4, 5], [6, 0, 0], [7, 8, 0]], dtype=np.int32)
    out = g.run(np.array([11, 12, 13]), np.array([9, 2, 5]), np.array([21, 26, 33]), tables,
                np.array([10, 3, 6]), fca=True)
    assert out.shape == (3, 3) and list(g.graphs) == [(4, True)]
    ids, pos, slots, tab, lens, fca = seen[-1]
    assert fca and ids.tolist() == [[11, 12, 13, 0]] and pos.tolist() == [[9, 2, 5, 0]]
    assert slots.tolist() == [21, 26, 33, 77 * 4]  # the padding row writes the scratch page
    assert tab.tolist() == [[3, 4, 5, 0, 0], [6, 0, 0, 0, 0], [7, 8, 0, 0, 0], [77, 0, 0, 0, 0]]
    assert lens.tolist() == [10, 3, 6, 1]
    g.run(np.array([1]), np.array([0]), np.array([4]), np.array([[1]], dtype=np.int32),
          np.array([1]), fca=False)
    assert sorted(g.graphs) == [(1, False), (4, True)]
    assert cuda_graph.DecodeGraphs.bucket(g, 17) is None


class _UncapturableGraphs(_CPUGraphs):
    """A model whose decode step does host work (e.g. a MoE layer): capture fails."""

    def _capture(self, b, fca):
        raise cuda_graph.GraphCaptureError("Cannot copy between CPU and CUDA tensors during capture")


def test_uncapturable_model_decodes_eagerly_with_the_same_tokens(monkeypatch):
    """A capture failure falls back to the eager decode step (same tokens) and says why (the
    real failure, qwen3-moe's grouped_mm on the H200, is in test_model_families_gpu.py)."""
    import pytest
    from polynya import SamplingParams
    from polynya.config import SamplerConfig
    from polynya.engines import SamplingEngine

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=6)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    want = SamplingEngine(SamplerConfig("tiny:qwen3", dtype="float32", device="cpu")).generate(prompts, params)
    engine = SamplingEngine(SamplerConfig("tiny:qwen3", dtype="float32", device="cpu"))
    runner = engine.backend.runner
    runner.graphs = _UncapturableGraphs(runner._decode_forward, 4, 8, runner.block_size,
                                        runner.num_blocks, torch.device("cpu"))
    with pytest.warns(RuntimeWarning, match="cannot be captured as a CUDA graph"):
        got = engine.generate(prompts, params)
    assert [[s.token_ids for s in g] for g in got] == [[s.token_ids for s in g] for g in want]
    assert runner.graphs is None and "during capture" in runner.graphs_error
