"""verl rollout ``polynya``: polynya's sampler answering verl's token-in/token-out server calls.

Three pieces, as verl's vLLM / SGLang rollouts have:

- ``PolynyaRolloutServer`` — the server (a Ray actor in a run): one ``SamplingEngine`` (native
  backend: paged KV cache, prefix sharing, FCA decode; ``vllm`` where installed) answering
  ``generate(prompt_ids, sampling_params, request_id)`` with ``TokenOutput(token_ids,
  log_probs, stop_reason)`` and ``wake_up`` / ``sleep`` / ``abort_all_requests`` /
  ``resume_generation`` / ``clear_kv_cache`` / ``update_weights``. Concurrent ``generate`` calls
  are batched by the engine (``SamplingEngine.generate_async``).
- ``PolynyaReplica`` — verl's ``RolloutReplica`` launching one server per replica, on the GPU of
  the replica's worker (one-GPU replicas: ``rollout.tensor_model_parallel_size=1``).
- ``PolynyaServerAdapter`` — the worker side (``BaseRollout``): ``resume`` / ``release`` /
  ``update_weights`` forwarded to the replica's server.

``abort_all_requests`` works as verl's vLLM server's: every request in flight is stopped at the
next engine step and answers with its partial ``token_ids`` / ``log_probs`` and
``stop_reason="aborted"`` (verl's agent loop resends prompt + partial tokens after
``resume_generation``); new requests wait for ``resume_generation`` (or are answered
``stop_reason="aborted"`` at once with ``reject_request=True``); the call returns once nothing is
in flight, with the aborted requests' ids. ``log_probs`` are those of the distribution sampled
from (after temperature / top-k / top-p: vLLM's ``logprobs_mode=processed_logprobs``, verl's
default). Refused: ``repetition_penalty`` != 1 (per request or ``rollout.repetition_penalty``),
multimodal inputs, another ``rollout.logprobs_mode`` and a quantized rollout
(``rollout.quantization`` / ``quantization_config_file``: verl's vLLM would sample from the
quantized model).

Stopping and seeds follow verl's vLLM server:

- a request stops at the model's EOS ids *and* at its ``stop_token_ids`` (verl's tool agent loop
  adds its parser's stop ids); ``ignore_eos`` (per request, defaulting to
  ``actor_rollout_ref.rollout.ignore_eos``) drops the EOS ids and keeps the request's stop ids;
- replica ``r`` samples from seed ``base + r``, ``base`` being ``engine_kwargs.polynya.seed`` when
  set, else ``rollout.seed`` (vLLM's engine seed is ``replica_rank + rollout.seed``), so replicas
  given the same prompt draw different samples. For ``tiny:`` / ``random:`` specs that seed also
  draws the initial weights (verl itself always passes a model directory).

As verl's vLLM server, the server loads the model directory's own config:
``actor_rollout_ref.model.override_config`` does not reach rollouts in verl either (polynya's
``deepspeed`` engine refuses an override that changes the model: ``settings``).
"""
from __future__ import annotations

from . import _module_done

import asyncio
import itertools
import os
from typing import Any

from polynya.client.gate import GenerationGate
from polynya.config import SamplerConfig
from polynya.types import SamplingParams
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

SERVER_PREFIX = "polynya_rollout_server"
PROCESSED_LOGPROBS = "processed_logprobs"  # what SamplingParams(logprobs=True) returns (vLLM's name)


def server_name(replica_rank: int, suffix: str = "") -> str:
    return f"{SERVER_PREFIX}_{replica_rank}{suffix}"


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an int, got {value!r}")
    return value


