"""Ray actor bodies: one training rank, one sampler replica, one log-prob rank.

Plain classes (``ray.remote`` wraps them in ``polynya.client.ray_client``), so this module never
imports Ray. Each runs one engine in its own process; results cross back as plain data
(``TokenStats`` on the CPU, ``Sample`` lists, metric dicts). Weight-sync endpoints:

- trainer: ``manifest`` (every rank: ZeRO-3 gathers), ``export_shared`` / ``release_shared``
  (colocated: CUDA-IPC / shared memory), ``init_sync_group`` + ``send_weights`` (split);
- sampler and log-prob ranks: ``receive_shared`` / ``receive_broadcast`` through a
  ``WeightReceiver`` (stage, verify against the trainer's checksum, apply).
"""

from __future__ import annotations

import dataclasses
import os
import socket

import torch

from ..distributed import free_port
from ..sync import (
    SharedExport,
    SyncGroup,
    SyncManifest,
    apply_update,
    build_manifest,
    open_shared,
    recv_weights,
    send_weights,
)
from ..types import TokenStats


def actor_device(kind: str, threads: int = 1) -> str:
    """``"cuda"`` when this actor was given a GPU and ``kind`` allows it, else ``"cpu"`` (then
    torch computes on ``threads`` threads: ``RLClientConfig.cpu_threads``, default 1)."""
    if kind == "cuda" and torch.cuda.is_available():
        return "cuda:0"  # Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU
    torch.set_num_threads(threads)
    return "cpu"


def node_address() -> tuple[str, int]:
    """(this node's IP, a free port) for a rendezvous hosted by this actor."""
    try:
        import ray

        ip = ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        ip = socket.gethostbyname(socket.gethostname())
    return ip, free_port()


def _cpu(stats: TokenStats) -> TokenStats:
    return TokenStats(
        stats.logprobs.cpu(),
        None if stats.entropy is None else stats.entropy.cpu(),
        stats.mask.cpu(),
    )


def _set_rank_env(rank: int, world: int, addr: str, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK="0",
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )


def _replace_group(old: SyncGroup | None, host, port, rank, world, device, timeout_s,
                   peer_timeout_s) -> SyncGroup:
    """A new sync group for this actor (the client makes one after a failed sync: a lost
    member tears the old one down, ``SyncPeerLost``); an old one still up is closed first."""
    if old is not None:
        old.close()
    return SyncGroup(host, port, rank=rank, world_size=world, device=device, timeout_s=timeout_s,
                     peer_timeout_s=peer_timeout_s)


class WeightReceiver:
    """Receives syncs into ``engine`` (sampler or log-prob engine) for an actor."""

    def __init__(self, engine, device: str):
        self.engine, self.device = engine, device
        self.group: SyncGroup | None = None

    def init_group(self, host: str, port: int, rank: int, world: int, timeout_s: float,
                   peer_timeout_s: float) -> None:
        self.group = _replace_group(self.group, host, port, rank, world, self.device, timeout_s,
                                    peer_timeout_s)

    def receive_shared(self, manifest: SyncManifest, handles: list) -> int:
        opened = open_shared(manifest, handles, device=self.device)
        try:
            return apply_update(self.engine, opened.staged)
        finally:
            opened.close()

    def receive_broadcast(self, manifest: SyncManifest, num_senders: int) -> int:
        if self.group is None:
            raise RuntimeError("init_sync_group was never called on this receiver")
        staged = recv_weights(self.group, manifest, self.device, num_senders=num_senders)
        return apply_update(self.engine, staged)


