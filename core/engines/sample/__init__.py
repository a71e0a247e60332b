"""``SamplingEngine``: token-in/token-out generation for RL rollouts, on a chosen backend.

    from polynya import SamplingParams
    from polynya.config import SamplerConfig
    from polynya.engines import SamplingEngine

    engine = SamplingEngine(SamplerConfig("tiny:qwen3", dtype="float32"))
    out = engine.generate([[5, 6, 7]], SamplingParams(n=4, temperature=0.8, logprobs=True))
    out[0][3].token_ids, out[0][3].logprobs, out[0][3].finish_reason

Backends: ``"native"`` (embedded paged-KV engine with prefix sharing and FCA decode; CPU or one
GPU) and ``"vllm"`` (needs ``pip install polynya[vllm]``). The facade only dispatches; every
backend offers ``generate`` (with an ``on_submit`` hook that learns its request ids), ``abort``
(all, or given backend request ids), ``load_weights``, ``weight_version``, ``weight_checksum``,
``sleep``, ``wake`` and ``stats``; the native one also ``prompt_logprobs`` (scoring given
sequences, ``scoring.py``). The facade names calls (``generate(..., request_id=)``; ``reserve``
the name first when the call may wait elsewhere before it reaches the engine) so that
``abort([request_id])`` stops one call's requests, as vLLM's ``abort(request_id)`` does.

Bad requests (empty prompt, id >= vocab, ``max_tokens < 1``, prompt not shorter than the
model window) raise ``ValueError`` naming the request index before anything is scheduled, so
no other request — in this call or a concurrent one — is affected.
"""
from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from polynya.config.sampler import SamplerConfig
from polynya.types import Sample, SamplingParams, TokenSeq

from .requests import private_copies
from .scoring import PromptLogprobs

__all__ = ["SamplingEngine"]


def _build_backend(config: SamplerConfig):
    if config.backend == "native":
        from .native import NativeEngine

        return NativeEngine(config)
    if importlib.util.find_spec("vllm") is None:
        raise ImportError("SamplerConfig(backend='vllm') needs vLLM: pip install polynya[vllm]")
    from .vllm import VLLMEngine

    return VLLMEngine(config)


@dataclass
class _Call:
    """A named ``generate`` call (or a name ``reserve``d for one): its backend request ids once
    queued, and whether ``abort`` named it (before or after it was queued)."""

    ids: list | None = None
    aborted: bool = False
    started: bool = False  # a generate runs under this name
    reserved: bool = False


def _check_request_id(request_id) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")


