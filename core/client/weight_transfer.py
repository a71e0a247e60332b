"""vLLM's weight-transfer routes (the RLHF "router" that SkyRL's remote engine client speaks),
receiving a trainer's broadcast into the native sampler:

- ``POST /init_weight_transfer_engine`` ``{"init_info": {"master_address", "master_port",
  "rank_offset", "world_size"}}`` joins a broadcast group in which the trainer is rank 0 (see
  "Joining" below); newer vLLM trainers also agree on packing here (``"packed"``,
  ``"packed_buffer_size_bytes"``, ``"packed_num_buffers"``), the defaults of every update;
- ``POST /start_weight_update`` opens an update (staging is empty);
- ``POST /update_weights`` ``{"update_info": {"names", "dtype_names", "shapes", "packed",
  "packed_buffer_size_bytes", "packed_num_buffers"}}`` receives one broadcast per tensor, or,
  ``packed``, the buffers of vLLM's ``packed_broadcast_producer`` (``packed_chunks``: tensors as
  raw bytes in order, a buffer closed as soon as it holds more than ``packed_buffer_size_bytes``,
  1 GiB unless announced), into staging. Any other key of ``init_info`` or ``update_info`` is
  refused (vLLM refuses them too), so a trainer speaking a protocol this server does not
  implement (``nccl_unique_id_b64``, CUDA-IPC handles) gets a 400 instead of a receive out of step;
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

Joining is bounded by the server's init timeout (``init_timeout_s``, ``--weight-transfer-timeout``,
default 300 s = ``SyncGroup``'s own ``timeout_s``, at most ``MAX_INIT_TIMEOUT_S``; a server-level
setting because vLLM refuses any other key in ``init_info``): the server waits that long for
something to accept a connection at ``master_address:master_port`` (the trainer may start its
store after sending the init) and for the group to form, then answers 504 naming the address.
TCPStore's own client wait is not used for this: when its connect times out it starts a whole new
one with a fresh timeout, so it gives up after 2 to 2.5 times its timeout (over 600 s at 300 s).
One init runs at a time, on a thread of its own (a second init meanwhile gets 409; the threads of
the other routes are never held by one); the group in use is replaced only once the new one has
formed, so a failed init leaves the transfer state as it was. A group still forming when its
caller got the 504 is closed once formed, never installed; it ends within ``SyncGroup``'s bounds,
and until it has, a new init gets 409. Each receive of ``/update_weights`` is bounded by
``SyncGroup``'s ``timeout_s`` (300 s), whatever the init timeout.
"""

import asyncio
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..sync import SyncError, SyncGroup
from ..sync.manifest import dtype_from_name

SLACK_BYTES = 64 << 20  # largest over-send a receive absorbs (and reports) instead of aborting
PACKED_BUFFER_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES
_RENDEZVOUS = ("master_address", "master_port", "rank_offset", "world_size")
_PACKING = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")
_UPDATE = ("names", "dtype_names", "shapes")
INIT_TIMEOUT_S = 300.0  # default bound of one init: SyncGroup's own timeout_s
MAX_INIT_TIMEOUT_S = 3600.0
_ANSWER_GRACE_S = 1.0  # the join thread's own timeout error comes first; this late, give up on it
_KEPT = "the transfer state is unchanged (the group in use, if any, is kept)"


class TransferTimeout(TimeoutError):
    """No weight-transfer group formed within the server's init timeout (HTTP 504)."""


