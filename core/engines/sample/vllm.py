"""The vLLM sampling backend (``SamplerConfig(backend="vllm")``; needs ``pip install polynya[vllm]``).

A thin translation layer: polynya's token-in/token-out requests and ``SamplingParams`` map onto
``vllm.LLM.generate`` with token prompts; log-probs come back in vLLM's ``processed_logprobs``
mode, i.e. under the distribution actually sampled from, as the native backend returns them.
Prefix caching is on, so the ``n`` samples of a prompt share its prefill there too.

Requests run through ``LLM.llm_engine`` step by step (``add_request`` / ``step``, cumulative
outputs), so ``abort`` can stop them between two steps with ``abort_request`` and hand back what
each had sampled (``finish_reason="abort"``), as the native backend does: all of them, or the
request ids ``generate``'s ``on_submit`` handed out (the others of the call keep stepping).

Concurrent ``generate`` calls batch as in the native backend: a call queues its requests on an
intake list (no wait for the step in progress), and whichever waiting call holds the step lock
adds everything queued to the engine, steps it once, and files every output under its request —
so one ``engine.step()`` advances the requests of all calls, and each call returns when its own
are finished.

Weights load in place through ``LLM.apply_model(model.load_weights)`` (HF parameter names; flat
buckets are split by the HF shapes), and the prefix cache is reset after every update. vLLM
loads HF ids / local paths only (save a ``tiny:`` / ``random:`` model first). vLLM cannot be installed on polynya's CPU CI or
its GPU machine (it pins another torch), so this module is exercised only where vLLM exists:
it is written to vLLM's documented engine API and has not been run by polynya's tests.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from polynya.config.common import resolve_dtype
from polynya.config.sampler import SamplerConfig
from polynya.models import is_synthetic
from polynya.types import Sample, SamplingParams, TokenSeq
from polynya.weights import checked_pairs

from .requests import unstarted_sample, validate_requests
from .step_lock import StepLock

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _hf_shapes(model: str) -> dict[str, torch.Size]:
    """HF parameter shapes (by HF name: vLLM fuses some internally) from a meta-device model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    return {n: p.shape for n, p in hf.named_parameters(remove_duplicate=False)}


@dataclass
class _AbortOrder:
    """``abort`` waiting for the next step boundary (``None``: every request)."""

    request_ids: frozenset[str] | None
    applied: threading.Event = field(default_factory=threading.Event)
    count: int = 0


