"""``SyncGroup``: the standalone process group a split weight sync runs on, with bounded waits.

One group per sync topology (NCCL on CUDA, gloo on CPU), separate from the trainer's DeepSpeed
group, over a ``TCPStore`` that rank 0 hosts (listening on the given ``host`` only; with a
loopback host gloo's own listener is on loopback too, so a group on one machine opens nothing on
the network).

Failure is bounded. Every member beats into the store (``PeerMonitor``, one beat per interval
= ``peer_timeout_s / 5``, at most 1 s); ``wait(work)`` polls a collective instead of blocking on
it and gives up with ``PeerFailure`` when

- a member has not beaten for ``peer_timeout_s`` (default 30 s: killed, ``SIGSTOP``-ed, cut off):
  raised within ``peer_timeout_s`` + one interval of its last beat;
- another member raised the group's failure flag (it gave up first): within one interval;
- the backend reported an error (gloo: a closed connection, seen at once; the failed peer is
  then named from the heartbeats, within ~4 intervals);
- the collective made no progress for ``timeout_s`` (default 300 s) although everyone beats (a
  member that never entered the sync; gloo's own operation timeout is ``timeout_s`` + 5 s, so
  this check fires first).

``abort(reason)`` then tears the group down without waiting on anything: it raises the flag,
aborts the NCCL communicator (in-flight kernels exit; ``ProcessGroupNCCL.abort`` never ends the
process) and never destroys the backend (gloo cannot cancel a queued operation, and destroying
the group would wait for each to reach gloo's own timeout; they end on their own). The old port
stays bound, so a new group takes a new port. The NCCL group is made with a watchdog timeout
longer than these bounds and, unless the user set ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, in its
clean-up-only mode (2): the watchdog never ends the process for this group.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import re
import socket
import threading
import time

import torch
import torch.distributed as dist

from ..distributed import is_loopback
from .liveness import NoMonitor, PeerFailure, PeerMonitor
from .manifest import SyncError

_ENV_LOCK = threading.Lock()
_CHECK_S = 0.02  # how often a wait looks at the heartbeats and the flag


class SyncGroup:
    """A process group of its own over a ``TCPStore`` (rank 0 hosts the store); see the module
    docstring for ``timeout_s`` (no progress) and ``peer_timeout_s`` (no heartbeat).
    ``heartbeat=False`` for a member whose peers are not polynya (an outside trainer on vLLM's
    weight-transfer routes never beats): its waits are bounded by ``timeout_s`` alone."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        rank: int,
        world_size: int,
        device: torch.device | str,
        timeout_s: float = 300.0,
        peer_timeout_s: float = 30.0,
        heartbeat: bool = True,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a sync group of {world_size}")
        if timeout_s <= 0 or peer_timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) and peer_timeout_s ({peer_timeout_s}) "
                             "must be > 0")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.timeout_s, self.peer_timeout_s = float(timeout_s), float(peer_timeout_s)
        self.broken: str | None = None  # why the group was torn down
        timeout = datetime.timedelta(seconds=timeout_s)
        # rank 0's store listens on ``host`` only (TCPStore alone would listen on every interface)
        # (the store owns the descriptor from here on: Python must not close it a second time)
        listen_fd = listen_socket(host, int(port)).detach() if rank == 0 else None
        self.store = dist.TCPStore(
            host,
            int(port),
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
        prefixed = dist.PrefixStore("polynya_sync", self.store)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            # the watchdog must never fire before our own bounds (it would end the process)
            opts._timeout = datetime.timedelta(seconds=2 * timeout_s + peer_timeout_s + 60)
            with _nccl_cleanup_only():
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:  # gloo's own operation timeout a little later than ours: ours names the cause
            late = datetime.timedelta(seconds=timeout_s + 5)
            if is_loopback(host):  # a group on this host: gloo's pair listener on loopback too
                opts = dist.ProcessGroupGloo._Options()
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
                opts._timeout = late
                self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
            else:
                self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, late)
        self.monitor = PeerMonitor(host, port, rank=rank, world=world_size,
                                   peer_timeout_s=peer_timeout_s) if heartbeat else NoMonitor()

    # ------------------------------------------------------------------ collectives
    def check_usable(self) -> None:
        """``SyncError`` once the group was torn down (``abort``)."""
        if self.broken is not None:
            raise SyncError(f"this sync group was torn down ({self.broken}); make a new "
                            "SyncGroup on a new port")

    def broadcast(self, tensor: torch.Tensor, root: int):
        """Asynchronous broadcast; returns the ``Work`` to ``wait`` on."""
        self.check_usable()
        return self.pg.broadcast(tensor, root)

    def wait(self, work) -> None:
        """Wait for ``work`` within the group's bounds (module docstring); ``PeerFailure`` else.

        Polls ``work.is_completed()`` (NCCL: an event query, the CPU never blocks on a stuck
        kernel), then ``work.wait()`` (gloo: raises the backend's error; NCCL: orders the
        current stream after the finished collective)."""
        start = time.monotonic()
        check, delay = start + _CHECK_S, 20e-6
        while not work.is_completed():
            now = time.monotonic()
            if now >= check:
                failed = self.monitor.failure() or self.monitor.lost()
                if failed is not None:
                    raise failed
                if now - start > self.timeout_s:
                    raise PeerFailure(f"a collective made no progress for {self.timeout_s:g} s "
                                      "while every member still beats (has every member "
                                      "entered this sync with the same manifest?)")
                check = now + _CHECK_S
            time.sleep(delay)
            delay = min(delay * 2, 2e-4 if now - start < 0.1 else 1e-3)
        try:
            work.wait()
        except Exception as exc:  # the backend saw the failure first (gloo: connection closed)
            failed = self.monitor.failure()
            if failed is None:
                failed = PeerFailure(f"the collective failed: {_first_line(exc)}",
                                     self.monitor.suspects())
            raise failed from exc

    def confirm(self, ok: bool) -> list[int]:
        """Every member says whether it holds the whole sync; returns the ranks that do not.

        One small all-reduce: the sender learns the receivers have every bucket (a broadcast can
        complete into a dead peer's socket buffer), and a member that failed locally (out of
        memory) still keeps the group in step."""
        flags = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        flags[self.rank] = int(ok)
        self.wait(self.pg.allreduce([flags]))
        return [r for r, f in enumerate(flags.tolist()) if not f]

    def barrier(self) -> None:
        self.wait(self.broadcast(torch.zeros(1, device=self.device), 0))

    # ------------------------------------------------------------------ teardown
    def abort(self, reason: str, ranks: tuple[int, ...] = ()) -> None:
        """Tear the group down now, whatever is in flight (module docstring). Idempotent."""
        if self.broken is not None:
            return
        self.broken = reason
        self.monitor.fail(reason, ranks)
        try:
            self.pg.abort()  # NCCL: aborts the communicator; gloo: nothing in flight stops
        except Exception:
            pass
        self.monitor.close()
        _bury(self.pg)
        self.pg = self.store = None

    def __del__(self):  # a group dropped without close(): its heartbeat must not outlive it
        monitor = getattr(self, "monitor", None)
        if monitor is not None:
            monitor.close()

    def close(self) -> None:
        """Orderly shutdown of a healthy group (every member calls it)."""
        self.monitor.close()
        if self.pg is None:
            return
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # best effort: the peer may be gone already
                pass


def _bury(pg) -> None:
    """Keep a torn-down backend alive for good (one reference never released, so not even
    interpreter exit destroys it): destroying a gloo group waits for every queued operation
    to end (each up to its timeout), which would block whoever drops the last reference — the
    caller, or the interpreter at exit. Its in-flight operations end on their own timeout and
    free their buffers; what stays is the small group object (and rank 0's store, so the
    other members can still read the failure flag; the old port stays bound)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))


class _nccl_cleanup_only:
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (abort the communicator, keep the process) while one
    ``ProcessGroupNCCL`` is made — it reads the variable in its constructor. A user's own
    setting is kept."""

    def __enter__(self):
        _ENV_LOCK.acquire()
        self.set = "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
        if self.set:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"

    def __exit__(self, *exc):
        if self.set:
            os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
        _ENV_LOCK.release()


def _first_line(exc: BaseException) -> str:
    """The backend's message, first line, without gloo's source-location prefix."""
    text = str(exc).strip().splitlines()
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text[0] if text else "")
    return line.split(" This is typically caused by")[0][:300]


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host`` (name or address) and ``port``."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock
