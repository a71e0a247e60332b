"""verl checkpoint engine ``polynya``: trainer -> rollout weight broadcast, checksum-verified.

verl moves weights through a ``CheckpointEngine`` (``rollout.checkpoint_engine.backend``): actor
rank 0 streams the trainer's ``(name, tensor)`` generator, every rollout worker receives it and
hands it to its server adapter. This backend runs that stream over polynya's ``SyncGroup`` (its
own process group: NCCL on CUDA, gloo on CPU) and keeps polynya's guarantee: a receiver stages
every bucket, recomputes the checksum of what arrived (``StagedUpdate.checksum``, the digest of
``polynya.distributed.checksum_named_tensors``) and compares it with the sender's before
yielding a single tensor; any difference raises ``polynya.sync.SyncError`` and nothing is applied.

Wire format per sync: for each bucket a JSON header (names, shapes, dtype) then the flat bucket
(consecutive tensors up to ``bucket_size`` bytes, a larger tensor alone); then a closing header
with the sender's checksum. Only actor rank 0 sends; the other actor ranks consume their
generator (ZeRO-3 gathers need every rank) and sit the broadcast out, as verl's NCCL engine does.

Every wait is bounded (``SyncGroup.wait``): a member that dies or stalls mid-sync ends it with
``polynya.sync.SyncPeerLost`` in the others within ``peer_timeout_s`` (the group is torn down; a
receiver yields nothing, its ``last_checksum`` is unchanged); make a new group to sync again.
"""
from __future__ import annotations

from . import _module_done

import json
import socket
from collections.abc import AsyncIterator, Iterable

import torch
from polynya.checksum import combine_signatures, tensor_signature
from polynya.distributed import free_port
from polynya.sync import BucketSpec, StagedUpdate, SyncError, SyncGroup, SyncManifest
from polynya.sync.broadcast import peer_lost
from polynya.sync.liveness import PeerFailure
from verl.checkpoint_engine.base import CheckpointEngine

SENDER = 0