@dataclass
class _Pending:
    """One request of a ``generate`` call: its latest ``RequestOutput`` and cumulative
    ``CompletionOutput`` per sample index; ``finished`` once vLLM finished it or it was aborted."""

    latest: object = None
    completions: dict = field(default_factory=dict)
    finished: bool = False
    error: BaseException | None = None  # vLLM refused it (add_request): its call raises this


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
        self._steps = StepLock()  # turns: callers between steps go before the stepping loops
        self._lock = self._steps.lock  # held for one engine step (or add / abort / load)
        self._pending: dict[str, _Pending] = {}  # requests of the calls in flight, by id
        self._intake: list[tuple[str, list[int], SamplingParams]] = []  # not yet in the engine
        self._orders: list[_AbortOrder] = []  # aborts, applied between steps
        self._queue_lock = threading.Lock()  # intake, orders, _pending's keys and the counts
        self._hold = 0  # > 0: a weight load waits for the engine to drain; intake is held back
        self._load_lock = threading.Lock()  # one weight load at a time
        self._ids = itertools.count()
        self._counts = {"prefill_tokens": 0, "decode_tokens": 0, "cache_hit_tokens": 0, "requests": 0,
                        "aborted_requests": 0}

    def _params(self, p: SamplingParams):
        from vllm import SamplingParams as VLLMParams
        from vllm.sampling_params import RequestOutputKind

        return VLLMParams(n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                          min_p=p.min_p, max_tokens=p.max_tokens, min_tokens=p.min_tokens,
                          seed=p.seed, logprobs=0,
                          stop_token_ids=list(p.stop_token_ids or ()), ignore_eos=not p.stops_at_eos,
                          output_kind=RequestOutputKind.CUMULATIVE)

    def _step(self) -> bool:
        """One step boundary and one engine step (caller holds ``_lock``): queued requests
        go into the engine, abort orders are applied, and the outputs are filed. False when
        there was nothing to step."""
        engine = self.llm.llm_engine
        self._step_boundary()
        if not engine.has_unfinished_requests():
            return False
        for out in engine.step():
            entry = self._pending.get(out.request_id)
            if entry is None:  # not a request of ours (or its call has gone)
                continue
            entry.latest = out
            for c in out.outputs:
                entry.completions[c.index] = c
            entry.finished = entry.finished or out.finished
        return True

    def validate(self, prompts: Sequence[TokenSeq], params: SamplingParams | Sequence[SamplingParams]
                 ) -> tuple[list[list[int]], list[SamplingParams]]:
        """Check every request; raise ``ValueError`` naming the first bad one (nothing queued)."""
        return validate_requests(prompts, params, vocab_size=self.vocab_size,
                                 max_model_len=self.max_model_len)

    def generate(self, prompts: Sequence[TokenSeq], params: SamplingParams | Sequence[SamplingParams],
                 *, on_submit: Callable[[list[str]], bool] | None = None) -> list[list[Sample]]:
        """As the native backend's: ``on_submit(request_ids)`` learns the ids as they are
        queued (before any step can run them); a True answer aborts them there (never queued,
        each sample empty with ``finish_reason="abort"``)."""
        toks, plist = self.validate(prompts, params)
        rids = [f"polynya-{next(self._ids)}" for _ in toks]
        entries = [_Pending() for _ in rids]
        with self._queue_lock:  # not the step lock: this call joins the next step
            if on_submit is not None and on_submit(list(rids)):
                self._counts["requests"] += len(rids)
                self._counts["aborted_requests"] += len(rids)
                return [[unstarted_sample(p) for _ in range(p.n)] for p in plist]
            self._pending.update(zip(rids, entries))
            self._intake.extend(zip(rids, toks, plist))
        turn = self._steps.stepper()
        try:
            while True:
                failed = next((e.error for e in entries if e.error is not None), None)
                if failed is not None:  # vLLM refused one: the call stops and raises it
                    raise failed
                if all(e.finished for e in entries):
                    break
                with turn, self._lock:
                    stepped = turn.go() and not all(e.finished for e in entries) and self._step()
                if not stepped:  # a weight load or a caller between steps goes first
                    time.sleep(0.001)
        except BaseException:  # a refused request, a failed step or an interrupt
            self._drop(rids, entries)
            raise
        finally:
            with self._queue_lock:
                for r in rids:
                    self._pending.pop(r, None)
        results = []
        with self._queue_lock:
            for e, t, p in zip(entries, toks, plist):
                out = e.latest
                cached = (getattr(out, "num_cached_tokens", 0) or 0) if out is not None else 0
                self._counts["prefill_tokens"] += len(t) - cached if out is not None else 0
                self._counts["cache_hit_tokens"] += cached
                self._counts["requests"] += 1
                results.append([self._sample(e.completions.get(i), p) for i in range(p.n)])
        return results

    def _drop(self, rids: list[str], entries: list[_Pending]) -> None:
        """Take a call's unfinished requests out of the intake and the engine."""
        mine = set(rids)
        with self._queue_lock:
            self._intake = [x for x in self._intake if x[0] not in mine]
        with self._steps.plain(), self._lock:
            live = [r for r, e in zip(rids, entries) if not e.finished]
            if live:
                with contextlib.suppress(Exception):  # the engine may be what failed
                    self.llm.llm_engine.abort_request(live)

    def _sample(self, c, p: SamplingParams) -> Sample:
        """A vLLM ``CompletionOutput`` (``None``: nothing sampled before an abort) as a Sample."""
        if c is None:
            return unstarted_sample(p)
        self._counts["decode_tokens"] += max(len(c.token_ids) - 1, 0)
        lps = ([d[tok].logprob for tok, d in zip(c.token_ids, c.logprobs)]
               if p.logprobs and c.logprobs is not None else None)
        reason = {"stop": "stop", "length": "length"}.get(c.finish_reason, "abort")
        return Sample(token_ids=list(c.token_ids), logprobs=lps, finish_reason=reason)

    def abort(self, request_ids: Iterable[str] | None = None) -> int:
        """Stop every request in flight (``None``), or only the requests ``request_ids`` (ids
        ``on_submit`` handed out), at the next step boundary (``abort_request``); a stopped
        request returns each sample as sampled so far. Returns the number of requests stopped
        (0 when idle; unknown or finished ids are ignored)."""
        order = _AbortOrder(None if request_ids is None else frozenset(str(r) for r in request_ids))
        with self._queue_lock:
            self._orders.append(order)
        # in at the next step boundary (a step may have applied it by then)
        with self._steps.plain(), self._lock:
            if not order.applied.is_set():
                self._step_boundary()
        return order.count

    def _step_boundary(self) -> None:
        """Queued requests into the engine and abort orders applied, without stepping (caller
        holds ``_lock``). One snapshot of intake, orders and requests, so an order sees every
        request queued before it. A request vLLM refuses (``add_request`` raises) is finished
        with its error, which its own call raises; while a weight load waits (``_hold``) the
        intake stays queued."""
        engine = self.llm.llm_engine
        with self._queue_lock:
            orders, self._orders = self._orders, []
            if not self._hold:
                intake, self._intake = self._intake, []
            else:
                intake = []
            held = {x[0] for x in self._intake}  # queued, not in the engine
            running = [r for r, e in self._pending.items() if not e.finished]
        try:
            for rid, toks, p in intake:
                try:
                    engine.add_request(rid, {"prompt_token_ids": toks}, self._params(p))
                except Exception as exc:  # noqa: BLE001 - handed to the request's own call
                    entry = self._pending.get(rid)
                    if entry is not None:
                        entry.error, entry.finished = exc, True
        finally:
            for order in orders:  # applied whatever happened above: abort() waits for it
                hit = [r for r in running if order.request_ids is None or r in order.request_ids]
                in_engine = [r for r in hit if r not in held]
                if in_engine:
                    with contextlib.suppress(Exception):
                        engine.abort_request(in_engine)
                with self._queue_lock:
                    if len(in_engine) < len(hit):  # held back: never reaches the engine now
                        gone = set(hit)
                        self._intake = [x for x in self._intake if x[0] not in gone]
                    for r in hit:
                        entry = self._pending.get(r)  # its call may have failed and gone
                        if entry is not None:
                            entry.finished = True
                    self._counts["aborted_requests"] += len(hit)
                    order.count = len(hit)
                order.applied.set()

    def load_weights(self, weights, version: int | None = None, *,
                     checksum: str | None = None) -> int:
        """Every piece checked against the HF names and shapes (and ``checksum``) before vLLM
        sees any of it (its own loader would stop half-way on an unknown name). The requests in
        the engine finish first on the old weights (their calls keep stepping; new requests
        wait in the intake), so that vLLM's prefix cache, which it only resets when no
        request holds its blocks, can be dropped; then the weights change and new requests
        run on them. The native backend instead changes weights between two steps."""
        with self._load_lock:
            if version is not None and int(version) <= self.weight_version:
                raise ValueError(f"weight version {version} is not newer than the served "
                                 f"{self.weight_version}")
            pairs = checked_pairs(weights, self._shapes, checksum=checksum)
            with self._queue_lock:
                self._hold += 1
            try:
                while True:
                    with self._steps.plain(), self._lock:
                        if not self.llm.llm_engine.has_unfinished_requests():
                            self.llm.apply_model(lambda model: model.load_weights(pairs))
                            if self.llm.reset_prefix_cache() is False:
                                raise RuntimeError(
                                    "vLLM did not reset its prefix cache after the weight "
                                    "update (blocks in use): cached prompts may hold the old "
                                    "weights' keys; restart the engine")
                            self.weight_version = (self.weight_version + 1 if version is None
                                                   else int(version))
                            return self.weight_version
                    time.sleep(0.001)  # the running requests' calls step them meanwhile
            finally:
                with self._queue_lock:
                    self._hold -= 1

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
        with self._steps.plain(), self._lock, self._queue_lock:
            if self._pending:
                raise RuntimeError("cannot sleep with requests in flight")
            self.llm.sleep(level=level)

    def wake(self) -> None:
        with self._steps.plain(), self._lock:
            self.llm.wake_up()

    def stats(self) -> dict[str, float]:
        with self._queue_lock:
            return dict(self._counts, weight_version=self.weight_version)
