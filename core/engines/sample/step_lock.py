"""``StepLock``: a sampling engine's step lock, with turns between the stepping loops and the
other callers.

Every thread blocked in a ``generate`` call steps the engine in a loop — take the lock, run one
step, release, take it again. Python's locks are not fair: the thread that just released one
takes it back before a woken waiter runs, so while requests decode, a caller that needs the
engine between two steps (``stats``, ``load_weights``, ``sleep``, ``prompt_logprobs``, an
``abort``) could wait for seconds — on a loaded 2-core machine it waited ~90 decode steps.

The lock itself is a plain ``threading.RLock`` (``StepLock.lock``), always taken by a ``with``
statement of the caller, next to a context manager that only takes turns::

    steps = StepLock()
    with steps.plain(), steps.lock:       # anything but a step: in at the next step boundary
        engine.load_weights(...)

    turn = steps.stepper()                # a generate call's stepping loop
    while True:
        with turn, steps.lock:
            if not turn.go():             # a plain taker came meanwhile: it goes first
                continue
            engine.step()

- A plain taker goes before the steppers: it gets in at the next step boundary (the step
  running when it came, at most one more).
- While steppers wait, plain takers get one turn per step: a stream of plain takers (threads
  polling ``stats`` in a loop) cannot stop decoding either.
- Re-entry (a thread that holds the lock) never waits for a turn.

Interrupts (``KeyboardInterrupt``, raised in the main thread between two bytecodes, e.g. a
Ctrl-C during ``generate``): the lock is only taken and released by C-level ``with``
statements in the caller's frame, so an interrupt never leaves it held (as with a bare
``with rlock:``). Only the turn bookkeeping is Python, and it records who waits since when
rather than counts: an entry an interrupt leaves behind goes stale after ``MAX_TURN_WAIT_S`` and
is ignored from then on. Every wait for a turn is bounded by it as well, so a lost turn costs at
most that much, never a hang.

A caller that holds the lock and then waits for the steppers to make progress would wait
forever: release it between polls (the vLLM backend's ``load_weights`` waits for the running
requests to drain that way).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Self

MAX_TURN_WAIT_S = 1.0  # longest wait for a turn; also when a waiter's entry counts as stale


class StepLock:
    """The engine's step lock (``lock``) and the turns its two kinds of caller take."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        # turn bookkeeping: dicts and an int changed by single (GIL-atomic) operations; waits
        # poll it with sleeps, which an interrupt leaves cleanly (a Condition's wait does not)
        # plain takers waiting or holding / steppers waiting for a turn -> (since when, thread)
        self._plain: dict[int, tuple[float, int]] = {}
        self._steppers: dict[int, tuple[float, int]] = {}
        self._plain_turns = 0                  # plain turns taken since the last step began
        self._entries = itertools.count()

    @contextlib.contextmanager
    def plain(self) -> Iterator[None]:
        """A plain taker's turn: enter it right before ``lock`` (``with steps.plain(),
        steps.lock:``). Waits while steppers wait and a plain taker already had this turn."""
        if self.lock._is_owned():  # re-entry (RLock._is_owned): no turn to wait for
            yield
            return
        _wait(lambda: self._plain_turns and _fresh(self._steppers))
        entry = next(self._entries)
        self._plain[entry] = (time.monotonic(), threading.get_ident())
        try:
            yield
        finally:
            self._plain.pop(entry, None)
            self._plain_turns += 1

    def stepper(self) -> _Stepper:
        """One stepping loop's turns (make it once per loop)."""
        return _Stepper(self)


class _Stepper:
    """A stepping loop's turn: ``with turn, steps.lock:`` waits until no plain taker waits;
    inside, ``turn.go()`` says whether to step now (False: one came meanwhile — ``continue``)."""

    def __init__(self, steps: StepLock) -> None:
        self.steps = steps
        self.entry = next(steps._entries)
        self.since = 0.0

    def __enter__(self) -> Self:
        steps = self.steps
        if steps.lock._is_owned():  # re-entry (RLock._is_owned): no turn to wait for
            return self
        if self.entry not in steps._steppers:
            self.since = time.monotonic()
            steps._steppers[self.entry] = (self.since, threading.get_ident())
        me = threading.get_ident()  # its own entry can only be one an interrupt left
        _wait(lambda: _fresh(steps._plain, but=me), self.since)
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:  # leaving the loop: no longer waiting
            self.steps._steppers.pop(self.entry, None)

    def go(self) -> bool:
        """Inside ``lock``: whether to step now. False while a plain taker waits (for at most
        ``MAX_TURN_WAIT_S`` since this loop began to wait): release the lock and come back."""
        steps = self.steps
        others = _fresh(steps._plain, but=threading.get_ident())  # not this thread's own hold
        if others and time.monotonic() - self.since < MAX_TURN_WAIT_S:
            return False
        steps._steppers.pop(self.entry, None)
        steps._plain_turns = 0
        return True


def _wait(blocked: Callable[[], object], since: float | None = None) -> None:
    """Poll ``blocked()`` until it is false, at most ``MAX_TURN_WAIT_S`` from ``since`` (default:
    now); sleeps 50 us at first, doubling up to 0.5 ms. A turn comes within a step (a plain
    taker's wait) or a plain taker's hold (a stepper's, noticed up to 0.5 ms late)."""
    deadline = (time.monotonic() if since is None else since) + MAX_TURN_WAIT_S
    pause = 5e-5
    while blocked() and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(2 * pause, 5e-4)


def _fresh(waiting: dict[int, tuple[float, int]], but: int | None = None) -> bool:
    """Whether a thread (other than ``but``) has waited less than ``MAX_TURN_WAIT_S`` (older
    entries were left by an interrupt, or have waited in vain: ignored)."""
    now = time.monotonic()
    return any(now - t < MAX_TURN_WAIT_S and who != but for t, who in tuple(waiting.values()))
