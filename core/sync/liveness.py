"""Liveness of a sync group's members: a heartbeat each and a shared failure flag.

Every ``SyncGroup`` member runs a ``PeerMonitor``: a daemon thread that adds 1 to the member's
counter in the group's store every ``interval_s`` over a store client of its own, whose
operations time out after ``peer_timeout_s`` (a stalled store host cannot block the thread for
longer). While a sync waits (``with monitor.watch():``) the thread also reads every other
member's counter and the group's failure flag, so a waiting member learns within about one
interval that

- a member's counter has not moved for ``peer_timeout_s``: it is *lost* (killed, stopped,
  cut off) — ``lost()``; the store host (rank 0) is lost too when the store stops answering;
- a member gave up on the sync and raised the flag (``fail``) — ``failure()``.

The collectives themselves cannot say which peer failed (a gloo error names an address, a
stuck NCCL kernel says nothing): the counters can, on either backend. ``PeerFailure`` is what a
bounded wait raises; ``SyncPeerLost`` is the error the sync functions raise from it, with the
version and bucket they had reached.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import threading
import time
import weakref

import torch.distributed as dist

from .manifest import SyncError

BEAT_PREFIX = "polynya_sync_beat"
FLAG = "failed"
_RUNNING: weakref.WeakSet[PeerMonitor] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Stop every heartbeat before the interpreter finalizes: a daemon thread caught inside a
    store call at exit ends the process with ``std::terminate``."""
    for monitor in list(_RUNNING):
        monitor.close(join=True)


