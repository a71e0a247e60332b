"""DecodeGraphs' bucketing and static-buffer filling, checked on CPU with capture stubbed out
(the real capture/replay runs in test_native_engine_gpu.py)."""
from __future__ import annotations

import numpy as np
import pytest
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


def test_a_step_stages_only_its_columns_and_narrower_steps_clear_the_rest(monkeypatch):
    """Only the columns the step's rows use travel to the device; after a wide step, a narrow
    one leaves every row zero past its columns, as a full-width fill would (the planner and
    the paged kernels never read past a row's length, but the buffer stays exact anyway)."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    seen = []

    def forward(ids, pos, slots, tables, lens, fca):
        seen.append(tables.clone())
        return torch.zeros(ids.shape[1], 3)

    g = _CPUGraphs(forward, max_batch=8, width=64, block_size=4, scratch_block=9,
                   device=torch.device("cpu"))
    wide = np.arange(1, 4 * 40 + 1, dtype=np.int32).reshape(4, 40)
    g.run(np.arange(4), np.full(4, 150), np.arange(4) + 100, wide, np.full(4, 151), fca=False)
    assert g.staged_bytes == 4 * (4 + 40) * 8  # not 4 x (4 + 64) x 8
    assert seen[-1][:, :40].tolist() == wide.tolist() and not seen[-1][:, 40:].any()
    narrow = np.array([[5, 6], [7, 0]], dtype=np.int32)
    g.run(np.arange(2), np.array([6, 2]), np.array([22, 29]), narrow, np.array([7, 3]), fca=False)
    assert g.staged_bytes == 2 * (4 + 2) * 8
    assert seen[-1].tolist() == [[5, 6] + [0] * 62, [7] + [0] * 63]
    assert not g.tables[:, 2:].any()  # every row, the wide step's other rows included
    g.run(np.arange(3), np.full(3, 10), np.arange(3) + 40, wide[:3, :12], np.full(3, 11), fca=False)
    assert seen[-1][:3, :12].tolist() == wide[:3, :12].tolist()
    assert seen[-1][3].tolist() == [9] + [0] * 63 and not seen[-1][:, 12:].any()
    with pytest.raises(ValueError, match="65 columns for graphs 64 wide"):
        g.run(np.arange(1), np.zeros(1), np.zeros(1), np.zeros((1, 65), np.int32), np.ones(1),
              fca=False)


class _UncapturableGraphs(_CPUGraphs):
    """A model whose decode step does host work (e.g. a MoE layer): capture fails."""

    def _capture(self, b, fca):
        raise cuda_graph.GraphCaptureError("Cannot copy between CPU and CUDA tensors during capture")


def test_uncapturable_model_decodes_eagerly_with_the_same_tokens(monkeypatch):
    """A capture failure falls back to the eager decode step (same tokens) and says why (the
    real failure, qwen3-moe's grouped_mm on the H200, is in test_model_families_gpu.py)."""
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