class SamplingEngine:
    """Generation engine; see the module docstring."""

    def __init__(self, config: SamplerConfig) -> None:
        if not isinstance(config, SamplerConfig):
            raise ValueError(f"SamplingEngine needs a SamplerConfig, got {type(config).__name__}")
        self.config = config
        self.backend = _build_backend(config)
        self._executor = ThreadPoolExecutor(config.call_slots, thread_name_prefix="polynya-sampler")
        self._calls: dict[str, _Call] = {}  # generate calls in flight, by request_id
        self._calls_lock = threading.Lock()

    def generate(self, prompts: Sequence[TokenSeq], params: SamplingParams | Sequence[SamplingParams],
                 *, request_id: str | None = None) -> list[list[Sample]]:
        """Sample completions.

        Args:
            prompts: token-id lists (or 1-D int tensors), one per request.
            params: one ``SamplingParams`` for all, or one per prompt.
            request_id: a name for this call (e.g. the HTTP request's), unique among the calls in
                flight, so that ``abort([request_id])`` can stop all of its prompts and samples.
        Returns:
            per prompt, its ``params.n`` samples (``Sample(token_ids, logprobs, finish_reason)``).
        """
        if request_id is None:
            return self.backend.generate(prompts, params)
        _check_request_id(request_id)
        with self._calls_lock:
            call = self._calls.get(request_id)
            if call is None or call.started:  # not reserved (or in use: _claim refuses)
                call = self._claim(request_id)
            call.started = True  # one generate per name

        def submitted(ids: list) -> bool:  # the backend queued this call's requests
            with self._calls_lock:
                call.ids = list(ids)
                return call.aborted

        try:
            return self.backend.generate(prompts, params, on_submit=submitted)
        finally:
            with self._calls_lock:
                if not call.reserved:
                    del self._calls[request_id]

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + completion) this engine serves."""
        return self.backend.max_model_len

    def validate(self, prompts: Sequence[TokenSeq], params: SamplingParams | Sequence[SamplingParams]
                 ) -> tuple[list[list[int]], list[SamplingParams]]:
        """The checks ``generate`` makes first, alone: ``ValueError`` naming the first bad
        request (index in ``prompts``); else the prompts as id lists and one params per prompt."""
        return self.backend.validate(prompts, params)

    def reserve(self, request_id: str) -> None:
        """Name a ``generate`` call before it is made (it may first wait elsewhere, e.g. for a
        hand-over): an ``abort([request_id])`` in between stops it as soon as it is queued.
        ``release`` the name afterwards; ``ValueError`` when the name is in use."""
        _check_request_id(request_id)
        with self._calls_lock:
            self._claim(request_id).reserved = True

    def release(self, request_id: str) -> None:
        """Forget a ``reserve``d name (its call has returned, or was never made)."""
        with self._calls_lock:
            self._calls.pop(request_id, None)

    def _claim(self, request_id: str) -> _Call:
        if request_id in self._calls:  # caller holds _calls_lock
            raise ValueError(f"request_id {request_id!r} is already in flight: give every "
                             "concurrent generate its own id")
        call = self._calls[request_id] = _Call()
        return call

    def prompt_logprobs(self, sequences: Sequence[TokenSeq], *, top_k: int = 0,
                        temperature: float = 1.0) -> list[PromptLogprobs]:
        """Score given sequences on the served weights (vLLM's ``prompt_logprobs``).

        Args:
            sequences: token-id lists, each scored whole.
            top_k: most likely tokens to return per position (-1: all of the vocabulary).
            temperature: log-probs of ``logits / temperature`` (0 reads as 1).
        Returns:
            per sequence, ``PromptLogprobs`` (``polynya.engines.sample.scoring``) of positions 1..L-1.
        """
        score = getattr(self.backend, "prompt_logprobs", None)
        if score is None:
            raise NotImplementedError(f"prompt log-probs are served by the native sampler only, "
                                      f"not backend={self.config.backend!r}")
        return score(sequences, top_k=top_k, temperature=temperature)

    async def generate_async(self, prompts: Sequence[TokenSeq],
                             params: SamplingParams | Sequence[SamplingParams], *,
                             request_id: str | None = None) -> list[list[Sample]]:
        """``generate`` on a worker thread; the event loop stays free, and concurrent calls are
        batched together by the engine (up to ``SamplerConfig.call_slots`` calls at once)."""
        loop = asyncio.get_running_loop()
        params = private_copies(params)  # the values as of this call, not when the worker runs it
        return await loop.run_in_executor(
            self._executor, lambda: self.generate(prompts, params, request_id=request_id))

    def abort(self, request_ids: Iterable[str] | None = None) -> int:
        """Stop requests in flight at the next step boundary: those of the ``generate`` calls
        named ``request_ids``, or every request (``None``). Each stopped call returns at once
        with what was sampled so far (``finish_reason="abort"``: tokens and log-probs up to the
        abort; empty for a sample not started) and its KV pages are freed; the other requests
        of the batch go on unchanged. Ids unknown or already finished are ignored (as vLLM
        does); a named call not yet queued is stopped as it is queued. Returns the number of
        engine requests (prompts) stopped now. Does not pause: a later ``generate`` runs."""
        if request_ids is None:
            return self.backend.abort()
        if isinstance(request_ids, str):
            raise ValueError(f"abort takes a list of request ids, got the string {request_ids!r}")
        ids: list = []
        with self._calls_lock:
            for rid in request_ids:
                call = self._calls.get(rid)
                if call is not None:
                    call.aborted = True
                    ids += call.ids or []
        return self.backend.abort(ids) if ids else 0

    def load_weights(self, weights, version: int | None = None, *,
                     checksum: str | None = None) -> int:
        """New weights in place (``{name: tensor}``, ``[(name, tensor)]`` or flat buckets
        ``[(names, flat)]``); the prefix cache is dropped. Returns the weight version.

        Every piece is checked before anything is copied (names, shapes, dtypes, finite
        values, and ``checksum`` — the sender's ``polynya.checksum`` of the pieces — when
        given); ``ValueError`` leaves the weights and ``weight_version`` unchanged, as does a
        ``version`` that is not newer than the served one."""
        return self.backend.load_weights(weights, version=version, checksum=checksum)

    @property
    def device(self) -> torch.device:
        """The device the engine computes on (where synced weights are staged)."""
        return torch.device(self.config.torch_device)

    @property
    def weight_version(self) -> int:
        """The version of the weights served (0 until the first ``load_weights``)."""
        return self.backend.weight_version

    def weight_checksum(self) -> str:
        """``polynya.checksum`` of the served weights."""
        return self.backend.weight_checksum()

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{name: (shape, dtype)}`` of the weights ``load_weights`` accepts: what a receiver
        checks a sender's announcement against before any transfer."""
        return self.backend.weight_specs()

    def room_bytes(self, level: int = 1) -> int | None:
        """Device bytes this engine takes when it wakes from sleep ``level`` (0: awake) and
        generates: KV cache and weights brought back plus its working memory (an estimate);
        0 on the CPU, ``None`` when the backend cannot tell (vLLM sizes its own cache).
        The colocated hand-over's ``offload_trainer="auto"`` keeps the trainer resident when
        this much is free."""
        room = getattr(self.backend, "room_bytes", None)
        return None if room is None else room(level)

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache (level 1) and also the weights' device memory (level 2)."""
        self.backend.sleep(level)

    def wake(self) -> None:
        self.backend.wake()

    def stats(self) -> dict[str, float]:
        """Counters: ``prefill_tokens`` (computed), ``decode_tokens``, ``cache_hit_tokens``,
        ``blocks_in_use``, ``preemptions``, ``weight_version``, step times ..."""
        return self.backend.stats()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False)