class SyncPeerLost(SyncError):
    """A broadcast sync stopped because a member died, stalled or gave up.

    The group was torn down (nothing is left waiting on it); this member's engine is unchanged
    (a trainer's weights, optimizer and version; a receiver's served weights and version). Make
    a new ``SyncGroup`` (a new port) with the members that are alive or restarted and sync again.
    ``ranks``: the members found lost (may be empty when none could be named); ``version``; the
    ``bucket`` this member had reached (``None``: the receipt confirmation after every bucket).
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...] = (), version: int = -1,
                 bucket: int | None = None):
        super().__init__(message)  # (defaults: unpickling — Ray — rebuilds from the message)
        self.ranks, self.version, self.bucket = tuple(ranks), version, bucket


class PeerFailure(Exception):
    """Raised by a bounded wait: ``ranks`` (possibly empty) failed for ``reason``."""

    def __init__(self, reason: str, ranks: tuple[int, ...] = ()):
        super().__init__(reason)
        self.reason, self.ranks = reason, tuple(ranks)


class PeerMonitor:
    """Heartbeat of member ``rank`` of a group of ``world``, and what it sees of the others."""

    def __init__(self, host: str, port: int, *, rank: int, world: int, peer_timeout_s: float):
        if peer_timeout_s <= 0:
            raise ValueError(f"peer_timeout_s must be > 0, got {peer_timeout_s}")
        self.rank, self.world, self.peer_timeout_s = rank, world, float(peer_timeout_s)
        self.interval_s = min(1.0, self.peer_timeout_s / 5)
        timeout = datetime.timedelta(seconds=self.peer_timeout_s)
        client = dist.TCPStore(host, int(port), is_master=False, timeout=timeout,
                               wait_for_workers=False)
        self._store = dist.PrefixStore(BEAT_PREFIX, client)
        self._lock = threading.Lock()
        self._watchers = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        self._round = time.monotonic()  # last round the store answered
        self._store_error: str | None = None
        self._flag: str | None = None
        self._stop = threading.Event()
        self._store.add(self._key(rank), 1)  # exists from construction on
        self._thread = threading.Thread(target=self._run, name=f"polynya-sync-beat-{rank}",
                                        daemon=True)
        self._thread.start()
        _RUNNING.add(self)

    @staticmethod
    def _key(rank: int) -> str:
        return f"beat/{rank}"

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(self._key(self.rank), 1)
                if self._watchers:
                    self._read_peers()
            except Exception as exc:  # the store host is gone (or stalled past the timeout)
                with self._lock:
                    self._store_error = f"{type(exc).__name__}: {exc}"
                return
            with self._lock:
                self._round = time.monotonic()

    def _read_peers(self) -> None:
        counts = {r: self._store.add(self._key(r), 0) for r in range(self.world) if r != self.rank}
        flag = self._store.get(FLAG).decode() if self._store.check([FLAG]) else None
        now = time.monotonic()
        with self._lock:
            for r, c in counts.items():
                old = self._seen.get(r)
                if old is None or old[0] != c:
                    self._seen[r] = (c, now)
            if flag is not None:
                self._flag = flag

    # ------------------------------------------------------------------ the waiting side
    @contextlib.contextmanager
    def watch(self):
        """Read the others' counters while the block runs (a peer is timed from the start)."""
        with self._lock:
            if self._watchers == 0:
                now = time.monotonic()
                self._seen = {r: (-1, now) for r in range(self.world) if r != self.rank}
            self._watchers += 1
        try:
            yield self
        finally:
            with self._lock:
                self._watchers -= 1

    def lost(self) -> PeerFailure | None:
        """The members found lost so far (``None``: every member beats)."""
        now = time.monotonic()
        with self._lock:
            if self.rank != 0 and (self._store_error is not None
                                   or now - self._round > self.peer_timeout_s):
                why = self._store_error or f"no answer for {now - self._round:.1f} s"
                return PeerFailure(f"the group's store on rank 0 stopped answering ({why})", (0,))
            stale = tuple(r for r, (_, t) in sorted(self._seen.items())
                          if now - t > self.peer_timeout_s)
        if stale:
            return PeerFailure(f"no heartbeat for over {self.peer_timeout_s:g} s from rank(s) "
                               f"{list(stale)} (killed, stopped or cut off)", stale)
        return None

    def failure(self) -> PeerFailure | None:
        """The failure another member raised for this group, if any."""
        with self._lock:
            flag = self._flag
        if flag is None:
            return None
        info = json.loads(flag)
        return PeerFailure(f"rank {info['rank']} gave up on the sync: {info['reason']}",
                           tuple(info["ranks"]))

    def suspects(self) -> tuple[int, ...]:
        """After a collective failed: the members whose counter does not move over the next
        ~4 intervals (a dead process never beats again; a live one beats every interval)."""
        first: dict[int, int] = {}
        alive: set[int] = set()
        with self.watch():
            deadline = time.monotonic() + min(self.peer_timeout_s, 4 * self.interval_s)
            while time.monotonic() < deadline and len(alive) < self.world - 1:
                time.sleep(self.interval_s / 4)
                with self._lock:
                    if self._store_error is not None and self.rank != 0:
                        return (0,)
                    for r, (c, _) in self._seen.items():
                        if c >= 0 and first.setdefault(r, c) != c:
                            alive.add(r)
        return tuple(r for r in range(self.world) if r != self.rank and r not in alive)

    def fail(self, reason: str, ranks: tuple[int, ...] = ()) -> None:
        """Raise the group's failure flag (best effort: the store may be gone)."""
        try:
            payload = json.dumps({"rank": self.rank, "ranks": list(ranks), "reason": reason})
            self._store.compare_set(FLAG, "", payload)  # the first failure wins
        except Exception:
            pass

    def close(self, join: bool = False) -> None:
        """Stop the heartbeat (``join``: wait for the thread, at most one store timeout)."""
        self._stop.set()
        if join and self._thread is not threading.current_thread():
            self._thread.join(self.peer_timeout_s + 1)


class NoMonitor:
    """Stands in for ``PeerMonitor`` in a group without heartbeats (``SyncGroup(heartbeat=
    False)``): nobody is ever found lost, waits are bounded by ``timeout_s`` alone."""

    interval_s = 0.0

    @contextlib.contextmanager
    def watch(self):
        yield self

    def lost(self) -> None:
        return None

    def failure(self) -> None:
        return None

    def suspects(self) -> tuple[int, ...]:
        return ()

    def fail(self, reason: str, ranks: tuple[int, ...] = ()) -> None:
        pass

    def close(self, join: bool = False) -> None:
        pass
