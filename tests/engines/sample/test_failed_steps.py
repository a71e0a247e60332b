"""A step that fails (a device error, an interrupt) in the native sampling engine (tiny:qwen3,
fp32, CPU).

A fault is simulated as a device would have it: every KV slot the step writes (and every page it
copies into) holds garbage, and the error is raised at the forward, at the page copy, or when the
step's tokens are read back (where an asynchronous device error surfaces). After it the engine
must hold no page keyed over KV it never computed, no sequence whose KV is not what its tokens
say, and count nothing of the failed step; the requests still running — every other caller's —
end with the tokens of a run without the fault (HF greedy, or the same seeded request alone).
"""
from __future__ import annotations

import pytest
import torch
from polynya import SamplingParams
from polynya.engines.sample.native.decode_inputs import DecodeInputs
from polynya.models import load_model

from .test_native_engine import make_engine, ragged_prompts

COUNTERS = ("prefill_tokens", "decode_tokens", "cache_hit_tokens", "cache_hit_blocks", "prefill_steps",
            "decode_steps", "fca_steps", "peak_decode_rows", "ahead_steps", "early_steps")


@pytest.fixture(scope="module")
def hf_qwen():
    return load_model("tiny:qwen3", dtype="float32")


def greedy(model, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


class DeviceFault:
    """The first step that ``when(is_prefill, seqs, inputs)`` picks fails: the KV slots it writes
    get random values, and ``RuntimeError("device fault")`` is raised ``at`` ``"forward"`` (no
    logits), ``"readback"`` (its tokens never come back; the pages it copied into are garbage
    too) or ``"copy"`` (the first copy-on-write page copy fails, its destination pages
    garbage). ``hit``, ``lens``, ``early``: that step's sequences, their lengths with the token
    it writes, whether it was launched early."""

    def __init__(self, eng, monkeypatch, at: str, when) -> None:
        self.eng, self.at, self.when = eng, at, when
        self.armed, self.hit, self.lens, self.early = True, None, None, False
        self._tag, self._target, self._copies = False, None, []
        self._run, self._copy = eng.runner.run, eng.runner.copy_blocks
        self._start, self._result = eng._readback.start, eng._readback.result
        monkeypatch.setattr(eng.runner, "run", self.run)
        monkeypatch.setattr(eng.runner, "copy_blocks", self.copy_blocks)
        monkeypatch.setattr(eng._readback, "start", self.start)
        monkeypatch.setattr(eng._readback, "result", self.result)

    def _garble(self, slots) -> None:
        kv = self.eng.runner.kv
        flat = kv.view(kv.shape[0], 2, -1, *kv.shape[-2:])
        idx = torch.as_tensor(slots, dtype=torch.long)
        flat[:, :, idx] = torch.randn(flat[:, :, idx].shape, dtype=kv.dtype)

    def _pages(self, copies):  # every slot of the pages copied into
        bs = self.eng.block_manager.block_size
        return [d * bs + i for _, d in copies for i in range(bs)]

    def _slots(self, seqs, is_prefill, inputs):
        if is_prefill:
            runner = self.eng.runner
            return [int(x) for s in seqs for x in runner._slots(s, s.num_cached_tokens, len(s))]
        return inputs.slots.tolist()

    def run(self, seqs, is_prefill, inputs=None, device_ids=None):
        copies, self._copies = self._copies, []  # made for this step, just before it
        if not is_prefill and inputs is None:
            inputs = DecodeInputs.build(seqs, self.eng.block_manager.block_size)
        if not (self.armed and self.at != "copy" and self.when(is_prefill, seqs, inputs)):
            return self._run(seqs, is_prefill, inputs, device_ids)
        self.armed, self.hit = False, list(seqs)
        self.lens = None if is_prefill else inputs.lens.copy()
        self.early = device_ids is not None  # launched before the step before was read back
        if self.at == "forward":
            self._garble(self._slots(seqs, is_prefill, inputs))
            raise RuntimeError("device fault")
        out = self._run(seqs, is_prefill, inputs, device_ids)
        self._garble(self._slots(seqs, is_prefill, inputs) + self._pages(copies))
        self._tag = True  # the read-back its sampling starts next never comes back
        return out

    def copy_blocks(self, copies):
        if not (self.armed and self.at == "copy"):
            self._copies = list(copies)
            return self._copy(copies)
        self.armed = False
        self._garble(self._pages(copies))
        raise RuntimeError("device fault")

    def start(self, tokens, logprobs):
        self._start(tokens, logprobs)
        if self._tag:
            self._tag, self._target = False, self.eng._readback._pending[-1]

    def result(self):
        pending = self.eng._readback._pending
        if self._target is not None and pending and pending[0] is self._target:
            self._target = None
            pending.popleft()
            raise RuntimeError("device fault")
        return self._result()


def assert_consistent(eng) -> None:
    """Nothing pending or provisional; pages held exactly by the running sequences; waiting ones
    hold none; every prefix-cache entry points at its own page."""
    bm, sch = eng.block_manager, eng.scheduler
    assert not sch.pending and not bm.provisional and eng._inflight is None
    holders = [0] * bm.num_blocks
    for s in sch.running:
        for b in s.block_table:
            holders[b] += 1
    assert bm.ref_count == holders
    assert bm.num_used == sum(h > 0 for h in holders)
    assert all(not s.block_table and s.num_cached_tokens == 0 for s in sch.waiting)
    assert all(bm.key[b][0] == h for h, b in bm.hash_to_block.items())


def queue(eng, prompts, params) -> list[int]:
    toks, plist = eng.validate(prompts, params)
    return [eng.add_request(t, p) for t, p in zip(toks, plist)]


def counters(engine) -> dict:
    stats = engine.stats()
    return {k: stats[k] for k in COUNTERS}


@pytest.mark.parametrize("at", ["forward", "readback"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_failed_prefill_keys_no_page(hf_qwen, monkeypatch, async_scheduling, at):
    """The prompt's full pages were keyed when allocated; the prefill that was to compute them
    failed: the keys go (the old engine kept them: the retry took 12 tokens of garbage KV from
    the prefix cache) and the retry equals HF greedy, counted as if it were the only call."""
    engine = make_engine(async_scheduling=async_scheduling)
    eng = engine.backend
    prompt = ragged_prompts(21, [13])[0]
    p = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=())
    fault = DeviceFault(eng, monkeypatch, at, lambda is_prefill, seqs, inputs: is_prefill)
    with pytest.raises(RuntimeError, match="device fault"):
        engine.generate([prompt], p)
    assert fault.hit is not None
    assert_consistent(eng)
    assert not eng.block_manager.key and not eng.scheduler.has_work() and not eng._requests
    assert all(v == 0 for v in counters(engine).values())  # a step never read back counts nothing
    out = engine.generate([prompt], p)[0][0]
    assert out.token_ids == greedy(hf_qwen, prompt, 6)
    clean = make_engine(async_scheduling=async_scheduling)
    clean.generate([prompt], p)
    assert counters(engine) == counters(clean) and engine.stats()["cache_hit_tokens"] == 0
    assert_consistent(eng)


@pytest.mark.parametrize("at", ["forward", "readback"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_failed_prefill_sends_other_callers_back(hf_qwen, monkeypatch, async_scheduling, at):
    """Three callers' prompts in one prefill; the stepping caller's fails. The others go back
    to waiting (the old engine left them running over KV never computed): B shares A's two
    first pages, matched in that very prefill (their keys go, B's hit with them), and its n = 3
    forks (made already when the fault surfaces at read-back) merge back into it; C is greedy
    with n = 2. B equals the same request run without the fault, C equals HF greedy, and the
    counters are those of a clean run of B and C (one prefill each: the forks are made again,
    not prefilled)."""
    engine = make_engine(async_scheduling=async_scheduling)
    eng = engine.backend
    pa, extra, pc = ragged_prompts(31, [9, 5, 11])
    pb = pa[:8] + extra
    pA = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=())
    pB = SamplingParams(n=3, temperature=1.0, max_tokens=7, seed=5, logprobs=True, stop_token_ids=())
    pC = SamplingParams(n=2, temperature=0, max_tokens=6, stop_token_ids=())
    ra, rb, rc = queue(eng, [pa, pb, pc], [pA, pB, pC])
    fault = DeviceFault(eng, monkeypatch, at, lambda is_prefill, seqs, inputs: is_prefill)
    with pytest.raises(RuntimeError, match="device fault"):
        eng.wait([ra])  # caller A steps the engine
    assert len(fault.hit) == 3 and fault.hit[1].num_cached_tokens == 0  # back, hit given up
    assert_consistent(eng)
    waiting = list(eng.scheduler.waiting)
    assert [s.request_id for s in waiting] == [rb, rc] and not eng.scheduler.running
    assert [s.pending_forks for s in waiting] == [2, 1] and [len(s) for s in waiting] == [len(pb), len(pc)]
    assert not eng.block_manager.key and eng.stats()["blocks_in_use"] == 0
    assert all(v == 0 for v in counters(engine).values())

    got_b, got_c = eng.wait([rb, rc])
    alone = make_engine(async_scheduling=async_scheduling).generate([pb], pB)[0]
    assert [s.token_ids for s in got_b] == [s.token_ids for s in alone]
    for s, t in zip(got_b, alone):  # batched with C: rounding of its own
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(t.logprobs), rtol=0, atol=1e-5)
    assert len({tuple(s.token_ids) for s in got_b}) > 1  # the forks sampled on their own
    assert [s.token_ids for s in got_c] == [greedy(hf_qwen, pc, 6)] * 2
    clean = make_engine(async_scheduling=async_scheduling)
    clean.generate([pb, pc], [pB, pC])
    assert counters(engine) == counters(clean)
    assert_consistent(eng)
    assert not eng.scheduler.has_work() and not eng._requests


@pytest.mark.parametrize("at", ["copy", "forward", "readback"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_failed_decode_with_copy_on_write(hf_qwen, monkeypatch, async_scheduling, at):
    """The first decode after a prefill with forks copies the shared partial page for all but
    one fork (copy-on-write); that step fails. A fork given its copy must not decode on over a
    page never copied (the old engine kept the fresh page: garbage for the prompt's tail): it
    is recomputed; the rows without a copy run the step again. Every caller's tokens equal HF
    greedy; the stepping caller's request is gone, and no key covers garbage."""
    engine = make_engine(async_scheduling=async_scheduling)
    eng = engine.backend
    pa, pb = ragged_prompts(41, [10, 7])  # partial last pages: the forks' first decode copies
    pA = SamplingParams(n=2, temperature=0, max_tokens=9, stop_token_ids=())
    pB = SamplingParams(n=3, temperature=0, max_tokens=9, stop_token_ids=())
    ra, rb = queue(eng, [pa, pb], [pA, pB])
    with eng._lock:
        eng.step()  # the prefill, read back and booked
    assert len(eng.scheduler.running) == 5 and eng.stats()["prefill_steps"] == 1
    fault = DeviceFault(eng, monkeypatch, at, lambda is_prefill, seqs, inputs: not is_prefill)
    with pytest.raises(RuntimeError, match="device fault"):
        eng.wait([ra])
    assert at == "copy" or len(fault.hit) == 5
    assert_consistent(eng)
    assert all(s.request_id == rb for s in [*eng.scheduler.running, *eng.scheduler.waiting])
    assert len(eng.scheduler.waiting) == 2  # B's forks that had a copy: recomputed
    (got_b,) = eng.wait([rb])
    assert [s.token_ids for s in got_b] == [greedy(hf_qwen, pb, 9)] * 3
    assert_consistent(eng)
    assert eng.stats()["blocks_in_use"] == 0 and not eng._requests


def test_failed_decode_drops_the_key_it_gave_ahead(hf_qwen, monkeypatch):
    """Async scheduling keys the page a decode step fills before that step is read back (a
    waiting prompt may fit thanks to it). The step fails at read-back with its KV garbage: the
    key goes (the old engine kept it), so a later prompt continuing those tokens computes that
    page instead of reading garbage, and equals HF greedy."""
    engine = make_engine(async_scheduling=True)
    eng = engine.backend
    bs = eng.block_manager.block_size
    prompt = ragged_prompts(51, [6])[0]
    p = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=())
    fills = lambda is_prefill, seqs, inputs: not is_prefill and (inputs.lens % bs == 0).any()
    fault = DeviceFault(eng, monkeypatch, "readback", fills)
    with pytest.raises(RuntimeError, match="device fault"):
        engine.generate([prompt], p)
    (seq,), filled = fault.hit, int(fault.lens[0])
    assert filled == 8 and fault.early
    assert_consistent(eng)
    page = seq.token_ids[:filled]
    assert all(k[1] != tuple(page[-bs:]) for k in eng.block_manager.key.values())
    later = page + [7, 9]
    assert engine.generate([later], p)[0][0].token_ids == greedy(hf_qwen, later, 12)
    assert_consistent(eng)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_serves_on_after_a_failed_decode_step(hf_qwen, monkeypatch, async_scheduling):
    """A decode step of two callers fails at read-back mid-generation (launched ahead, with
    async scheduling): the other caller's rows run it again and end equal to HF greedy, and the
    counters are those of a clean run of that caller plus the steps booked before the fault."""
    engine = make_engine(async_scheduling=async_scheduling)
    eng = engine.backend
    pa, pb = ragged_prompts(61, [5, 9])
    p = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=())
    ra, rb = queue(eng, [pa, pb], p)
    fault = DeviceFault(eng, monkeypatch, "readback",
                        lambda is_prefill, seqs, inputs: not is_prefill and inputs.lens[0] == len(pa) + 4)
    with pytest.raises(RuntimeError, match="device fault"):
        eng.wait([ra])
    assert fault.hit is not None
    assert_consistent(eng)
    (b,) = eng.scheduler.running
    assert b.request_id == rb and len(b.completion) == 4 and not eng.scheduler.waiting
    assert eng.stats()["decode_steps"] == 3  # the fourth decode step never came back
    (got,) = eng.wait([rb])
    assert got[0].token_ids == greedy(hf_qwen, pb, 10)
    assert_consistent(eng)
    assert eng.stats()["blocks_in_use"] == 0 and eng.stats()["decode_tokens"] == 3 * 2 + 6
