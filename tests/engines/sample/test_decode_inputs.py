"""The host arrays of a decode step built ahead (``DecodeInputs.advanced`` / ``select`` /
``with_pages`` / ``with_ids``) equal those built from the sequences after the step is booked,
and a sequence's random draws are its generator's stream whatever is peeked ahead."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from polynya import SamplingParams
from polynya.engines.sample.native.block_manager import BlockManager
from polynya.engines.sample.native.decode_inputs import DecodeInputs
from polynya.engines.sample.native.sequence import Sequence


def running(rng: np.random.Generator, bm: BlockManager, count: int) -> list[Sequence]:
    """Sequences of ragged lengths holding pages for all their tokens (one decode step due)."""
    seqs = []
    for i in range(count):
        n = int(rng.integers(1, 40))
        seq = Sequence(token_ids=rng.integers(0, 500, size=n).tolist(), num_prompt_tokens=n,
                       params=SamplingParams(), stop_ids=frozenset(), generator=torch.Generator(),
                       request_id=i)
        bm.allocate(seq)
        seqs.append(seq)
    return seqs


def same(a: DecodeInputs, b: DecodeInputs) -> None:
    for x, y in zip(a.astuple(), b.astuple()):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert np.array_equal(a.widths, b.widths)


@pytest.mark.parametrize("seed", range(4))
def test_inputs_built_ahead_equal_inputs_built_after(seed):
    rng = np.random.default_rng(seed)
    bm = BlockManager(400, int(rng.choice([2, 4, 16])))
    seqs = running(rng, bm, int(rng.integers(2, 20)))
    now = DecodeInputs.build(seqs, bm.block_size)
    ahead = now.advanced(bm.block_size)
    keep = np.flatnonzero(rng.random(len(seqs)) < 0.7)
    if not len(keep):
        keep = np.array([0])
    rows = [seqs[i] for i in keep]
    ahead = ahead.select(keep)
    boundary = [k for k, s in enumerate(rows) if len(s) % bm.block_size == 0]
    pages = []
    for k in boundary:  # what the scheduler does one token ahead
        assert bm.append_slot(rows[k], ahead=1) is None
        pages.append(rows[k].block_table[-1])
    assert (ahead.slots[boundary] == -1).all() and (np.delete(ahead.slots, boundary) >= 0).all()
    if boundary:
        ahead = ahead.with_pages(boundary, pages, bm.block_size)
    tokens = rng.integers(0, 500, size=len(rows))
    ahead = ahead.with_ids(tokens)
    for s, t in zip(rows, tokens):  # the step is booked: its token appended
        s.token_ids.append(int(t))
    same(ahead, DecodeInputs.build(rows, bm.block_size))


def test_uniform_stream_is_the_generators_whatever_is_peeked_ahead():
    """``uniform`` / ``advance_uniform`` with peeks one step ahead (async scheduling) give the
    same draws, in the same order, as drawing from the generator 64 at a time (the stream
    seeded samples have always used)."""
    seq = Sequence(token_ids=[1], num_prompt_tokens=1, params=SamplingParams(), stop_ids=frozenset(),
                   generator=torch.Generator().manual_seed(1234), request_id=0)
    g, ref = torch.Generator().manual_seed(1234), []
    for _ in range(4):  # the engine's draws before async scheduling: 64 at a time, in order
        ref += torch.rand(64, generator=g, dtype=torch.float64).tolist()
    rng = np.random.default_rng(0)
    got = []
    for i in range(200):
        if rng.random() < 0.5:
            assert seq.uniform(ahead=1) == ref[i + 1]  # the next step's draw, peeked
        assert seq.uniform() == ref[i] == seq.uniform()  # stays current until advanced
        got.append(seq.uniform())
        seq.advance_uniform()
    assert got == ref[:200]