def sampler_config(config, model_path: str, replica_rank: int = 0) -> SamplerConfig:
    """verl's ``RolloutConfig`` -> ``SamplerConfig`` of replica ``replica_rank``
    (``engine_kwargs.polynya`` for the rest; seed rule in the module docstring)."""
    world = config.tensor_model_parallel_size * config.data_parallel_size * config.pipeline_model_parallel_size
    if world != 1:
        raise ValueError("polynya's sampler runs one GPU per replica: set actor_rollout_ref.rollout."
                         f"tensor_model_parallel_size=1 (and data/pipeline parallel 1), got {world} GPUs")
    if config.repetition_penalty != 1.0:
        raise ValueError("polynya's sampler has no repetition penalty: set actor_rollout_ref.rollout."
                         f"repetition_penalty=1.0 (got {config.repetition_penalty!r})")
    if not isinstance(config.ignore_eos, bool):
        raise ValueError(f"actor_rollout_ref.rollout.ignore_eos must be a bool, got {config.ignore_eos!r}")
    if config.logprobs_mode != PROCESSED_LOGPROBS:
        raise ValueError("polynya's sampler returns the log-probs of the distribution it samples from (after "
                         "temperature, top-k, top-p: vLLM's processed_logprobs, verl's default), which verl's "
                         "rollout correction compares with the actor's log-probs at the rollout temperature; "
                         f"set actor_rollout_ref.rollout.logprobs_mode={PROCESSED_LOGPROBS} "
                         f"(got {config.logprobs_mode!r})")
    if config.quantization is not None or config.quantization_config_file is not None:
        raise ValueError("polynya's sampler runs the trainer's weights unquantized, in rollout.dtype: unset "
                         "actor_rollout_ref.rollout.quantization and quantization_config_file (got "
                         f"{config.quantization!r}, {config.quantization_config_file!r})")
    extra = dict((config.engine_kwargs or {}).get("polynya", None) or {})
    base = extra.pop("seed", None)
    base = _int(config.seed, "actor_rollout_ref.rollout.seed") if base is None else \
        _int(base, "actor_rollout_ref.rollout.engine_kwargs.polynya.seed")
    max_len = config.max_model_len or config.prompt_length + config.response_length
    fields = dict(dtype=config.dtype, max_num_seqs=config.max_num_seqs,
                  max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=int(max_len))
    fields.update(extra)
    return SamplerConfig(str(model_path), seed=base + _int(replica_rank, "replica_rank"), **fields)


def to_sampling_params(params: dict[str, Any], default_max_tokens: int, ignore_eos: bool = False) -> SamplingParams:
    """verl's (vLLM-style) sampling dict -> ``SamplingParams``; unknown or unsupported keys refused.

    As vLLM: generation stops at the model's EOS ids and at ``stop_token_ids``; ``ignore_eos``
    (the request's, else the argument: ``rollout.ignore_eos``) keeps only ``stop_token_ids``.
    """
    p = dict(params)
    if p.pop("repetition_penalty", 1.0) != 1.0:
        raise ValueError("sampling_params['repetition_penalty'] is not supported by polynya's sampler")
    ignore = p.pop("ignore_eos", ignore_eos)
    if not isinstance(ignore, bool):
        raise ValueError(f"sampling_params['ignore_eos'] must be a bool, got {ignore!r}")
    max_tokens = p.pop("max_tokens", p.pop("max_new_tokens", default_max_tokens))
    top_k = int(p.pop("top_k", -1))
    out = SamplingParams(temperature=float(p.pop("temperature", 1.0)), top_p=float(p.pop("top_p", 1.0)),
                         top_k=-1 if top_k == 0 else top_k, min_p=float(p.pop("min_p", 0.0)),
                         max_tokens=int(max_tokens), min_tokens=p.pop("min_tokens", 0),
                         logprobs=bool(p.pop("logprobs", False)),
                         seed=p.pop("seed", None), stop_token_ids=p.pop("stop_token_ids", None),
                         stop_at_eos=not ignore)
    if p:
        raise ValueError(f"sampling_params keys not supported by polynya's sampler: {sorted(p)}")
    return out


