"""``GenerationGate`` (the server's pause modes): state before and after every call, refusals
leave the state unchanged."""
import asyncio

import pytest
from polynya.client.gate import GenerationGate


async def _work(release: asyncio.Event, value: int) -> int:
    await release.wait()
    return value


def test_keep_holds_new_requests_and_lets_running_ones_finish():
    async def main():
        gate, release = GenerationGate(), asyncio.Event()
        running = asyncio.create_task(gate.run(lambda: _work(release, 1)))
        await asyncio.sleep(0)
        assert gate.in_flight == 1
        await gate.pause("keep")  # returns at once
        assert gate.paused and gate.in_flight == 1
        held = asyncio.create_task(gate.run(lambda: _work(release, 2)))
        release.set()
        assert await running == 1
        await asyncio.sleep(0.01)
        assert not held.done() and gate.in_flight == 0
        gate.resume()
        assert await held == 2 and not gate.paused and gate.in_flight == 0

    asyncio.run(main())


def test_wait_returns_only_when_nothing_runs():
    async def main():
        gate, release = GenerationGate(), asyncio.Event()
        running = asyncio.create_task(gate.run(lambda: _work(release, 1)))
        await asyncio.sleep(0)
        pausing = asyncio.create_task(gate.pause("wait"))
        await asyncio.sleep(0.01)
        assert not pausing.done() and gate.paused
        release.set()
        await pausing
        assert running.done() and gate.in_flight == 0
        gate.resume()

    asyncio.run(main())


def test_abort_stops_running_requests_and_late_arrivals():
    """Mode abort: every engine request in flight is stopped, including one that passed the
    gate but reached its engine after the first abort round; new requests wait for resume."""
    async def main():
        gate, engine, rounds = GenerationGate(), [], []

        async def work(delay: float) -> str:  # an engine call that runs until aborted
            await asyncio.sleep(delay)
            engine.append(asyncio.get_running_loop().create_future())
            return await engine[-1]

        async def abort() -> None:
            rounds.append(sum(not f.done() for f in engine))
            for f in engine:
                if not f.done():
                    f.set_result("partial")

        running = [asyncio.create_task(gate.run(lambda d=d: work(d))) for d in (0, 0, 0.08)]
        await asyncio.sleep(0.01)
        assert gate.in_flight == 3 and len(engine) == 2
        await gate.pause("abort", abort)
        assert [t.result() for t in running] == ["partial"] * 3
        assert rounds[0] == 2 and sum(rounds) == 3, rounds
        assert gate.paused and gate.in_flight == 0
        held = asyncio.create_task(gate.run(lambda: _work(_set(), 4)))
        await asyncio.sleep(0.01)
        assert not held.done()
        gate.resume()
        assert await held == 4

    asyncio.run(main())


def test_failed_abort_leaves_the_gate_open():
    async def main():
        gate, release = GenerationGate(), asyncio.Event()
        running = asyncio.create_task(gate.run(lambda: _work(release, 1)))
        await asyncio.sleep(0)

        async def broken() -> None:
            raise RuntimeError("engine gone")

        with pytest.raises(RuntimeError, match="engine gone"):
            await gate.pause("abort", broken)
        assert not gate.paused and gate.in_flight == 1
        release.set()
        assert await running == 1

    asyncio.run(main())


@pytest.mark.parametrize("mode, exc, match", [("abort", NotImplementedError, "needs engines that"),
                                              ("freeze", ValueError, "pause mode must be")])
def test_refused_modes_leave_the_gate_open(mode, exc, match):
    async def main():
        gate = GenerationGate()
        with pytest.raises(exc, match=match):
            await gate.pause(mode)
        assert not gate.paused
        assert await gate.run(lambda: _work(_set(), 3)) == 3

    asyncio.run(main())


def _set() -> asyncio.Event:
    e = asyncio.Event()
    e.set()
    return e
