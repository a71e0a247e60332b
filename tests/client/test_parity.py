"""The HTTP client gives what the local client gives for the same calls on the same tiny model:
samples (token ids, log-probs bit for bit, finish reasons), ``TokenStats`` (dtype, shape, mask,
entropy bit for bit), every metric (inf kept), versions and checksums after sync and load, the
async twins, and the same exception type and message (a server's after "<route>: HTTP <status>: ")
for a refused call, which changes nothing on either side."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

import polynya
from polynya import RolloutBatch, SamplingParams
from polynya.files import CheckpointError

from .common import PROMPTS, tiny_config

P = SamplingParams


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    run = tmp_path_factory.mktemp("parity")
    with polynya.create_rl_client(tiny_config("local")) as local, \
            polynya.create_rl_client(tiny_config("http", run_dir=str(run))) as http:
        yield local, http, run


def _bits(t: torch.Tensor | None):
    return None if t is None else (t.dtype, tuple(t.shape), t.view(torch.int32).tolist())


def _stats(s) -> tuple:
    return _bits(s.logprobs), _bits(s.entropy), s.mask.dtype, s.mask.tolist(), s.layout


def _metrics(m: dict) -> dict:
    return {k: repr(v) for k, v in m.items() if k != "time_s"}  # repr: nan == nan, -0.0 kept


def _same(local, http, call):
    got = [call(c) for c in (local, http)]
    assert got[0] == got[1]
    return got[0]


GENERATE = [
    ("n3_seeded", lambda: (PROMPTS, P(n=3, seed=5, max_tokens=5, logprobs=True))),
    ("per_prompt", lambda: (PROMPTS, [P(seed=1, max_tokens=3, logprobs=True),
                                      P(temperature=0, max_tokens=4, stop_token_ids=[]),
                                      P(n=2, seed=9, max_tokens=2, top_k=5, logprobs=True)])),
    ("empty", lambda: ([], P())),
    ("empty_list", lambda: ([], [])),
]


@pytest.mark.parametrize("case", [c for _, c in GENERATE], ids=[n for n, _ in GENERATE])
def test_generate_matches_local(pair, case):
    local, http, _ = pair
    prompts, params = case()
    out = _same(local, http, lambda c: c.generate(prompts, params))
    assert out == _same(local, http, lambda c: asyncio.run(c.generate_async(prompts, params)))


def test_training_state_matches_local(pair):
    local, http, run = pair
    batch = RolloutBatch(PROMPTS, [[1, 2, 3], [4], []], group_ids=[0, 1, 0],
                         advantages=torch.tensor([1.0, -1.0, 0.5]))
    for kw in ({}, {"entropy": True}, {"temperature": 0.7, "entropy": True}):
        st = _same(local, http, lambda c: _stats(c.compute_logprobs(batch, **kw)))
        assert st == _same(local, http, lambda c: _stats(asyncio.run(c.compute_logprobs_async(batch, **kw))))
    assert st[0][0] == torch.float32 and st[2] == torch.bool
    batch.old_logprobs = local.compute_logprobs(batch).logprobs
    _same(local, http, lambda c: _metrics(c.forward_backward(batch)))
    _same(local, http, lambda c: _metrics(c.step()))
    info = _same(local, http, lambda c: {k: v for k, v in c.sync_weights().items()
                                         if k not in ("seconds", "manifest_s")})
    sums = _same(local, http, lambda c: c.weight_checksums())
    assert info["version"] == sums["version"] == 1 and sums["samplers"] == [sums["trainer"]]
    _same(local, http, lambda c: c.save(str(run / f"ck_{type(c).__name__}")))
    _same(local, http, lambda c: _metrics(c.forward_backward(batch)))
    _same(local, http, lambda c: _metrics(asyncio.run(c.step_async())))
    _same(local, http, lambda c: c.load(str(run / f"ck_{type(c).__name__}")))
    assert _same(local, http, lambda c: c.weight_checksums())["trainer"] == sums["trainer"]
    skipped = RolloutBatch([[5, 6, 7]] * 2, [[8, 9], [10]], advantages=torch.tensor([3e38, -3e38]))
    _same(local, http, lambda c: _metrics(c.forward_backward(skipped)))
    assert _same(local, http, lambda c: _metrics(c.step()))["grad_norm"] == "inf"


def _truncated(c, run):
    """A checkpoint whose weights file is cut short (the engine's manifest check refuses it)."""
    src, dst = run / f"ck_{type(c).__name__}", run / f"cut_{type(c).__name__}"
    if not dst.exists():
        c.save(str(src))
        shutil.copytree(src, dst)
        states = dst / "polynya" / "mp_rank_00_model_states.pt"
        states.write_bytes(states.read_bytes()[:100])
    c.load(str(dst))


ERRORS = [  # (id, call, the local client's exception type)
    ("params_not_samplingparams", lambda c, run: c.generate(PROMPTS, [{"max_tokens": 2}] * 3),
     ValueError),
    ("params_dict", lambda c, run: c.generate(PROMPTS, {"max_tokens": 2}), ValueError),
    ("params_count", lambda c, run: c.generate(PROMPTS, [P()]), ValueError),
    ("params_for_no_prompt", lambda c, run: c.generate([], [P()]), ValueError),
    ("empty_prompt", lambda c, run: c.generate([[5], []], P()), ValueError),
    ("token_past_vocab", lambda c, run: c.generate([[10**9]], P(max_tokens=2)), ValueError),
    ("logprobs_temperature_0", lambda c, run: c.compute_logprobs(
        RolloutBatch([[5]], [[6]]), temperature=0.0), ValueError),
    ("no_reference", lambda c, run: c.compute_logprobs(
        RolloutBatch([[5]], [[6]]), model="reference"), ValueError),
    ("sleep_level", lambda c, run: c.sleep("sampler", 7), ValueError),
    ("step_without_gradient", lambda c, run: c.step(), RuntimeError),
    ("truncated_checkpoint", _truncated, CheckpointError),
]


@pytest.mark.parametrize("call, kind", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors_match_local_and_change_nothing(pair, call, kind):
    local, http, run = pair
    errors = []
    for c in (local, http):
        before = c.weight_checksums()
        with pytest.raises(Exception) as info:
            call(c, run)
        errors.append(info.value)
        assert c.weight_checksums() == before
    assert type(errors[0]) is kind and type(errors[1]) is kind, errors
    http_msg, local_msg = str(errors[1]).replace("HTTPClient", "LocalClient"), str(errors[0])
    assert http_msg == local_msg or http_msg.endswith(": " + local_msg), errors
