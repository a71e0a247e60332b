"""The vLLM sampling backend (``SamplerConfig(backend="vllm")``; needs ``pip install polynya[vllm]``).

A thin translation layer: polynya's token-in/token-out requests and ``SamplingParams`` map onto
``vllm.LLM.generate`` with token prompts; log-probs come back in vLLM's ``processed_logprobs``
mode, i.e. under the distribution actually sampled from, as the native backend returns them.
Prefix caching is on, so the ``n`` samples of a prompt share its prefill there too.

Requests run through ``LLM.llm_engine`` step by step (``add_request`` / ``step``, cumulative
outputs), so ``abort`` can stop them between two steps with ``abort_request`` and hand back what
each had sampled (``finish_reason="abort"``), as the native backend does: all of them, or the
request ids ``generate``'s ``on_submit`` handed out (the others of the call keep stepping).

Weights load in place through ``LLM.apply_model(model.load_weights)`` (HF parameter names; flat
buckets are split by the HF shapes), and the prefix cache is reset after every update. vLLM
loads HF ids / local paths only (save a ``tiny:`` / ``random:`` model first). vLLM cannot be installed on polynya's CPU CI or
its GPU machine (it pins another torch), so this module is exercised only where vLLM exists:
it is written to vLLM's documented engine API and has not been run by polynya's tests.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from polynya.config.common import resolve_dtype
from polynya.config.sampler import SamplerConfig
from polynya.models import is_synthetic
from polynya.types import Sample, SamplingParams, TokenSeq
from polynya.weights import checked_pairs

from .requests import validate_requests

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _hf_shapes(model: str) -> dict[str, torch.Size]:
    """HF parameter shapes (by HF name: vLLM fuses some internally) from a meta-device model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    return {n: p.shape for n, p in hf.named_parameters(remove_duplicate=False)}


@dataclass
class _AbortOrder:
    """``abort(request_ids)`` waiting for the running ``generate``'s next step boundary."""

    request_ids: frozenset[str]
    applied: threading.Event = field(default_factory=threading.Event)
    count: int = 0


