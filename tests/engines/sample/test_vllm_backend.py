"""The vLLM backend's request plumbing against a stand-in ``vllm`` module (vLLM itself cannot
be installed here: it pins another torch). The stand-in's engine follows the calls the backend
makes (``add_request`` / ``step`` with cumulative outputs / ``abort_request`` /
``has_unfinished_requests``) and samples a token that is a function of the prompt and the
position, so every answer is known whatever the batching. What this shows: concurrent
``generate`` calls share engine steps, each call gets exactly its own outputs, per-call and
global aborts stop only what they name, and sleep refuses with requests in flight. What it does
not show: that real vLLM behaves as the stand-in (the backend stays unverified against vLLM)."""
from __future__ import annotations

import importlib.machinery
import sys
import threading
import time
import types
from types import SimpleNamespace

import pytest
from polynya import SamplingParams
from polynya.config import SamplerConfig
from polynya.engines import SamplingEngine
from polynya.models import load_model

VOCAB = 512
STEP_S = 0.004  # a device step's time: calls arriving meanwhile join the next one


def token(prompt: list[int], position: int, index: int) -> int:
    return (sum(prompt) * 31 + 7 * position + index) % VOCAB


def logprob(position: int) -> float:
    return -0.25 - position / 64


class FakeLLMEngine:
    """``LLM.llm_engine`` as the backend drives it."""

    def __init__(self, max_model_len: int) -> None:
        self.model_config = SimpleNamespace(get_vocab_size=lambda: VOCAB,
                                            max_model_len=max_model_len)
        self.requests: dict[str, dict] = {}
        self.batches: list[int] = []  # requests per step
        self.aborted: list[str] = []
        self.reject: set[int] = set()  # prompt ids add_request refuses (vLLM's own checks)
        self.added: list[str] = []
        self.lock = threading.Lock()  # the backend must never call it from two threads at once

    def add_request(self, rid, prompt, params) -> None:
        with self.lock_held():
            assert rid not in self.requests
            if self.reject & set(prompt["prompt_token_ids"]):
                raise ValueError("Token id is out of vocabulary")
            self.added.append(rid)
            self.requests[rid] = {"prompt": list(prompt["prompt_token_ids"]), "p": params,
                                  "toks": [[] for _ in range(params.n)]}

    def abort_request(self, ids) -> None:
        with self.lock_held():
            for r in ids:
                if self.requests.pop(r, None) is not None:
                    self.aborted.append(r)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list:
        with self.lock_held():
            time.sleep(STEP_S)
            self.batches.append(len(self.requests))
            outs = []
            for rid, r in list(self.requests.items()):
                p, comps = r["p"], []
                for i, toks in enumerate(r["toks"]):
                    toks.append(token(r["prompt"], len(toks), i))
                    done = len(toks) >= p.max_tokens
                    comps.append(SimpleNamespace(
                        index=i, token_ids=list(toks), finish_reason="length" if done else None,
                        logprobs=[{t: SimpleNamespace(logprob=logprob(k))} for k, t in enumerate(toks)]))
                finished = all(len(t) >= p.max_tokens for t in r["toks"])
                outs.append(SimpleNamespace(request_id=rid, outputs=comps, finished=finished,
                                            num_cached_tokens=0))
                if finished:
                    del self.requests[rid]
            return outs

    def lock_held(self):
        if not self.lock.acquire(blocking=False):
            raise AssertionError("the vLLM engine was called from two threads at once")
        return _Release(self.lock)


class _Release:
    def __init__(self, lock):
        self.lock = lock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.lock.release()


class FakeLLM:
    def __init__(self, model, max_model_len=None, **kw) -> None:
        self.kw = kw
        self.llm_engine = FakeLLMEngine(max_model_len or 128)
        self.slept = None
        self.loads: list[int] = []  # requests in the engine at each weight load
        self.reset_ok = True

    def sleep(self, level):
        self.slept = level

    def wake_up(self):
        self.slept = None

    def apply_model(self, fn):
        self.loads.append((len(self.llm_engine.requests), len(self.llm_engine.added)))

    def reset_prefix_cache(self):
        return self.reset_ok and not self.llm_engine.requests  # vLLM: refused with blocks in use