class PolynyaCheckpointEngine(CheckpointEngine):
    """A verl ``CheckpointEngine`` over polynya's ``SyncGroup`` (module docstring).

    Args:
        bucket_size: bytes per broadcast bucket (verl's ``update_weights_bucket_megabytes``).
        is_master: actor rank 0 (hosts the group's store and sends).
        device: transport device; ``None`` = CUDA when available, else CPU (gloo).
        host: address the master advertises; ``None`` = this host's address.
        peer_timeout_s: a member silent this long (killed, stopped) ends the sync with
            ``polynya.sync.SyncPeerLost`` in every other member (``SyncGroup``).
        timeout_s: a collective that makes no progress this long while all members beat
            ends the sync with ``SyncPeerLost`` too.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, device: str | None = None,
                 host: str | None = None, peer_timeout_s: float = 30.0,
                 timeout_s: float = 300.0) -> None:
        if not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"bucket_size must be a positive number of bytes, got {bucket_size!r}")
        for name, value in (("peer_timeout_s", peer_timeout_s), ("timeout_s", timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.host = host
        self.peer_timeout_s, self.timeout_s = peer_timeout_s, timeout_s
        self.rank: int | None = None
        self.group: SyncGroup | None = None
        self.last_checksum: str | None = None

    # ------------------------------------------------------------------ topology
    def prepare(self) -> dict:
        """The master's rendezvous address (``{}`` on other workers)."""
        if not self.is_master:
            return {}
        host = self.host or socket.gethostbyname(socket.gethostname())
        return {"host": host, "port": free_port()}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        master = metadata[0]
        if not master.get("host"):
            raise ValueError("actor rank 0 must be the checkpoint engine master (is_master=True)")
        world = 1 + rollout_world_size
        actor = {"rank": [SENDER] + [-1] * (actor_wg_world_size - 1),
                 "world_size": [world] * actor_wg_world_size, "master": [master] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                   "master": [master] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master: dict) -> None:
        self.rank = rank
        if rank >= 0:
            self.group = SyncGroup(master["host"], master["port"], rank=rank, world_size=world_size,
                                   device=self.device, peer_timeout_s=self.peer_timeout_s,
                                   timeout_s=self.timeout_s)

    def finalize(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.rank = None, None

    # ------------------------------------------------------------------ wire
    def _broadcast(self, tensor: torch.Tensor) -> None:
        """One bounded broadcast from the sender (``SyncGroup.wait``: ``PeerFailure`` when a
        member dies or stalls, never a hang)."""
        self.group.wait(self.group.broadcast(tensor, SENDER))

    def _send_header(self, header: dict) -> None:
        raw = torch.tensor(list(json.dumps(header).encode()), dtype=torch.uint8, device=self.device)
        self._broadcast(torch.tensor([raw.numel()], device=self.device))
        self._broadcast(raw)

    def _recv_header(self) -> dict:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(size)
        raw = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(raw)
        return json.loads(bytes(raw.cpu().tolist()).decode())

    def _send_bucket(self, items: list[tuple[str, torch.Tensor]]) -> None:
        flat = torch.cat([t.detach().reshape(-1) for _, t in items]).to(self.device)
        self._send_header({"names": [n for n, _ in items], "shapes": [list(t.shape) for _, t in items],
                           "dtype": str(flat.dtype)})
        self._broadcast(flat)

    # ------------------------------------------------------------------ verl API
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None):
        """Stream ``weights`` to every rollout worker (actor rank 0); other ranks just consume."""
        if self.rank is None:
            raise RuntimeError("send_weights before init_process_group")
        if self.rank != SENDER:
            for _ in weights:
                pass
            return
        version = -1 if global_steps is None else int(global_steps)
        signatures, bucket, size, sent = [], [], 0, 0
        weights = iter(weights)
        try:
            for name, t in weights:
                signatures.append(tensor_signature(name, t))
                nbytes = t.numel() * t.element_size()
                if bucket and size + nbytes > self.bucket_size:
                    self._send_bucket(bucket)
                    bucket, size, sent = [], 0, sent + 1
                bucket.append((name, t))
                size += nbytes
            if bucket:
                self._send_bucket(bucket)
                sent += 1
            checksum = combine_signatures(signatures)
            self._send_header({"done": True, "checksum": checksum, "version": version})
        except PeerFailure as exc:
            for _ in weights:  # ZeRO-3: every actor rank runs the generator's gathers to the end
                pass
            raise peer_lost(self.group, exc, version, None, sent, "sending") from None
        self.last_checksum = checksum

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield the sender's ``(name, tensor)`` pairs once all arrived and the checksum matched."""
        if self.group is None or self.rank == SENDER:
            raise RuntimeError("receive_weights needs init_process_group with a rollout rank")
        specs, flats, dtypes = [], [], set()
        try:
            while True:
                header = self._recv_header()
                if header.get("done"):
                    break
                spec = BucketSpec(tuple(header["names"]), tuple(tuple(s) for s in header["shapes"]))
                dtype = getattr(torch, header["dtype"].removeprefix("torch."))
                flat = torch.empty(spec.numel, dtype=dtype, device=self.device)
                self._broadcast(flat)
                specs.append(spec)
                flats.append(flat)
                dtypes.add(header["dtype"])
        except PeerFailure as exc:
            version = -1 if global_steps is None else int(global_steps)
            raise peer_lost(self.group, exc, version, None, len(flats), "receiving") from None
        if len(dtypes) > 1:
            raise SyncError(f"weights arrived in several dtypes {sorted(dtypes)}; a sync carries one")
        manifest = SyncManifest(version=header["version"], dtype=dtypes.pop() if dtypes else "float32",
                                checksum=header["checksum"], buckets=tuple(specs))
        staged = StagedUpdate(manifest)
        for i, flat in enumerate(flats):
            staged.put(i, flat)
        got = staged.checksum()
        if got != manifest.checksum:
            raise SyncError(f"weight checksum mismatch: received {got}, sender had {manifest.checksum}; "
                            "nothing was applied")
        self.last_checksum = got
        for name, t in staged.named_views():
            yield name, t


_module_done()  # verl imported first by this module? finish the plugin's registration