class VLLMEngine:
    """``SamplingEngine`` backend on ``vllm.LLM`` (one process, one or more GPUs via vLLM)."""

    def __init__(self, config: SamplerConfig) -> None:
        from vllm import LLM

        if is_synthetic(config.model):
            raise ValueError(f"backend='vllm' loads an HF id or local path, not {config.model!r}; "
                             "save the model (model.save_pretrained) and pass the directory")
        self.config = config
        self._shapes = _hf_shapes(config.model)
        self.llm = LLM(model=config.model, dtype=_DTYPE_NAMES[resolve_dtype(config.dtype)],
                       seed=config.seed, block_size=config.block_size, enable_prefix_caching=True,
                       max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                       max_num_batched_tokens=config.max_num_batched_tokens,
                       enforce_eager=not config.cuda_graphs, enable_sleep_mode=True,
                       logprobs_mode="processed_logprobs")
        model_config = self.llm.llm_engine.model_config
        self.vocab_size = model_config.get_vocab_size()
        self.max_model_len = model_config.max_model_len
        self.weight_version = 0
        self._lock = threading.Lock()  # one generate at a time drives the engine's steps
        self._abort = threading.Event()
        self._stopped = 0  # requests the last abort stopped (written under the lock)
        self._orders: list[_AbortOrder] = []  # per-request aborts, applied between steps
        self._orders_lock = threading.Lock()
        self._ids = itertools.count()
        self._counts = {"prefill_tokens": 0, "decode_tokens": 0, "cache_hit_tokens": 0, "requests": 0,
                        "aborted_requests": 0}

    def _params(self, p: SamplingParams):
        from vllm import SamplingParams as VLLMParams
        from vllm.sampling_params import RequestOutputKind

        stop = p.stop_token_ids
        return VLLMParams(n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                          min_p=p.min_p, max_tokens=p.max_tokens, seed=p.seed, logprobs=0,
                          stop_token_ids=list(stop or ()), ignore_eos=stop is not None,
                          output_kind=RequestOutputKind.CUMULATIVE)

    def _run(self, toks: list[list[int]], plist: list[SamplingParams],
             on_submit: Callable[[list[str]], bool] | None) -> tuple[list[str], dict, dict]:
        """Add the requests and step the engine until they finish or are aborted; returns the
        request ids, the latest ``RequestOutput`` of each and the latest cumulative
        ``CompletionOutput`` of every ``(id, index)``."""
        engine = self.llm.llm_engine
        rids = [f"polynya-{next(self._ids)}" for _ in toks]
        for rid, t, p in zip(rids, toks, plist):
            engine.add_request(rid, {"prompt_token_ids": t}, self._params(p))
        latest, prompts = {}, {}
        if on_submit is not None and on_submit(list(rids)):
            engine.abort_request(rids)
            self._counts["aborted_requests"] += len(rids)
            return rids, prompts, latest
        while engine.has_unfinished_requests():
            running = [r for r in rids if r not in prompts or not prompts[r].finished]
            if self._abort.is_set():
                engine.abort_request(running)
                self._stopped += len(running)
                self._counts["aborted_requests"] += len(running)
                break
            self._apply_orders(running)
            for out in engine.step():
                prompts[out.request_id] = out
                for c in out.outputs:
                    latest[(out.request_id, c.index)] = c
        return rids, prompts, latest

    def _apply_orders(self, running: list[str]) -> None:
        """Abort the running requests that pending ``abort(request_ids)`` orders name (caller
        holds the lock, between two steps); the other requests go on."""
        with self._orders_lock:
            orders, self._orders = self._orders, []
        for order in orders:
            hit = [r for r in running if r in order.request_ids]
            if hit:
                self.llm.llm_engine.abort_request(hit)
                running[:] = [r for r in running if r not in hit]
            order.count = len(hit)
            self._counts["aborted_requests"] += len(hit)
            order.applied.set()

    def generate(self, prompts: Sequence[TokenSeq], params: SamplingParams | Sequence[SamplingParams],
                 *, on_submit: Callable[[list[str]], bool] | None = None) -> list[list[Sample]]:
        """As the native backend's: ``on_submit(request_ids)`` learns the ids once they are
        added (before any step); a True answer aborts them at once."""
        toks, plist = validate_requests(prompts, params, vocab_size=self.vocab_size,
                                        max_model_len=self.max_model_len)
        with self._lock:
            rids, requests, completions = self._run(toks, plist, on_submit)
        results = []
        for rid, t, p in zip(rids, toks, plist):
            out = requests.get(rid)
            cached = (getattr(out, "num_cached_tokens", 0) or 0) if out is not None else 0
            self._counts["prefill_tokens"] += len(t) - cached
            self._counts["cache_hit_tokens"] += cached
            self._counts["requests"] += 1
            results.append([self._sample(completions.get((rid, i)), p) for i in range(p.n)])
        return results

    def _sample(self, c, p: SamplingParams) -> Sample:
        """A vLLM ``CompletionOutput`` (``None``: nothing sampled before an abort) as a Sample."""
        if c is None:
            return Sample(token_ids=[], logprobs=[] if p.logprobs else None, finish_reason="abort")
        self._counts["decode_tokens"] += max(len(c.token_ids) - 1, 0)
        lps = ([d[tok].logprob for tok, d in zip(c.token_ids, c.logprobs)]
               if p.logprobs and c.logprobs is not None else None)
        reason = {"stop": "stop", "length": "length"}.get(c.finish_reason, "abort")
        return Sample(token_ids=list(c.token_ids), logprobs=lps, finish_reason=reason)

    def abort(self, request_ids: Iterable[str] | None = None) -> int:
        """Stop the running ``generate`` (``None``), or only the requests ``request_ids`` (ids
        ``on_submit`` handed out), between two engine steps (``abort_request``); a stopped
        request returns each sample as sampled so far. Returns the number of requests stopped
        (0 when idle; unknown or finished ids are ignored)."""
        if request_ids is not None:
            order = _AbortOrder(frozenset(str(r) for r in request_ids))
            with self._orders_lock:
                self._orders.append(order)
            while not order.applied.is_set():  # a running generate applies it before its next step
                if self._lock.acquire(timeout=0.01):
                    try:
                        self._apply_orders([])  # no generate running: nothing to stop
                    finally:
                        self._lock.release()
            return order.count
        self._abort.set()
        try:
            with self._lock:  # held by a running generate until it has returned
                stopped, self._stopped = self._stopped, 0
        finally:
            self._abort.clear()
        return stopped

    def load_weights(self, weights, version: int | None = None, *,
                     checksum: str | None = None) -> int:
        """Every piece checked against the HF names and shapes (and ``checksum``) before vLLM
        sees any of it (its own loader would stop half-way on an unknown name)."""
        with self._lock:
            if version is not None and int(version) <= self.weight_version:
                raise ValueError(f"weight version {version} is not newer than the served "
                                 f"{self.weight_version}")
            pairs = checked_pairs(weights, self._shapes, checksum=checksum)
            self.llm.apply_model(lambda model: model.load_weights(pairs))
            self.llm.reset_prefix_cache()
            self.weight_version = self.weight_version + 1 if version is None else int(version)
            return self.weight_version

    def weight_checksum(self) -> str:
        """Not available: refuse rather than give a checksum of other tensors."""
        raise NotImplementedError("weight_checksum of the vLLM backend: vLLM fuses and renames "
                                  "weights (qkv_proj, gate_up_proj); compare against the "
                                  "trainer through load_weights(..., checksum=) instead")
    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF names and shapes (vLLM fuses some internally) in the engine's dtype."""
        dtype = resolve_dtype(self.config.dtype)
        return {n: (tuple(s), dtype) for n, s in self._shapes.items()}

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self.llm.sleep(level=level)

    def wake(self) -> None:
        self.llm.wake_up()

    def stats(self) -> dict[str, float]:
        return dict(self._counts, weight_version=self.weight_version)