@pytest.fixture
def engine(tmp_path, monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    vllm.LLM = FakeLLM
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    sp = types.ModuleType("vllm.sampling_params")
    sp.RequestOutputKind = SimpleNamespace(CUMULATIVE="cumulative")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp)
    path = tmp_path / "model"
    load_model("tiny:qwen3").save_pretrained(path)
    eng = SamplingEngine(SamplerConfig(str(path), backend="vllm", dtype="float32"))
    yield eng
    eng.shutdown()


def expected(prompt: list[int], p: SamplingParams, upto: int | None = None):
    n = p.max_tokens if upto is None else upto
    return [[token(prompt, k, i) for k in range(n)] for i in range(p.n)]


def test_concurrent_calls_share_engine_steps(engine):
    fake = engine.backend.llm.llm_engine
    calls = 24
    prompts = [[3 + i, 40 + 2 * i, 9] for i in range(calls)]
    params = [SamplingParams(n=1 + i % 2, max_tokens=4 + i % 5, logprobs=True) for i in range(calls)]
    barrier, out = threading.Barrier(calls, timeout=30), {}

    def call(i):
        barrier.wait()
        out[i] = engine.generate([prompts[i]], params[i])[0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(calls):
        got = out[i]
        assert [s.token_ids for s in got] == expected(prompts[i], params[i])
        assert all(s.finish_reason == "length" for s in got)
        assert [s.logprobs for s in got] == [[logprob(k) for k in range(params[i].max_tokens)]] * params[i].n
    # one call at a time would put one request in every step; together they share steps
    assert max(fake.batches) >= calls // 2, fake.batches
    assert len(fake.batches) < sum(p.max_tokens for p in params) / 4  # steps, not calls x tokens
    stats = engine.stats()
    assert stats["requests"] == calls and stats["aborted_requests"] == 0
    assert stats["decode_tokens"] == sum(p.n * (p.max_tokens - 1) for p in params)
    assert not fake.requests and not engine.backend._pending and not engine.backend._intake


def test_abort_one_call_and_then_all(engine):
    fake, backend = engine.backend.llm.llm_engine, engine.backend
    long = SamplingParams(n=2, max_tokens=400, logprobs=True)
    short = SamplingParams(max_tokens=6, logprobs=True)
    res: dict = {}
    ta = threading.Thread(target=lambda: res.update(a=engine.generate([[5, 6]], long,
                                                                      request_id="a")))
    tb = threading.Thread(target=lambda: res.update(b=engine.generate([[7, 8, 9]], long)))
    ta.start()
    tb.start()
    deadline = time.time() + 30
    while len(fake.batches) < 5 or len(fake.requests) < 2:
        assert time.time() < deadline
        time.sleep(0.002)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.sleep(1)
    assert engine.backend.llm.slept is None
    assert engine.abort(["a"]) == 1  # call a only: b keeps decoding
    ta.join(30)
    (a,) = res["a"]
    assert [s.finish_reason for s in a] == ["abort", "abort"]
    assert 0 < len(a[0].token_ids) < 400 and a[0].token_ids == expected([5, 6], long)[0][:len(a[0].token_ids)]
    assert tb.is_alive() and len(fake.requests) == 1
    c = engine.generate([[1, 2, 3]], short)[0]  # a new call joins b's steps and finishes
    assert [s.token_ids for s in c] == expected([1, 2, 3], short)
    assert engine.abort() == 1  # every request: b
    tb.join(30)
    (b,) = res["b"]
    assert [s.finish_reason for s in b] == ["abort", "abort"] and len(b[1].token_ids) < 400
    assert b[1].token_ids == expected([7, 8, 9], long)[1][:len(b[1].token_ids)]
    assert engine.abort() == 0 and engine.stats()["aborted_requests"] == 2
    assert not fake.requests and not backend._pending
    engine.sleep(1)  # nothing in flight now
    assert engine.backend.llm.slept == 1


def test_abort_before_the_first_step_and_bad_input(engine):
    fake = engine.backend.llm.llm_engine
    steps = len(fake.batches)
    (out,) = engine.backend.generate([[4, 4]], SamplingParams(n=3, max_tokens=9),
                                     on_submit=lambda ids: True)
    assert [(s.token_ids, s.finish_reason) for s in out] == [([], "abort")] * 3
    assert len(fake.batches) == steps and not fake.requests  # never stepped
    with pytest.raises(ValueError, match="vocab"):
        engine.generate([[1], [VOCAB + 5]], SamplingParams(max_tokens=2))
    assert not engine.backend._pending and not engine.backend._intake and not fake.requests
    assert engine.stats()["requests"] == 1


def running(engine, prompt, params, res: dict, key: str) -> threading.Thread:
    """A call generating in a thread of its own (its answer goes to ``res[key]``), once the
    engine has stepped it."""
    fake, steps = engine.backend.llm.llm_engine, len(engine.backend.llm.llm_engine.batches)
    t = threading.Thread(target=lambda: res.update({key: engine.generate([prompt], params)}))
    t.start()
    deadline = time.time() + 30
    while len(fake.batches) == steps:
        assert time.time() < deadline
        time.sleep(0.001)
    return t


def test_a_request_vllm_refuses_fails_its_own_call_only(engine):
    fake = engine.backend.llm.llm_engine
    fake.reject = {77}
    good = SamplingParams(max_tokens=30)
    res: dict = {}
    tg = running(engine, [5, 6], good, res, "g")
    with pytest.raises(ValueError, match="out of vocabulary"):  # raised in the caller's thread
        engine.generate([[3, 4], [77, 1]], SamplingParams(max_tokens=30))
    tg.join(30)
    assert [s.token_ids for s in res["g"][0]] == expected([5, 6], good)
    assert engine.abort() == 0  # nothing left running, nothing waiting forever
    assert not fake.requests and not engine.backend._pending and not engine.backend._intake


def test_weights_load_after_the_running_requests_finish(engine, tmp_path):
    llm = engine.backend.llm
    weights = dict(load_model("tiny:qwen3").named_parameters())
    p = SamplingParams(max_tokens=60)
    res: dict = {}
    ta = running(engine, [5, 6], p, res, "a")
    tl = threading.Thread(target=lambda: res.update(v=engine.load_weights(weights, version=3)))
    tl.start()
    time.sleep(0.05)
    tb = threading.Thread(target=lambda: res.update(b=engine.generate([[8, 9]], p)))
    tb.start()  # queued while the load waits: runs on the new weights
    for t in (ta, tl, tb):
        t.join(30)
    # loaded with nothing running, after a (the only request added before it); b after it
    assert res["v"] == 3 and llm.loads == [(0, 1)] and engine.backend.weight_version == 3
    assert [s.token_ids for s in res["a"][0]] == expected([5, 6], p)
    assert [s.token_ids for s in res["b"][0]] == expected([8, 9], p)
    with pytest.raises(ValueError, match="not newer"):
        engine.load_weights(weights, version=3)
    llm.reset_ok = False
    with pytest.raises(RuntimeError, match="prefix cache"):
        engine.load_weights(weights)


@pytest.mark.parametrize("stop_token_ids, stop_at_eos, ids, ignore_eos", [
    (None, None, [], False),     # the model's EOS: vLLM's default
    ((), None, [], True),        # a list replaces EOS
    ((7, 9), None, [7, 9], True),
    ((7,), True, [7], False),    # EOS and 7 (vLLM's own rule)
    ((7,), False, [7], True),
])
def test_stop_rule_maps_to_vllm(engine, stop_token_ids, stop_at_eos, ids, ignore_eos):
    vp = engine.backend._params(SamplingParams(stop_token_ids=stop_token_ids, stop_at_eos=stop_at_eos))
    assert (vp.stop_token_ids, vp.ignore_eos) == (ids, ignore_eos)
