"""vLLM's weight-transfer routes (the RLHF "router" that SkyRL's remote engine client speaks),
receiving a trainer's broadcast into the native sampler:

- ``POST /init_weight_transfer_engine`` ``{"init_info": {"master_address", "master_port",
  "rank_offset", "world_size"}}`` joins a broadcast group in which the trainer is rank 0;
- ``POST /start_weight_update`` opens an update (staging is empty);
- ``POST /update_weights`` ``{"update_info": {"names", "dtype_names", "shapes", "packed"}}``
  receives one broadcast (``packed``: one flat buffer) or one per tensor, into staging;
- ``POST /finish_weight_update`` ``{"checksum": ..., "weight_version" | "version": ...}``
  verifies the staged weights and applies them in one go under the new version.

Everything the trainer announces is checked *before* the collective: every name is a weight of
the sampler, sent once per update, with the sampler's shape and a float dtype. The receive
buffer has a slack tail filled with random bytes: a trainer that broadcasts up to
``slack_elements(n)`` more elements than announced is detected (the tail changed) and the update
is refused instead of gloo aborting the process (beyond the slack gloo still aborts; NCCL does not
check sizes at all, the checksum catches a short or garbled transfer). ``finish`` needs the
trainer's ``checksum`` (``polynya.checksum.checksum_named_tensors`` of the tensors it sent;
``require_checksum=False`` serves stock clients that cannot send one), refuses NaN/inf weights,
an empty update, a stale version, and a finish after a refused update. The version moves only
when weights were loaded. A refused ``/update_weights`` also drops the transfer group (the
trainer's broadcast may have no receive to match): the trainer re-initialises it.
"""

import asyncio
import math
import threading

import torch

from ..sync import SyncError, SyncGroup
from ..sync.manifest import dtype_from_name

SLACK_BYTES = 64 << 20  # largest over-send a receive absorbs (and reports) instead of aborting