class PolynyaRolloutServer:
    """One replica's server: a ``SamplingEngine`` behind verl's server calls (module docstring).

    Args:
        config: verl ``RolloutConfig``; model_path: local model directory or HF id
        (``tiny:`` / ``random:`` specs too); replica_rank: the replica's index (its sampling
        seed, module docstring).
    """

    def __init__(self, config, model_path: str, replica_rank: int = 0) -> None:
        from polynya.engines import SamplingEngine

        self.config = config
        self.replica_rank = replica_rank
        self.engine = SamplingEngine(sampler_config(config, model_path, replica_rank))
        self.max_model_len = self.engine.config.max_model_len
        self.global_steps: int | None = None
        self.asleep = False
        self.gate = GenerationGate()  # abort / resume, as the HTTP server's /pause?mode=abort
        self.reject = False
        self._running: dict[int, str] = {}  # in-flight generate calls -> verl request id
        self._calls = itertools.count()

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data=None, video_data=None, **kwargs) -> TokenOutput:
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise ValueError("polynya's sampler takes text token ids only (no image/video/audio data)")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room to generate within "
                             f"max_model_len={self.max_model_len}")
        default = min(self.config.response_length, room)
        params = to_sampling_params(sampling_params, default, ignore_eos=self.config.ignore_eos)
        params.max_tokens = max(1, min(params.max_tokens, room))
        if self.gate.paused and self.reject:
            return self._aborted()
        sample = await self.gate.run(lambda: self._generate(list(prompt_ids), params, request_id))
        stop = {"stop": "completed", "length": "completed", "abort": "aborted"}[sample.finish_reason]
        return TokenOutput(token_ids=list(sample.token_ids), log_probs=sample.logprobs,
                           stop_reason=stop, extra_fields={"global_steps": self.global_steps})

    async def _generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str):
        if self.asleep:
            raise RuntimeError("the polynya rollout server is asleep: call wake_up() before generate()")
        key = next(self._calls)
        self._running[key] = request_id
        try:
            return (await self.engine.generate_async([prompt_ids], params))[0][0]
        finally:
            del self._running[key]

    def _aborted(self) -> TokenOutput:
        return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted",
                           extra_fields={"global_steps": self.global_steps})

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if self.asleep:
            self.engine.wake()
            self.asleep = False

    async def sleep(self) -> None:
        """Release the KV cache (``free_cache_engine``); generate() refuses until ``wake_up``."""
        if self.config.free_cache_engine and not self.asleep:
            self.engine.sleep(1)
            self.asleep = True

    async def abort_all_requests(self, reject_request: bool = False, **kwargs) -> dict[str, Any]:
        """Stop every request in flight (each answers with its partial output, ``stop_reason=
        "aborted"``) and hold (or, with ``reject_request``, refuse) new ones until
        ``resume_generation``; returns once none is in flight."""
        self.reject = reject_request
        request_ids = list(self._running.values())
        await self.gate.pause("abort", lambda: asyncio.to_thread(self.engine.abort))
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    async def resume_generation(self) -> None:
        self.reject = False
        self.gate.resume()

    async def clear_kv_cache(self) -> None:
        """Drop cached prefixes (the engine keeps none across weight versions either)."""
        if not self.asleep:
            self.engine.sleep(1)
            self.engine.wake()

    async def update_weights(self, pieces, global_steps: int | None = None) -> int:
        """New weights (``(name, tensor)`` pairs or flat buckets); the prefix cache is dropped."""
        version = self.engine.load_weights(pieces, version=global_steps)
        self.global_steps = global_steps
        return version


class PolynyaServerAdapter(BaseRollout):
    """Worker side of the ``polynya`` rollout: forwards to this replica's server actor."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        # one GPU per replica: the hybrid worker of rank r feeds replica r (as verl's vLLM adapter)
        self.replica_rank = int(os.environ.get("RANK", "0")) if replica_rank < 0 else replica_rank
        self.is_leader_rank = True
        self._server = None

    def _handle(self):
        if self._server is None:
            import ray

            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        await self._handle().wake_up.remote(tags=tags)

    async def release(self):
        await self._handle().sleep.remote()

    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps=None, **kwargs):
        if wire_format != "named_tensors":
            raise ValueError(f"polynya's rollout takes full weights (wire_format='named_tensors'), got {wire_format!r}")
        from verl.workers.rollout.utils import ensure_async_iterator

        pieces = [(name, t.detach().to("cpu", copy=True)) async for name, t in ensure_async_iterator(weights)]
        await self._handle().update_weights.remote(pieces, global_steps=global_steps)


class PolynyaReplica(RolloutReplica):
    """verl ``RolloutReplica`` running ``PolynyaRolloutServer`` (one GPU per replica)."""

    async def launch_servers(self):
        import ray

        if self.world_size != 1:
            raise ValueError("polynya's rollout replica is one GPU: set rollout.tensor_model_parallel_size=1")
        worker = self.workers[0]
        node_id, device = await worker.__ray_call__.remote(
            lambda w: (ray.get_runtime_context().get_node_id(),
                       (ray.get_runtime_context().get_accelerator_ids().get("GPU") or [""])[0]))
        env = {"CUDA_VISIBLE_DEVICES": str(device)} if device != "" else {}
        server = ray.remote(PolynyaRolloutServer).options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            runtime_env={"env_vars": env}, name=server_name(self.replica_rank, self.name_suffix),
            max_concurrency=self.max_concurrency,
        ).remote(self.config, self.model_config.local_path, self.replica_rank)
        self.servers = [server]
        self._server_handle = server
        self._server_address = server_name(self.replica_rank, self.name_suffix)  # no HTTP endpoint


_module_done()  # verl imported first by this module? finish the plugin's registration
