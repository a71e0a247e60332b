"""``StepLock``: a sampling engine's step lock that cannot starve the callers between steps.

Every thread blocked in a ``generate`` call steps the engine in a loop — take the lock, run one
step, release, take it again. Python's locks are not fair: the thread that just released one
takes it back before a woken waiter runs, so while requests decode, a caller that needs the
engine between two steps (``stats``, ``load_weights``, ``sleep``, ``prompt_logprobs``, an
``abort``) could wait for seconds — on a loaded 2-core machine it waited ~90 decode steps.

``StepLock`` gives those callers priority: the stepping loops come in through ``stepping()``,
which first waits while any other caller is waiting for the lock, or holds it::

    lock = StepLock()
    with lock.stepping():   # a generate call's loop: one engine step
        engine.step()
    with lock:              # anything else: in at the next step boundary
        engine.load_weights(...)

It is re-entrant (an ``RLock``) for both kinds of holder. A caller that holds it and then waits
for the steppers to make progress would wait forever: release it between polls (the vLLM
backend's ``load_weights`` waits for the running requests to drain that way).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class StepLock:
    """Re-entrant lock whose plain takers go before the threads that step in a loop."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._turn = threading.Condition(threading.Lock())
        self._priority = 0  # plain takers waiting for the lock or holding it

    def __enter__(self) -> StepLock:
        with self._turn:
            self._priority += 1
        try:
            self._lock.acquire()
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()
        self._leave()

    def _leave(self) -> None:
        with self._turn:
            self._priority -= 1
            if self._priority == 0:
                self._turn.notify_all()

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """The lock for one turn of a stepping loop, taken once no plain taker is waiting
        (one that comes while steppers queue for the lock still goes before them: at most
        the step running now is ahead of it). A thread that holds it already does not wait."""
        if self._lock._is_owned():  # noqa: SLF001 - RLock's own re-entry test
            with self._lock:
                yield
            return
        while True:
            with self._turn:
                while self._priority:
                    self._turn.wait()
            self._lock.acquire()
            if not self._priority:  # a plain taker that came meanwhile goes first
                break
            self._lock.release()
        try:
            yield
        finally:
            self._lock.release()
