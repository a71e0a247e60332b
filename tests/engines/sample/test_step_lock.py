"""``StepLock``: callers between steps are not starved by threads stepping in a loop, stepping
loops are not starved by a stream of such callers, and an interrupt never leaves the lock held
nor a turn lost for longer than ``MAX_TURN_WAIT_S``."""
import subprocess
import sys
import threading
import time

import pytest
from polynya.engines.sample import step_lock
from polynya.engines.sample.step_lock import StepLock


def _steppers(steps_lock, n: int, steps: list, stop: threading.Event) -> list[threading.Thread]:
    """``n`` threads, each a generate call's loop: take a turn and the lock, one 'step' (1 ms)."""
    def loop():
        turn = steps_lock.stepper()
        while not stop.is_set():
            with turn, steps_lock.lock:
                if not turn.go():
                    continue
                steps[0] += 1
                time.sleep(0.001)

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def _stop(stop: threading.Event, threads: list[threading.Thread]) -> None:
    stop.set()
    for t in threads:
        t.join(5)
        assert not t.is_alive()


@pytest.mark.parametrize("n", [1, 8])
def test_a_plain_taker_goes_in_at_the_next_step_boundary(n):
    steps_lock, steps, stop = StepLock(), [0], threading.Event()
    threads = _steppers(steps_lock, n, steps, stop)
    try:
        while steps[0] < 20:
            time.sleep(0.001)
        waited = []
        for _ in range(50):
            before = steps[0]
            with steps_lock.plain(), steps_lock.lock:
                waited.append(steps[0] - before)  # steps that ran while this taker waited
                held = steps[0]
                time.sleep(0.002)
                assert steps[0] == held  # no step runs while a plain taker holds it
            time.sleep(0.002)
        assert steps[0] >= 20 + 50  # the steppers ran between the takers
    finally:
        _stop(stop, threads)
    # the step running when the taker came, and at most one that took the lock meanwhile
    assert max(waited) <= 2, waited


@pytest.mark.parametrize("pollers", [1, 2])
def test_a_stream_of_plain_takers_does_not_stop_the_steps(pollers):
    """Threads taking the lock plainly in a tight loop (stats pollers): plain turns and steps
    alternate, so the steps go on at about the pace they have alone."""
    steps_lock, steps, polls, stop = StepLock(), [0], [0], threading.Event()

    def poll():
        while not stop.is_set():
            with steps_lock.plain(), steps_lock.lock:
                polls[0] += 1

    stepper = _steppers(steps_lock, 2, steps, stop)
    threads = stepper + [threading.Thread(target=poll, daemon=True) for _ in range(pollers)]
    for t in threads[2:]:
        t.start()
    time.sleep(1.0)
    _stop(stop, threads)
    # alone, 1 ms steps run ~900 times a second here; starved (before turns), a handful
    assert steps[0] > 300 and polls[0] > 300, (steps[0], polls[0])


def test_reentrant_for_both_kinds_of_holder():
    steps_lock, out = StepLock(), []
    turn = steps_lock.stepper()
    with turn, steps_lock.lock:
        assert turn.go()
        with steps_lock.plain(), steps_lock.lock, turn, steps_lock.lock:  # no wait inside
            assert turn.go()
            out.append(1)
    with steps_lock.plain(), steps_lock.lock, turn, steps_lock.lock:
        assert turn.go()
        out.append(2)
    assert out == [1, 2]
    got = []

    def other():
        with steps_lock.plain(), steps_lock.lock:
            got.append("plain")
        other_turn = steps_lock.stepper()
        with other_turn, steps_lock.lock:
            got.append(other_turn.go())

    t = threading.Thread(target=other)
    t.start()
    t.join(5)
    assert got == ["plain", True]  # released in full, no turn left waiting


def test_a_plain_taker_blocks_new_steps_until_it_leaves():
    steps_lock, entered = StepLock(), threading.Event()

    def step():
        turn = steps_lock.stepper()
        with turn, steps_lock.lock:
            entered.set()

    with steps_lock.plain(), steps_lock.lock:
        t = threading.Thread(target=step)
        t.start()
        assert not entered.wait(0.05)
    t.join(5)
    assert entered.is_set()


def test_a_lost_turn_costs_at_most_the_bound(monkeypatch):
    """A plain taker's entry left behind (what an interrupt in the bookkeeping can leave):
    steppers wait for it at most ``MAX_TURN_WAIT_S``, then ignore it."""
    monkeypatch.setattr(step_lock, "MAX_TURN_WAIT_S", 0.2)
    steps_lock, steps, stop = StepLock(), [0], threading.Event()
    steps_lock._plain[-1] = (time.monotonic(), -1)  # a plain taker that never comes
    start = time.monotonic()
    threads = _steppers(steps_lock, 2, steps, stop)
    while steps[0] < 20:
        assert time.monotonic() - start < 5
        time.sleep(0.001)
    _stop(stop, threads)
    assert 0.15 < time.monotonic() - start < 2


_STORM = """
import os, signal, sys, threading, time
from polynya.engines.sample.step_lock import StepLock

kind = sys.argv[1]
steps_lock, steps, stop = StepLock(), [0], threading.Event()

def loop():
    turn = steps_lock.stepper()
    while not stop.is_set():
        with turn, steps_lock.lock:
            if turn.go():
                steps[0] += 1
                time.sleep(0.001)

threads = [threading.Thread(target=loop, daemon=True) for _ in range(2)]
for t in threads:
    t.start()
armed, done, interrupts, leaked = [False], [False], [0], [0]

def on_sigint(signum, frame):
    if armed[0]:
        raise KeyboardInterrupt

def storm():
    while not done[0]:
        if armed[0]:
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.0003)

signal.signal(signal.SIGINT, on_sigint)
threading.Thread(target=storm, daemon=True).start()
turn = steps_lock.stepper()
deadline = time.monotonic() + 2.0
while True:  # an interrupt anywhere in an iteration is caught and counted
    try:
        armed[0] = True
        if time.monotonic() > deadline:
            break
        try:
            if kind == "plain":
                with steps_lock.plain(), steps_lock.lock:
                    pass
            else:
                with turn, steps_lock.lock:
                    turn.go()
        finally:
            leaked[0] += steps_lock.lock._is_owned()
    except KeyboardInterrupt:
        interrupts[0] += 1
while True:
    try:
        armed[0] = False
        time.sleep(0.05)
        done[0] = True
        break
    except KeyboardInterrupt:
        pass
before = steps[0]
time.sleep(0.3)
print(interrupts[0], leaked[0], steps[0] - before)
"""


@pytest.mark.parametrize("kind", ["plain", "stepping"])
def test_interrupts_never_leave_the_lock_held(kind, tmp_path):
    """Ctrl-C storms (SIGINT every ~0.3 ms, in a process of its own) while its main thread
    takes the lock over and over against two stepping threads: after every KeyboardInterrupt
    the main thread does not hold the lock, and the steppers go on afterwards."""
    script = tmp_path / "storm.py"
    script.write_text(_STORM)
    out = subprocess.run([sys.executable, str(script), kind], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    interrupts, leaked, steps_after = map(int, out.stdout.split())
    assert interrupts > 50 and leaked == 0 and steps_after > 30, out.stdout