def init_timeout(value: float) -> float:
    """A server's init timeout in seconds, in ``(0, MAX_INIT_TIMEOUT_S]``; ``ValueError`` else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        0 < value <= MAX_INIT_TIMEOUT_S
    ):
        raise ValueError(f"the weight-transfer init timeout (weight_transfer_timeout_s, "
                         f"--weight-transfer-timeout) must be > 0 and at most "
                         f"{MAX_INIT_TIMEOUT_S:g} seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Packing:
    """How updates arrive: ``packed`` (vLLM's packed buffers of ``buffer_bytes``) or one
    broadcast per tensor. Agreed at init (newer vLLM), overridable per update."""

    packed: bool = False
    buffer_bytes: int = PACKED_BUFFER_BYTES

    def override(self, info: dict, where: str) -> "Packing":
        """These settings with ``info``'s packing keys applied (``ValueError`` naming a bad one)."""
        packed = info.get("packed", self.packed)
        if not isinstance(packed, bool):
            raise ValueError(f"{where}: packed must be true or false, got {packed!r:.50}")
        size = info.get("packed_buffer_size_bytes", self.buffer_bytes)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{where}: packed_buffer_size_bytes must be an integer >= 1, got "
                             f"{size!r:.50}")
        buffers = info.get("packed_num_buffers", 1)  # the trainer's overlap only: not on the wire
        if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 1:
            raise ValueError(f"{where}: packed_num_buffers must be an integer >= 1, got "
                             f"{buffers!r:.50}")
        return Packing(packed, size)


def packed_chunks(nbytes: list[int], buffer_bytes: int) -> list[range]:
    """The buffers of vLLM's ``packed_broadcast_producer``: indices of the tensors (bytes each in
    ``nbytes``, in update order) that go into each broadcast — a buffer is closed as soon as its
    bytes exceed ``buffer_bytes``; the rest goes into a last one."""
    out, start, total = [], 0, 0
    for i, n in enumerate(nbytes):
        total += n
        if total > buffer_bytes:
            out.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(nbytes):
        out.append(range(start, len(nbytes)))
    return out


def _refuse_unknown(info: dict, known: tuple[str, ...], where: str) -> None:
    # some vLLM versions send an ``extras`` field (per-tensor loader hints); empty, it says nothing
    unknown = sorted(str(k) for k, v in info.items()
                     if k not in known and not (k == "extras" and v in ({}, [], None)))
    if unknown:
        extra = (" (nccl_unique_id_b64: this server joins the trainer's group by "
                 "master_address / master_port only)" if "nccl_unique_id_b64" in unknown else "")
        raise ValueError(f"{where}: unsupported key(s) {', '.join(repr(k)[:60] for k in unknown[:5])}"
                         f"{extra}; this server takes {', '.join(known)}")


