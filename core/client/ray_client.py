"""``RayClient``: engines as Ray actors (``comm_protocol="ray"``, needs ``polynya[ray]``).

One ``TrainerWorker`` per training rank (the DeepSpeed ranks rendezvous among themselves at an
address on bundle 0's node), ``sampling_gpus`` ``SamplerWorker`` replicas and ``log_prob_gpus``
``LogProbWorker`` ranks, placed by ``polynya.cluster.placement`` (colocated: fractional shares
of one bundle per GPU; split: a bundle each). Prompt groups are routed to one replica each.

Each call is written once as a *plan*: a generator that yields lists of Ray object refs and
receives their values. ``_run`` drives a plan with ``ray.get`` (sync API) and ``_arun`` with
``await`` (async API), both bounded by ``timeout_s``; a dead actor or a timeout raises
``EngineError`` at the client instead of hanging; an exception an engine raised arrives as itself
(type and message as with the local client; the actor's traceback in its notes). Weight sync: colocated = the trainer ranks'
CUDA-IPC / shared-memory buckets, each replica reading the ones of its own GPU; split = a
broadcast group (trainer ranks + every receiver) set up on the first sync, and again on the sync
after one that failed (a member lost mid-sync raises ``SyncPeerLost`` in every other member
within ``SyncGroup``'s ``peer_timeout_s`` and tears the group down; the version does not move).
A dead actor is not replaced: the next sync's group set-up reports it (``EngineError``).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Generator, Sequence

from ..cluster.placement import GENERATE_GROUP, create_placement_group, plan_layout, start_actors
from ..cluster.routing import ReplicaRouter, merge_routed
from ..coordination import Action, HandOver
from ..coordination.handover import LOGPROB, SAMPLERS, SLEEP_LEVELS, TRAINER, sampler_room
from ..types import RolloutBatch, Sample, SamplingParams, TokenSeq, TokenStats
from .api import ClientLifecycle, EngineError, check_logprob_model
from .config import RLClientConfig
from .local import split_params

Plan = Generator[list, list, Any]


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError("comm_protocol='ray' needs Ray: pip install 'polynya[ray]'") from exc
    return ray


CPU_DEVICE = "polynya_cpu_device"


def _cpu_fallback(ray, cfg: RLClientConfig) -> RLClientConfig:
    """Start (or join) Ray; on a machine without GPUs that starts its own cluster, let a custom
    resource stand for each device so the same placements run on the CPU."""
    import torch

    local_cpu = cfg.ray_address is None and not ray.is_initialized() and (
        cfg.device == "cpu" or not torch.cuda.is_available())
    if not ray.is_initialized():
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        extra = {}
        if local_cpu and cfg.device_resource == "GPU":
            devices = cfg.training_gpus if cfg.colocate else (
                cfg.training_gpus + cfg.sampling_gpus + cfg.log_prob_gpus)
            extra = {"resources": {CPU_DEVICE: devices}}
            cfg = cfg.replace(device_resource=CPU_DEVICE, device="cpu")
        ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=False, **extra)
    return cfg


class RayClient(ClientLifecycle):
    """Client over Ray actors (module docstring)."""

    def __init__(self, config: RLClientConfig):
        ray = self.ray = _import_ray()
        self.config = cfg = config
        cfg = self.config = _cpu_fallback(ray, cfg)
        self.layout = plan_layout(cfg.training_gpus, cfg.sampling_gpus, cfg.log_prob_gpus,
                                  cfg.colocate, cfg.device_resource)
        have = ray.cluster_resources().get(cfg.device_resource, 0)
        if have < len(self.layout.bundles):
            raise ValueError(f"the Ray cluster has {have:g} {cfg.device_resource!r} but this placement needs "
                             f"{len(self.layout.bundles)}: lower training/sampling/log_prob GPUs, use "
                             "colocate=True, or start Ray with more devices")
        self.pg = create_placement_group(self.layout, cfg.timeout_s)
        self.trainers, self.samplers, self.logprobs = [], [], []
        self._router = ReplicaRouter(cfg.sampling_gpus)  # spreads concurrent generate calls
        self._closed = False
        try:
            self.trainers, self.samplers, self.logprobs = start_actors(cfg, self.layout, self.pg)
            self._run(self._plan_ready(), "starting the engines")
            room = self._run(self._plan_room(), "asking the samplers' room")
        except BaseException:
            self.shutdown()  # no actor or placement group outlives a failed start
            raise
        self.handover = HandOver(colocate=cfg.colocate,
                                 trainer_offloads=cfg.trainer_offloads,
                                 has_logprob=bool(self.logprobs), sampler_room=room)
        self._group_ready = False

    # ------------------------------------------------------------------ driving plans
    def _wrap(self, exc: BaseException, what: str) -> BaseException:
        ray = self.ray
        dead = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                ray.exceptions.WorkerCrashedError, asyncio.TimeoutError)
        if isinstance(exc, dead):
            return EngineError(f"{what} failed: {type(exc).__name__}: {exc}")
        cause = getattr(exc, "cause", None)
        if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, Exception):
            # the engine's own exception, as the local client raises it (not Ray's
            # ``RayTaskError(ValueError)`` whose message is the actor's traceback)
            if hasattr(cause, "add_note"):  # Python >= 3.11
                cause.add_note(f"raised in a Ray actor: {exc}")
            return cause
        return exc

    def _run(self, plan: Plan, what: str = "engine call"):
        if self._closed:
            raise RuntimeError("the client is shut down")
        try:
            refs = next(plan)
            while True:
                try:
                    values = self.ray.get(refs, timeout=self.config.timeout_s)
                except Exception as exc:  # hand the error to the plan (cleanup), then raise it
                    refs = plan.throw(self._wrap(exc, what))
                    continue
                refs = plan.send(values)
        except StopIteration as stop:
            return stop.value
        finally:  # an interrupt (or a cancelled task, below) leaves the plan mid-way: its
            plan.close()  # cleanup (a routed call's share of the router's load) runs now

    async def _arun(self, plan: Plan, what: str = "engine call"):
        if self._closed:
            raise RuntimeError("the client is shut down")
        try:
            refs = next(plan)
            while True:
                try:
                    values = await asyncio.wait_for(asyncio.gather(*refs), self.config.timeout_s)
                except Exception as exc:
                    refs = plan.throw(self._wrap(exc, what))
                    continue
                refs = plan.send(list(values))
        except StopIteration as stop:
            return stop.value
        finally:
            plan.close()

    # ------------------------------------------------------------------ plans
    def _plan_ready(self) -> Plan:
        yield [a.ready.remote() for a in self.trainers + self.samplers + self.logprobs]

    def _plan_room(self) -> Plan:
        """The hand-over's ``sampler_room``: colocated, each GPU holds one sampler replica
        next to its training rank, so a rank needs room for one sampler (the largest)."""
        n = len(self.samplers)
        values = yield [s.room_bytes.remote(lv) for lv in SLEEP_LEVELS for s in self.samplers]
        return sampler_room({lv: values[i * n:(i + 1) * n] for i, lv in enumerate(SLEEP_LEVELS)},
                            max)

    @property
    def version(self) -> int:
        """The last weight version every receiver accepted."""
        return self.handover.version

    def _actors(self, role: str) -> list:
        return {TRAINER: self.trainers, SAMPLERS: self.samplers, LOGPROB: self.logprobs}[role]

    def _plan_actions(self, actions: list[Action]) -> Plan:
        """Execute a ``HandOver`` plan on the actors, one action (all its actors) at a time."""
        for action in actions:
            results = yield [getattr(a, action.method).remote(*action.args)
                             for a in self._actors(action.role)]
            self.handover.done(action, results)

    def _plan_to_sampler(self) -> Plan:
        yield from self._plan_actions(self.handover.to_sampling())

    def _plan_to_trainer(self) -> Plan:
        yield from self._plan_actions(self.handover.to_training())

    def _plan_generate(self, prompts, params) -> Plan:
        yield from self._plan_to_sampler()
        if len(self.samplers) > 1:  # errors name the caller's index, and no share runs first
            yield [self.samplers[0].validate.options(concurrency_group=GENERATE_GROUP).remote(
                prompts, params)]
        with self._router.route(prompts, params) as routes:
            used = [(s, idx) for s, idx in zip(self.samplers, routes) if idx]
            results = yield [
                s.generate.options(concurrency_group=GENERATE_GROUP).remote(
                    [prompts[i] for i in idx], split_params(params, idx))
                for s, idx in used
            ]
        return merge_routed([idx for _, idx in used], results, len(prompts))

    def _plan_logprobs(self, batch, model, entropy, temperature) -> Plan:
        check_logprob_model(model)
        if model == "reference" and not self.config.reference_model:
            raise ValueError("no reference model: set RLClientConfig(reference_model=True)")
        yield from self._plan_to_trainer()
        actors = self.logprobs or self.trainers
        out = yield [a.compute_logprobs.remote(batch, model, entropy, temperature) for a in actors]
        return out[0]

    def _plan_train(self, method: str, *args) -> Plan:
        yield from self._plan_to_trainer()
        out = yield [getattr(t, method).remote(*args) for t in self.trainers]
        self.handover.trained(method)
        return out[0]

    def _plan_sync(self) -> Plan:
        cfg, bb = self.config, self.config.bucket_bytes
        yield from self._plan_to_trainer()
        t0 = time.perf_counter()
        plan = self.handover.begin_sync(in_process=False)
        manifests = yield [t.manifest.remote(plan.version, bb, plan.layout) for t in self.trainers]
        manifest = manifests[0]
        receivers = self.samplers + self.logprobs
        if cfg.colocate:
            method = (
                "shared_memory"
                if cfg.device_resource != "GPU" or cfg.device == "cpu"
                else "cuda_ipc"
            )
            handles = yield [t.export_shared.remote(manifest, bb) for t in self.trainers]
            try:
                rank_of = list(range(len(self.samplers))) + list(range(len(self.logprobs)))
                yield [
                    r.receive_shared.remote(manifest, handles[g])
                    for r, g in zip(receivers, rank_of)
                ]
            finally:
                yield [t.release_shared.remote() for t in self.trainers]
        else:
            method = "broadcast"
            if not self._group_ready:
                yield from self._plan_group(receivers)
            n = len(self.trainers)
            try:
                yield (
                    [t.send_weights.remote(manifest, bb, n) for t in self.trainers]
                    + [r.receive_broadcast.remote(manifest, n) for r in receivers]
                )
            except BaseException:  # a lost member tore the group down (SyncPeerLost, bounded):
                self._group_ready = False  # the next sync makes a new one on a new port
                raise
        self.handover.synced(plan)
        return {
            "version": manifest.version,
            "checksum": manifest.checksum,
            "bytes": manifest.nbytes,
            "buckets": len(manifest.buckets),
            "receivers": len(receivers),
            "method": method,
            "seconds": time.perf_counter() - t0,
        }

    def _plan_group(self, receivers) -> Plan:
        ((host, port),) = yield [self.trainers[0].sync_address.remote()]
        members = self.trainers + receivers
        yield [
            m.init_sync_group.remote(host, port, r, len(members), self.config.timeout_s,
                                     self.config.sync_peer_timeout_s)
            for r, m in enumerate(members)
        ]
        self._group_ready = True

    def _plan_sleep(self, engine: str, level: int) -> Plan:
        yield from self._plan_actions(self.handover.sleep(engine, level))

    def _plan_wake(self, engine: str) -> Plan:
        yield from self._plan_actions(self.handover.wake(engine))

    def _plan_checksums(self) -> Plan:
        yield from self._plan_to_trainer()
        t = yield [a.weight_checksum.remote() for a in self.trainers]
        s = yield [a.weight_checksum.remote() for a in self.samplers]
        lp = (yield [a.weight_checksum.remote() for a in self.logprobs]) if self.logprobs else []
        st = yield [a.stats.remote() for a in self.samplers]
        return {
            "trainer": t[0],
            "samplers": s,
            "logprob": lp,
            "versions": [x["weight_version"] for x in st],
            "version": self.version,
        }

    # ------------------------------------------------------------------ sync API
    def generate(
        self, prompts: Sequence[TokenSeq], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[list[Sample]]:
        return self._run(self._plan_generate(prompts, params), "generate")

    def compute_logprobs(
        self,
        batch: RolloutBatch,
        *,
        model: str = "policy",
        entropy: bool = False,
        temperature: float | None = None,
    ) -> TokenStats:
        return self._run(
            self._plan_logprobs(batch, model, entropy, temperature), "compute_logprobs"
        )

    def forward_backward(self, batch: RolloutBatch) -> dict[str, float]:
        return self._run(self._plan_train("forward_backward", batch), "forward_backward")

    def step(self) -> dict[str, float]:
        return self._run(self._plan_train("step"), "step")

    def sync_weights(self) -> dict[str, Any]:
        return self._run(self._plan_sync(), "sync_weights")

    def sleep(self, engine: str = "sampler", level: int = 1) -> None:
        self._run(self._plan_sleep(engine, level), f"sleep({engine})")

    def wake(self, engine: str = "sampler") -> None:
        self._run(self._plan_wake(engine), f"wake({engine})")

    def save(self, path: str) -> None:
        self._run(self._plan_train("save", path), "save")

    def load(self, path: str) -> None:
        self._run(self._plan_train("load", path), "load")

    def weight_checksums(self) -> dict[str, Any]:
        return self._run(self._plan_checksums(), "weight_checksums")

    # ------------------------------------------------------------------ async API
    async def generate_async(self, prompts, params) -> list[list[Sample]]:
        return await self._arun(self._plan_generate(prompts, params), "generate")

    async def compute_logprobs_async(
        self, batch, *, model="policy", entropy=False, temperature=None
    ):
        return await self._arun(
            self._plan_logprobs(batch, model, entropy, temperature), "compute_logprobs"
        )

    async def forward_backward_async(self, batch) -> dict[str, float]:
        return await self._arun(self._plan_train("forward_backward", batch), "forward_backward")

    async def step_async(self) -> dict[str, float]:
        return await self._arun(self._plan_train("step"), "step")

    async def sync_weights_async(self) -> dict[str, Any]:
        return await self._arun(self._plan_sync(), "sync_weights")

    async def sleep_async(self, engine: str = "sampler", level: int = 1) -> None:
        await self._arun(self._plan_sleep(engine, level), f"sleep({engine})")

    async def wake_async(self, engine: str = "sampler") -> None:
        await self._arun(self._plan_wake(engine), f"wake({engine})")

    async def save_async(self, path: str) -> None:
        await self._arun(self._plan_train("save", path), "save")

    async def load_async(self, path: str) -> None:
        await self._arun(self._plan_train("load", path), "load")

    async def weight_checksums_async(self) -> dict[str, Any]:
        return await self._arun(self._plan_checksums(), "weight_checksums")

    # ------------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for a in self.trainers + self.samplers + self.logprobs:
            try:
                self.ray.kill(a)
            except Exception:  # already dead
                pass
        try:
            self.ray.util.remove_placement_group(self.pg)
        except Exception:
            pass
