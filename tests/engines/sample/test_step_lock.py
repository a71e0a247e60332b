"""``StepLock``: callers between steps are not starved by threads stepping in a loop."""
import threading
import time

import pytest

from polynya.engines.sample.step_lock import StepLock


def _steppers(lock, n: int, steps: list, stop: threading.Event) -> list[threading.Thread]:
    """``n`` threads, each a generate call's loop: take the lock, one 'step' (1 ms), again."""
    def loop():
        while not stop.is_set():
            with lock.stepping():
                steps[0] += 1
                time.sleep(0.001)

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("n", [1, 8])
def test_a_plain_taker_goes_in_at_the_next_step_boundary(n):
    lock, steps, stop = StepLock(), [0], threading.Event()
    threads = _steppers(lock, n, steps, stop)
    try:
        while steps[0] < 20:
            time.sleep(0.001)
        waited = []
        for _ in range(50):
            before = steps[0]
            with lock:
                waited.append(steps[0] - before)  # steps that ran while this taker waited
                held = steps[0]
                time.sleep(0.002)
                assert steps[0] == held  # no step runs while a plain taker holds it
            time.sleep(0.002)
        assert steps[0] > 70  # the steppers ran between the takers
    finally:
        stop.set()
        for t in threads:
            t.join(5)
    # the step running when the taker came, and at most one that took the lock meanwhile
    assert max(waited) <= 2, waited


def test_reentrant_for_both_kinds_of_holder():
    lock, out = StepLock(), []
    with lock.stepping():
        with lock:
            with lock.stepping():
                out.append(1)
    with lock:
        with lock.stepping():
            out.append(2)
    assert out == [1, 2]
    t = threading.Thread(target=lambda: lock.__enter__() and lock.__exit__())
    t.start()
    t.join(5)
    assert not t.is_alive()  # released in full: another thread gets it


def test_a_plain_taker_blocks_new_steps_until_it_leaves():
    lock, entered = StepLock(), threading.Event()

    def step():
        with lock.stepping():
            entered.set()

    with lock:
        t = threading.Thread(target=step)
        t.start()
        assert not entered.wait(0.05)
    t.join(5)
    assert entered.is_set()