@dataclass
class _Join:
    """One ``/init_weight_transfer_engine`` in progress."""

    host: str
    port: int
    started: float
    deadline: float
    packing: Packing = Packing()
    formed: bool = False  # the group formed (it may still wait for an update in flight)
    abandoned: bool = False  # its caller got the 504: a group formed late is closed
    installed: bool = False  # the group formed and is the one in use

    @property
    def where(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def slack_elements(numel: int, element_size: int) -> int:
    """Extra elements received past an announced ``numel`` to catch an over-sending peer."""
    return max(1024, min(numel, SLACK_BYTES // element_size))


class WeightTransfer:
    """Receiver state of the weight-transfer routes (module docstring)."""

    def __init__(self, samplers, *, require_checksum: bool = True,
                 init_timeout_s: float = INIT_TIMEOUT_S):
        self.samplers = samplers
        self.require_checksum = require_checksum
        self.init_timeout_s = init_timeout(init_timeout_s)
        self.group: SyncGroup | None = None
        self.packing = Packing()  # agreed with the group in use
        self.staged: dict[str, torch.Tensor] | None = None
        self.refused: str | None = None  # why the open update was refused (finish reports it)
        self._lock = threading.Lock()  # the group and the staged update
        self._join_lock = threading.Lock()  # the init in progress and its fate
        self._joining: _Join | None = None
        self._init_pool = ThreadPoolExecutor(1, thread_name_prefix="polynya-transfer-init")
        if samplers:
            self.expected = samplers[0].weight_specs()
            self.device = samplers[0].device

    def _check_samplers(self) -> None:
        if not self.samplers:
            raise NotImplementedError("this server has no native sampler to receive weights")

    async def init(self, info: dict) -> None:
        """Join the trainer's group (module docstring: "Joining"): ``TransferTimeout`` when it
        did not form within ``init_timeout_s``, ``RuntimeError`` while another init is pending,
        ``ValueError`` for a bad ``init_info``; the group in use stays unless the join succeeds."""
        self._check_samplers()
        host, port, rank, world = _init_args(info)
        packing = Packing().override(info, "init_info")
        join = self._begin(host, port, packing)
        work = asyncio.get_running_loop().run_in_executor(
            self._init_pool, self._join, join, rank, world
        )
        await asyncio.wait({work}, timeout=self.init_timeout_s + _ANSWER_GRACE_S)
        if not work.done() and self._abandon(join):
            why = ("it formed, but an update still receiving on the group in use held it "
                   "back; the new group is closed" if join.formed else
                   f"something accepts connections there, but not all {world} ranks joined "
                   "(check world_size and rank_offset, and that the trainer creates its group)")
            raise TransferTimeout(f"the weight-transfer group at {join.where} was not ready "
                                  f"within {self.init_timeout_s:g} s: {why}; {_KEPT}")
        await work

    def _begin(self, host: str, port: int, packing: Packing) -> _Join:
        now = time.monotonic()
        with self._join_lock:
            pending = self._joining
            if pending is not None:
                state = ("is ending the rendezvous it timed out on (within SyncGroup's own "
                         "timeout)" if pending.abandoned else "is waiting for its group")
                raise RuntimeError(
                    f"another /init_weight_transfer_engine (to {pending.where}, "
                    f"{now - pending.started:.0f} s ago) {state}: one init at a time, retry "
                    "once it has answered"
                )
            self._joining = _Join(host, port, now, now + self.init_timeout_s, packing)
            return self._joining

    def _abandon(self, join: _Join) -> bool:
        """The caller gives up on ``join``: True unless its group is already the one in use."""
        with self._join_lock:
            join.abandoned = not join.installed
            return join.abandoned

    def _join(self, join: _Join, rank: int, world: int) -> None:
        """The blocking part of an init, on the init thread: wait for the trainer's store, form
        the group, and make it the one in use unless its caller gave up on it meanwhile."""
        try:
            _wait_for_listener(join, self.init_timeout_s)
            try:
                group = SyncGroup(join.host, join.port, rank=rank, world_size=world,
                                  device=self.device, heartbeat=False)  # outside trainer
            except Exception as exc:  # not a store there, the trainer gave up, backend error
                raise RuntimeError(
                    f"could not join the weight-transfer group at {join.where} as rank {rank} "
                    f"of {world}: {type(exc).__name__}: {exc}; {_KEPT}"
                ) from exc
            join.formed = True
            with self._lock:  # waits for an update still receiving on the group in use
                with self._join_lock:
                    join.installed = not join.abandoned
                old = self.group
                if join.installed:
                    self.group, self.packing = group, join.packing
            dropped = old if join.installed else group  # (a late group: nobody asked for it)
            if dropped is not None:
                dropped.close()
        finally:
            with self._join_lock:
                self._joining = None

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
                self._receive(names, shapes, dtypes, self.packing.override(info, "update_info"))
            except Exception as exc:  # the whole update is void: finish must not apply a part,
                self.staged, self.refused = None, str(exc)  # and the group may be out of step
                self.group.close()
                self.group = None
                raise

    def _check_info(self, info: dict):
        _refuse_unknown(info, _UPDATE + _PACKING, "update_info")
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
        return names, shapes, dtypes

    def _receive(self, names, shapes, dtypes, packing: Packing) -> None:
        sizes = [math.prod(s) for s in shapes]
        if packing.packed:  # raw bytes, dtypes mixed as they come (vLLM's packed buffers)
            nbytes = [n * torch.empty((), dtype=d).element_size() for n, d in zip(sizes, dtypes)]
            chunks = packed_chunks(nbytes, packing.buffer_bytes)
            for c, idx in enumerate(chunks):
                what = f"packed buffer {c + 1} of {len(chunks)}"
                flat = self._broadcast(sum(nbytes[i] for i in idx), torch.uint8, what)
                for i, piece in zip(idx, flat.split([nbytes[i] for i in idx])):
                    self.staged[names[i]] = _as_tensor(piece, dtypes[i], shapes[i])
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


def _as_tensor(raw: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """Bytes of a packed buffer as a tensor (a copy where the offset does not suit ``dtype``)."""
    if raw.storage_offset() % torch.empty((), dtype=dtype).element_size():
        raw = raw.clone()
    return raw.view(dtype).view(shape)


def _init_args(info: dict) -> tuple[str, int, int, int]:
    """``(host, port, rank, world_size)`` of an ``init_info``; ``ValueError`` naming a bad field."""
    _refuse_unknown(info, _RENDEZVOUS + _PACKING, "init_info")
    try:
        host, port = info["master_address"], _int(info["master_port"], "master_port")
        rank = _int(info.get("rank_offset", 1), "rank_offset")
        world = _int(info["world_size"], "world_size")
    except KeyError as exc:
        raise ValueError(
            f"init_info needs master_address, master_port, world_size: missing {exc}"
        ) from None
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"init_info: master_address must be a host name or address (a "
                         f"non-empty string), got {host!r:.100}")
    if not (0 < port < 65536 and 0 < rank < world):
        raise ValueError(
            f"init_info: need 0 < master_port < 65536 and 0 < rank_offset < "
            f"world_size, got port {port}, rank_offset {rank}, world_size {world}"
        )
    return host, port, rank, world


def _wait_for_listener(join: _Join, timeout_s: float) -> None:
    """Return once something accepts a TCP connection at ``join``'s address; ``TransferTimeout``
    at its deadline, ``ValueError`` for a host name that does not resolve."""
    delay = 0.05
    while True:
        left = join.deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(
                f"nothing accepted a connection at {join.where} within {timeout_s:g} s (the "
                "server's weight-transfer init timeout, --weight-transfer-timeout): start the "
                "trainer's rank-0 group (its store) at that address, or correct master_address / "
                f"master_port; {_KEPT}"
            )
        try:
            socket.create_connection((join.host, join.port), timeout=min(left, 5.0)).close()
            return
        except socket.gaierror as exc:
            raise ValueError(f"init_info: master_address {join.host!r:.100} does not resolve "
                             f"({exc.strerror or exc}); {_KEPT}") from None
        except OSError:  # refused, unreachable, timed out: the trainer's store may start yet
            time.sleep(max(0.0, min(delay, join.deadline - time.monotonic())))
            delay = min(2 * delay, 0.5)


def _version(raw) -> int:
    """An explicit weight version: an int, or a string of one (SkyRL sends ``"3"``)."""
    if isinstance(raw, str) and raw.strip().lstrip("-").isdigit():
        return int(raw)
    return _int(raw, "weight_version (an integer or a string of one)")


def _int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return v


def add_weight_transfer_routes(app, client, *, require_checksum: bool = True,
                               init_timeout_s: float = INIT_TIMEOUT_S) -> WeightTransfer:
    """Register the four weight-transfer routes on ``app``; returns the receiver state."""
    from fastapi import Request

    from .codec import read_json

    transfer = WeightTransfer(
        list(getattr(client, "samplers", [])), require_checksum=require_checksum,
        init_timeout_s=init_timeout_s,
    )

    async def section(request: Request, key: str) -> dict:
        info = (await read_json(request)).get(key)
        if not isinstance(info, dict):
            raise ValueError(f"missing {key!r} object in the request body")
        return info

    @app.post("/init_weight_transfer_engine")
    async def init_transfer(request: Request) -> dict:
        await transfer.init(await section(request, "init_info"))  # on its own thread
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