def slack_elements(numel: int, element_size: int) -> int:
    """Extra elements received past an announced ``numel`` to catch an over-sending peer."""
    return max(1024, min(numel, SLACK_BYTES // element_size))


class WeightTransfer:
    """Receiver state of the weight-transfer routes (module docstring)."""

    def __init__(self, samplers, *, require_checksum: bool = True):
        self.samplers = samplers
        self.require_checksum = require_checksum
        self.group: SyncGroup | None = None
        self.staged: dict[str, torch.Tensor] | None = None
        self.refused: str | None = None  # why the open update was refused (finish reports it)
        self._lock = threading.Lock()
        if samplers:
            self.expected = samplers[0].weight_specs()
            self.device = samplers[0].device

    def _check_samplers(self) -> None:
        if not self.samplers:
            raise NotImplementedError("this server has no native sampler to receive weights")

    def init(self, info: dict) -> None:
        self._check_samplers()
        try:
            host, port = str(info["master_address"]), _int(info["master_port"], "master_port")
            offset = _int(info.get("rank_offset", 1), "rank_offset")
            world = _int(info["world_size"], "world_size")
        except KeyError as exc:
            raise ValueError(
                f"init_info needs master_address, master_port, world_size: missing {exc}"
            ) from None
        if not (0 < port < 65536 and 0 < offset < world):
            raise ValueError(
                f"init_info: need 0 < master_port < 65536 and 0 < rank_offset < "
                f"world_size, got port {port}, rank_offset {offset}, world_size {world}"
            )
        with self._lock:
            if self.group is not None:
                self.group.close()
                self.group = None
            try:
                self.group = SyncGroup(host, port, rank=offset, world_size=world,
                                       device=self.device, heartbeat=False)  # outside trainer
            except Exception as exc:  # unreachable host, no trainer listening, timeout
                raise RuntimeError(
                    f"could not join the weight-transfer group at {host}:{port} as rank {offset} "
                    f"of {world}: {type(exc).__name__}: {exc}"
                ) from exc

    def start(self) -> None:
        self._check_samplers()
        with self._lock:
            self.staged, self.refused = {}, None

    def update(self, info: dict) -> None:
        with self._lock:
            if self.staged is None:
                raise RuntimeError(
                    "call /start_weight_update before /update_weights"
                    + (f" (the last update was refused: {self.refused})" if self.refused else "")
                )
            if self.group is None:
                raise RuntimeError(
                    "call /init_weight_transfer_engine first (again after a refused "
                    "update: the trainer's broadcast had no matching receive)"
                )
            try:
                names, shapes, dtypes = self._check_info(info)
                self._receive(names, shapes, dtypes, packed=bool(info.get("packed")))
            except Exception as exc:  # the whole update is void: finish must not apply a part,
                self.staged, self.refused = None, str(exc)  # and the group may be out of step
                self.group.close()
                self.group = None
                raise

    def _check_info(self, info: dict):
        try:
            names, raw_shapes, raw_dtypes = info["names"], info["shapes"], info["dtype_names"]
        except KeyError as exc:
            raise ValueError(
                f"update_info needs names, dtype_names, shapes: missing {exc}"
            ) from None
        if not all(isinstance(x, list) for x in (names, raw_shapes, raw_dtypes)):
            raise ValueError("update_info: names, dtype_names and shapes must be lists")
        if not (len(names) == len(raw_shapes) == len(raw_dtypes)) or not names:
            raise ValueError(
                f"update_info: names ({len(names)}), dtype_names ({len(raw_dtypes)}) "
                f"and shapes ({len(raw_shapes)}) must be non-empty and equally long"
            )
        unknown = [n for n in names if not isinstance(n, str) or n not in self.expected]
        if unknown:
            raise ValueError(f"update_info: {unknown[:3]} are not weights of the served model")
        if len(set(names)) != len(names) or not self.staged.keys().isdisjoint(names):
            raise ValueError("update_info: a weight is sent twice in one update")
        shapes, dtypes = [], []
        for n, s, d in zip(names, raw_shapes, raw_dtypes):
            if not isinstance(s, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in s
            ):
                raise ValueError(f"update_info: shape of {n!r} must be a list of ints, got {s!r}")
            if tuple(s) != self.expected[n][0]:
                raise ValueError(
                    f"update_info: {n!r} has shape {tuple(s)}, the served model's is "
                    f"{self.expected[n][0]}"
                )
            shapes.append(tuple(s))
            dtypes.append(dtype_from_name(str(d)))  # float32 / bfloat16 / float16 only
        if info.get("packed") and len(set(dtypes)) != 1:
            raise ValueError("packed update_info needs one dtype for all tensors")
        return names, shapes, dtypes

    def _receive(self, names, shapes, dtypes, *, packed: bool) -> None:
        sizes = [math.prod(s) for s in shapes]
        if packed:
            flat = self._broadcast(sum(sizes), dtypes[0], "the packed buffer")
            for n, s, piece in zip(names, shapes, flat.split(sizes)):
                self.staged[n] = piece.view(s)
        else:
            for n, s, size, d in zip(names, shapes, sizes, dtypes):
                self.staged[n] = self._broadcast(size, d, repr(n)).view(s)

    def _broadcast(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """Receive ``numel`` elements; ``SyncError`` when the trainer sent more."""
        size = torch.empty((), dtype=dtype).element_size()
        slack = slack_elements(numel, size)
        buf = torch.zeros(numel + slack, dtype=dtype, device=self.device)  # short sends: zeros
        tail = torch.randint(0, 256, (slack * size,), dtype=torch.uint8, device=self.device)
        buf[numel:].view(torch.uint8).copy_(tail)
        self.group.broadcast(buf, 0).wait()
        if not torch.equal(buf[numel:].view(torch.uint8), tail):
            raise SyncError(
                f"the trainer broadcast more than the {numel} elements announced for "
                f"{what}: update refused (send exactly what update_info announces)"
            )
        return buf[:numel]

    def finish(self, body: dict) -> int:
        with self._lock:
            if self.staged is None:
                raise RuntimeError(
                    "no weight update in progress"
                    + (
                        f": the update was refused ({self.refused})"
                        if self.refused
                        else ": call /start_weight_update first"
                    )
                )
            staged, self.staged = self.staged, None
            if not staged:
                raise ValueError(
                    "empty weight update (no /update_weights since the start): "
                    "nothing loaded, version unchanged"
                )
            want = body.get("checksum")
            if want is None and self.require_checksum:
                raise ValueError(
                    "/finish_weight_update needs the trainer's 'checksum' "
                    "(polynya.checksum.checksum_named_tensors of the tensors sent); "
                    "nothing loaded"
                )
            version = body.get("weight_version", body.get("version"))
            current = max(s.weight_version for s in self.samplers)
            v = current + 1 if version is None else _version(version)
            if v <= current:
                raise SyncError(
                    f"stale weight_version {v}: the sampler already serves version {current}"
                )
            for s in self.samplers:  # checks NaN/inf and the checksum before copying anything
                s.load_weights(staged, version=v, checksum=want)
            return v


def _version(raw) -> int:
    """An explicit weight version: an int, or a string of one (SkyRL sends ``"3"``)."""
    if isinstance(raw, str) and raw.strip().lstrip("-").isdigit():
        return int(raw)
    return _int(raw, "weight_version (an integer or a string of one)")


def _int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return v


def add_weight_transfer_routes(app, client, *, require_checksum: bool = True) -> WeightTransfer:
    """Register the four weight-transfer routes on ``app``; returns the receiver state."""
    from fastapi import Request

    from .codec import read_json

    transfer = WeightTransfer(
        list(getattr(client, "samplers", [])), require_checksum=require_checksum
    )

    async def section(request: Request, key: str) -> dict:
        info = (await read_json(request)).get(key)
        if not isinstance(info, dict):
            raise ValueError(f"missing {key!r} object in the request body")
        return info

    @app.post("/init_weight_transfer_engine")
    async def init_transfer(request: Request) -> dict:
        await asyncio.to_thread(transfer.init, await section(request, "init_info"))
        return {"message": "Weight transfer initialized"}

    @app.post("/start_weight_update")
    async def start_update(request: Request) -> dict:
        await read_json(request)
        await asyncio.to_thread(transfer.start)  # waits for an update still receiving
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(request: Request) -> dict:
        await asyncio.to_thread(transfer.update, await section(request, "update_info"))
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update")
    async def finish_update(request: Request) -> dict:
        version = await asyncio.to_thread(transfer.finish, await read_json(request))
        return {"message": "Weight update finished", "version": version}

    return transfer
