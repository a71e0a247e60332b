"""``LocalClient``: the three engines in this process (``comm_protocol="local"``).

One training rank, ``sampling_gpus`` sampler replicas, an optional log-prob engine
(``log_prob_gpus > 0``) and an optional frozen reference. Devices: everything on the CPU when
there is no GPU (or ``device="cpu"``); colocated = everything on ``cuda:0``, taking turns as ``polynya.coordination.HandOver``
decides (this client only runs its plans on the engines);
split = trainer on ``cuda:0``, samplers and log-prob engine on the following GPUs.

``sync_weights`` hands the trainer's flat buckets straight to every receiver's ``StagedUpdate``
(no transport in one process), verifies them against the trainer's ``weight_checksum()`` and
applies them under a new version (``polynya.sync``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from ..cluster.routing import ReplicaRouter, merge_routed
from ..coordination import Action, HandOver
from ..coordination.handover import LOGPROB, SAMPLERS, SLEEP_LEVELS, TRAINER, sampler_room
from ..sync import StagedUpdate, apply_update, build_manifest
from ..sync.manifest import flat_spans
from ..types import RolloutBatch, Sample, SamplingParams, TokenSeq, TokenStats
from .api import ThreadedAsync, check_logprob_model
from .config import RLClientConfig


def local_devices(cfg: RLClientConfig) -> tuple[str, list[str], str]:
    """(trainer, [sampler replicas], log-prob) devices of a local client."""
    if cfg.device == "cpu" or not torch.cuda.is_available():
        return "cpu", ["cpu"] * cfg.sampling_gpus, "cpu"
    if cfg.colocate:
        return "cuda:0", ["cuda:0"] * cfg.sampling_gpus, "cuda:0"
    need = 1 + cfg.sampling_gpus + (1 if cfg.log_prob_gpus else 0)
    if torch.cuda.device_count() < need:
        raise ValueError(
            f"colocate=False needs {need} GPUs here (trainer, {cfg.sampling_gpus} samplers"
            f"{', log-prob' if cfg.log_prob_gpus else ''}); {torch.cuda.device_count()} visible"
        )
    samplers = [f"cuda:{1 + i}" for i in range(cfg.sampling_gpus)]
    return "cuda:0", samplers, f"cuda:{1 + cfg.sampling_gpus}"


def to_cpu_stats(stats: TokenStats) -> TokenStats:
    return TokenStats(
        stats.logprobs.detach().cpu(),
        None if stats.entropy is None else stats.entropy.detach().cpu(),
        stats.mask.detach().cpu(),
    )


def split_params(params, idx: list[int]):
    return params if isinstance(params, SamplingParams) else [params[i] for i in idx]


class LocalClient(ThreadedAsync):
    """In-process engines behind the client API (module docstring)."""

    def __init__(self, config: RLClientConfig):
        from ..engines import LogProbEngine, SamplingEngine, TrainingEngine

        if config.training_gpus != 1:
            raise ValueError(
                "comm_protocol='local' runs one training rank; use 'ray' for training_gpus > 1"
            )
        self.config = config
        t_dev, s_devs, l_dev = local_devices(config)
        self.trainer = TrainingEngine(dataclasses.replace(config.train, device=t_dev))
        self.samplers = [
            SamplingEngine(dataclasses.replace(config.sampling, device=d)) for d in s_devs
        ]
        lp_cfg = dataclasses.replace(config.logprob, device=l_dev)
        self.logprob = LogProbEngine(lp_cfg) if config.log_prob_gpus else None
        self.reference = (
            LogProbEngine(dataclasses.replace(lp_cfg, device=t_dev))
            if config.reference_model
            else None
        )
        self.handover = HandOver(colocate=config.colocate,
                                 trainer_offloads=config.trainer_offloads,
                                 has_logprob=self.logprob is not None,
                                 sampler_room=sampler_room(
                                     {lv: [s.room_bytes(lv) for s in self.samplers]
                                      for lv in SLEEP_LEVELS}, sum))
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._generating = 0
        # concurrent generate calls batch in the engines only when each has a thread: the
        # default executor (min(32, cores + 4) threads) would cap them far below a batch
        slots = max(1, len(self.samplers)) * config.sampling.call_slots
        self._calls = ThreadPoolExecutor(slots, thread_name_prefix="polynya-generate")
        self._pool = ThreadPoolExecutor(slots, thread_name_prefix="polynya-local")  # replica fan-out
        self._router = ReplicaRouter(len(self.samplers))  # spreads concurrent calls
        # aborts wait for an engine step boundary: on threads of their own, since the generate
        # pools may be full of the very calls they have to stop
        self._abort_pool = ThreadPoolExecutor(2, thread_name_prefix="polynya-abort")
        self._closed = False

    # ------------------------------------------------------------------ hand-over
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the client is shut down")

    def _engines(self, role: str) -> list:
        return {TRAINER: [self.trainer], SAMPLERS: self.samplers,
                LOGPROB: [self.logprob] if self.logprob is not None else []}[role]

    def _run(self, plan: list[Action]) -> None:
        """Execute a ``HandOver`` plan in this process (caller holds the lock)."""
        for action in plan:
            if action.role == SAMPLERS and action.method == "sleep":
                while self._generating:  # never free the KV cache under a running generate
                    self._idle.wait()
            results = [getattr(engine, action.method)(*action.args)
                       for engine in self._engines(action.role)]
            self.handover.done(action, results)

    def _to_sampler(self) -> None:
        self._run(self.handover.to_sampling())

    def _to_trainer(self) -> None:
        self._run(self.handover.to_training())

    @property
    def version(self) -> int:
        """The last weight version every receiver accepted."""
        return self.handover.version

    # ------------------------------------------------------------------ API
    def generate(
        self, prompts: Sequence[TokenSeq], params: SamplingParams | Sequence[SamplingParams],
        *, request_id: str | None = None,
    ) -> list[list[Sample]]:
        """``n`` samples per prompt, prompt groups routed to one replica each; ``request_id``
        names the call for ``abort`` (``SamplingEngine.generate``), from the moment it is made:
        an abort while it waits for the hand-over stops it as it reaches the samplers."""
        with self._named(request_id):
            return self._generate(prompts, params, request_id)

    async def generate_async(self, prompts, params, *, request_id: str | None = None
                             ) -> list[list[Sample]]:
        """``generate`` off the event loop. Cancelling the awaiting task aborts the call in the
        engine (its requests stop at the next step, their pages are freed) and re-raises once
        the engine has let go of them; an unnamed call gets a name of its own for that."""
        name = request_id if request_id is not None else f"local-{uuid.uuid4().hex}"
        with self._named(name):  # named before the thread hop: an abort may come first
            loop = asyncio.get_running_loop()
            work = asyncio.ensure_future(
                loop.run_in_executor(self._calls, self._generate, prompts, params, name))
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                await asyncio.get_running_loop().run_in_executor(self._abort_pool, self.abort, [name])
                with contextlib.suppress(Exception):  # the partial samples go to nobody
                    await work
                raise

    @contextlib.contextmanager
    def _named(self, request_id: str | None):
        """``request_id`` reserved on every replica for the duration of one generate call."""
        reserved = []
        try:
            if request_id is not None:
                for s in self.samplers:
                    s.reserve(request_id)
                    reserved.append(s)
            yield
        finally:
            for s in reserved:
                s.release(request_id)

    def _generate(self, prompts, params, request_id: str | None) -> list[list[Sample]]:
        with self._lock:
            self._check_open()
            self._to_sampler()
            self._generating += 1
        try:
            if len(self.samplers) == 1:
                return self.samplers[0].generate(prompts, params, request_id=request_id)
            self.samplers[0].validate(prompts, params)  # errors name the caller's index
            with self._router.route(prompts, params) as routes:
                used = [(s, idx) for s, idx in zip(self.samplers, routes) if idx]
                futs = [self._pool.submit(s.generate, [prompts[i] for i in idx],
                                          split_params(params, idx), request_id=request_id)
                        for s, idx in used]
                concurrent.futures.wait(futs, return_when=concurrent.futures.FIRST_EXCEPTION)
                failed = next((f.exception() for f in futs if f.done() and f.exception()), None)
                if failed is not None and request_id is not None:
                    for s, _ in used:  # stop the other shares of the call
                        s.abort([request_id])
                concurrent.futures.wait(futs)  # the call's load is held until every share is done
                results = [f.result() for f in futs]  # raises the first failure
            return merge_routed([idx for _, idx in used], results, len(prompts))
        finally:
            with self._lock:
                self._generating -= 1
                self._idle.notify_all()

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """Stop the ``generate`` calls named ``request_ids`` (``None``: every request) on every
        replica at its next step boundary (``SamplingEngine.abort``): they return what they
        sampled so far (``finish_reason="abort"``). Returns the engine requests stopped."""
        if request_ids is not None and not isinstance(request_ids, str):
            request_ids = list(request_ids)  # each replica reads them (a str: the facade refuses)
        return sum(s.abort(request_ids) for s in self.samplers)

    def prompt_logprobs(self, sequences: Sequence[TokenSeq], *, top_k: int = 0,
                        temperature: float = 1.0) -> list:
        """Scores of given sequences on the first sampler's weights (``SamplingEngine.
        prompt_logprobs``), with the same hand-over as ``generate``."""
        with self._lock:
            self._check_open()
            self._to_sampler()
            self._generating += 1
        try:
            return self.samplers[0].prompt_logprobs(sequences, top_k=top_k, temperature=temperature)
        finally:
            with self._lock:
                self._generating -= 1
                self._idle.notify_all()

    async def prompt_logprobs_async(self, sequences: Sequence[TokenSeq], **kw) -> list:
        return await asyncio.to_thread(lambda: self.prompt_logprobs(sequences, **kw))

    def compute_logprobs(
        self,
        batch: RolloutBatch,
        *,
        model: str = "policy",
        entropy: bool = False,
        temperature: float | None = None,
    ) -> TokenStats:
        """Old-policy (``"policy"``: log-prob engine, else the trainer) or ``"reference"`` log-probs."""
        check_logprob_model(model)
        if model == "reference" and self.reference is None:
            raise ValueError("no reference model: set RLClientConfig(reference_model=True)")
        engine = self.reference if model == "reference" else (self.logprob or self.trainer)
        with self._lock:
            self._check_open()
            self._to_trainer()
            return to_cpu_stats(
                engine.compute_logprobs(batch, entropy=entropy, temperature=temperature)
            )

    def forward_backward(self, batch: RolloutBatch) -> dict[str, float]:
        with self._lock:
            self._check_open()
            self._to_trainer()
            out = self.trainer.forward_backward(batch)
            self.handover.trained("forward_backward")  # resident until step() applies them
            return out

    def step(self) -> dict[str, float]:
        with self._lock:
            self._check_open()
            self._to_trainer()
            out = self.trainer.step()
            self.handover.trained("step")
            return out

    def sync_weights(self) -> dict[str, Any]:
        """Push the trainer's weights to every sampler (and log-prob engine) under a new version."""
        with self._lock:
            self._check_open()
            self._to_trainer()
            t0 = time.perf_counter()
            bb = self.config.bucket_bytes
            plan = self.handover.begin_sync(in_process=True)
            manifest = build_manifest(
                self.trainer, version=plan.version, bucket_bytes=bb, layout=plan.layout
            )
            t_manifest = time.perf_counter() - t0
            receivers = list(self.samplers) + ([self.logprob] if self.logprob is not None else [])
            staged = [StagedUpdate(manifest) for _ in receivers]
            devices = [r.device for r in receivers]
            spans = (
                flat_spans(self.trainer.module) if manifest.buckets[0].offsets is not None else None
            )
            buckets = (
                (span for span, _ in spans)
                if spans is not None
                else (flat for _, flat in self.trainer.export_weights(bb))
            )
            for i, flat in enumerate(buckets):  # spans: the trainer's own storage, no packing
                for st, dev in zip(staged, devices):
                    st.put(i, flat.to(dev))
            for r, st in zip(receivers, staged):
                apply_update(r, st)
            self.handover.synced(plan)
            return {
                "version": manifest.version,
                "checksum": manifest.checksum,
                "bytes": manifest.nbytes,
                "buckets": len(manifest.buckets),
                "receivers": len(receivers),
                "method": "direct_spans" if spans is not None else "direct",
                "manifest_s": t_manifest,
                "seconds": time.perf_counter() - t0,
            }

    def sleep(self, engine: str = "sampler", level: int = 1) -> None:
        with self._lock:
            self._check_open()
            self._run(self.handover.sleep(engine, level))

    @property
    def sampler_asleep(self) -> bool:
        """True between ``sleep("sampler")`` and the next ``wake``/``generate``."""
        return self.handover.sampler_sleep != 0

    def wake(self, engine: str = "sampler") -> None:
        with self._lock:
            self._check_open()
            self._run(self.handover.wake(engine))

    def save(self, path: str) -> None:
        with self._lock:
            self._check_open()
            self._to_trainer()
            self.trainer.save(path)

    def load(self, path: str) -> None:
        with self._lock:
            self._check_open()
            self._to_trainer()
            self.trainer.load(path)
            self.handover.trained("load")

    def weight_checksums(self) -> dict[str, Any]:
        """``weight_checksum`` of the trainer and every receiver, and the served versions."""
        with self._lock:
            self._check_open()
            self._to_trainer()
            return {
                "trainer": self.trainer.weight_checksum(),
                "samplers": [s.weight_checksum() for s in self.samplers],
                "logprob": [self.logprob.weight_checksum()] if self.logprob is not None else [],
                "versions": [s.weight_version for s in self.samplers],
                "version": self.version,
            }

    def stats(self) -> dict[str, Any]:
        return {"version": self.version, "samplers": [s.stats() for s in self.samplers]}

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for s in self.samplers:
                s.shutdown()
            for pool in (self._calls, self._pool, self._abort_pool):
                pool.shutdown(wait=False)