class TrainerWorker:
    """One DeepSpeed training rank (plus an optional frozen reference ``LogProbEngine``)."""

    def __init__(
        self, train_cfg, reference_cfg, rank: int, world: int, addr: str, port: int, kind: str,
        threads: int = 1,
    ):
        from ..engines import LogProbEngine, TrainingEngine

        _set_rank_env(rank, world, addr, port)
        self.device = actor_device(kind, threads)
        self.engine = TrainingEngine(dataclasses.replace(train_cfg, device=self.device))
        self.reference = (
            LogProbEngine(dataclasses.replace(reference_cfg, device=self.device))
            if reference_cfg is not None
            else None
        )
        self._export: SharedExport | None = None
        self._group: SyncGroup | None = None
        self.rank = rank

    def ready(self) -> int:
        return self.rank

    def forward_backward(self, batch) -> dict:
        return self.engine.forward_backward(batch)

    def step(self) -> dict:
        return self.engine.step()

    def compute_logprobs(self, batch, model: str, entropy: bool, temperature) -> TokenStats:
        engine = self.engine if model == "policy" else self.reference
        if engine is None:
            raise ValueError("no reference model: set RLClientConfig(reference_model=True)")
        return _cpu(engine.compute_logprobs(batch, entropy=entropy, temperature=temperature))

    def offload(self) -> dict:
        return self.engine.offload()

    def make_room(self, nbytes: int) -> bool:
        return self.engine.make_room(nbytes)

    def onload(self) -> None:
        self.engine.onload()

    def save(self, path: str) -> None:
        self.engine.save(path)

    def load(self, path: str) -> None:
        self.engine.load(path)

    def weight_checksum(self) -> str:
        return self.engine.weight_checksum()

    def manifest(self, version: int, bucket_bytes: int, layout: str = "packed") -> SyncManifest:
        return build_manifest(
            self.engine, version=version, bucket_bytes=bucket_bytes, layout=layout
        )

    def export_shared(self, manifest: SyncManifest, bucket_bytes: int, share: bool = True) -> list:
        self.release_shared()
        self._export = SharedExport.from_trainer(self.engine, manifest, bucket_bytes, share=share)
        return self._export.handles

    def release_shared(self) -> None:
        if self._export is not None:
            self._export.release()
            self._export = None
            if self.device != "cpu":
                torch.cuda.empty_cache()

    def sync_address(self) -> tuple[str, int]:
        return node_address()

    def init_sync_group(
        self, host: str, port: int, rank: int, world: int, timeout_s: float, peer_timeout_s: float
    ) -> None:
        self._group = _replace_group(self._group, host, port, rank, world, self.device, timeout_s,
                                     peer_timeout_s)

    def send_weights(self, manifest: SyncManifest, bucket_bytes: int, num_senders: int) -> int:
        if self._group is None:
            raise RuntimeError("init_sync_group was never called on this trainer rank")
        return send_weights(
            self._group, self.engine, manifest, bucket_bytes, num_senders=num_senders
        )


class _ReceivingWorker:
    """What every actor that receives weight syncs answers: readiness, its checksum, and the
    sync calls, delegated to its ``WeightReceiver`` (subclasses set ``engine`` and ``receiver``)."""

    engine: object
    receiver: WeightReceiver

    def ready(self) -> bool:
        return True

    def weight_checksum(self) -> str:
        return self.engine.weight_checksum()

    def init_sync_group(self, host, port, rank, world, timeout_s, peer_timeout_s) -> None:
        self.receiver.init_group(host, port, rank, world, timeout_s, peer_timeout_s)

    def receive_shared(self, manifest, handles) -> int:
        return self.receiver.receive_shared(manifest, handles)

    def receive_broadcast(self, manifest, num_senders: int) -> int:
        return self.receiver.receive_broadcast(manifest, num_senders)


class SamplerWorker(_ReceivingWorker):
    """One sampler replica."""

    def __init__(self, sampler_cfg, kind: str, threads: int = 1):
        from ..engines import SamplingEngine

        self.device = actor_device(kind, threads)
        self.engine = SamplingEngine(dataclasses.replace(sampler_cfg, device=self.device))
        self.receiver = WeightReceiver(self.engine, self.device)

    def generate(self, prompts, params) -> list:
        return self.engine.generate(prompts, params)

    def validate(self, prompts, params) -> None:
        """``generate``'s checks alone (``ValueError`` naming the caller's prompt index): run on
        one replica before a call is split over several, whose errors would name their share's."""
        self.engine.validate(prompts, params)

    def sleep(self, level: int) -> None:
        self.engine.sleep(level)

    def wake(self) -> None:
        self.engine.wake()

    def room_bytes(self, level: int) -> int | None:
        return self.engine.room_bytes(level)

    def stats(self) -> dict:
        return self.engine.stats()

    def pid(self) -> int:
        return os.getpid()


class LogProbWorker(_ReceivingWorker):
    """One log-prob rank: the synced old-policy engine, plus an optional frozen reference."""

    def __init__(
        self, logprob_cfg, reference: bool, rank: int, world: int, addr: str, port: int, kind: str,
        threads: int = 1,
    ):
        from ..engines import LogProbEngine

        _set_rank_env(rank, world, addr, port)
        self.device = actor_device(kind, threads)
        cfg = dataclasses.replace(logprob_cfg, device=self.device)
        self.engine = LogProbEngine(cfg)
        self.reference = LogProbEngine(cfg) if reference else None
        self.receiver = WeightReceiver(self.engine, self.device)

    def compute_logprobs(self, batch, model: str, entropy: bool, temperature) -> TokenStats:
        engine = self.engine if model == "policy" else self.reference
        if engine is None:
            raise ValueError("no reference model: set RLClientConfig(reference_model=True)")
        return _cpu(engine.compute_logprobs(batch, entropy=entropy, temperature=temperature))

    def sleep(self, level: int) -> None:
        self.engine.sleep(level)

    def wake(self) -> None:
        self.engine.wake()

