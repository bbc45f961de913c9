"""The frontend's request-ID runs: replay, conflicts, orphan grace, bounded memory; and the
shared registry's runs handing events to a follower in the pump (Run.pour)."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.frontend.runs import GenerationRuns, RequestIdConflict
from rlfleet.runtime.runs import Run, RunRegistry
from tests.scripted import Scripted


async def events(n: int, delay: float = 0.0):
    for i in range(n):
        if delay:
            await asyncio.sleep(delay)
        yield {"i": i}


async def test_a_retry_replays_the_first_run_without_a_second_source():
    reg = GenerationRuns()
    source = Scripted(events(3))
    run, replayed = reg.start("r1", b"body", True, source)
    assert not replayed
    first = [e async for e in run.follow()]
    again, replayed = reg.start("r1", b"body", True, source)
    assert replayed and again is run and source.reads == 1
    assert [e async for e in again.follow()] == first == [{"i": 0}, {"i": 1}, {"i": 2}]
    with pytest.raises(RequestIdConflict):
        reg.start("r1", b"other body", True, source)


async def test_runs_without_a_request_id_stop_when_their_caller_leaves():
    reg = GenerationRuns(orphan_grace=0.05)
    run, _ = reg.start("anon", b"", False, Scripted(events(100, 0.01)))
    reg.attach(run)
    await asyncio.sleep(0.03)
    reg.detach(run)
    await asyncio.sleep(0.02)
    assert run.done and run.error is not None and len(run.events) < 100
    assert reg.running("anon") is None  # not remembered


async def test_kept_runs_wait_for_a_retry_then_give_up():
    # Timed with margins a loaded test process keeps (CI once stalled this loop > 50 ms).
    reg = GenerationRuns(orphan_grace=1.0)
    run, _ = reg.start("kept", b"", True, Scripted(events(1000, 0.01)))
    reg.attach(run)
    reg.detach(run)
    await asyncio.sleep(0.05)
    reg.attach(run)  # a retry came back within the grace period
    await asyncio.sleep(1.3)  # past the grace period the first detach started
    assert not run.done
    reg.detach(run)
    for _ in range(100):  # gives up a grace period after the retry left
        if run.done:
            break
        await asyncio.sleep(0.05)
    assert run.done and len(run.events) < 1000


async def test_memory_is_bounded():
    reg = GenerationRuns(max_runs=3, window=0.0)
    for i in range(10):
        run, _ = reg.start(f"r{i}", b"", True, Scripted(events(1)))
        await run.task
    reg.start("last", b"", True, Scripted(events(1)))
    assert len(reg.runs) <= 3


# ---------------------------------------------------------------- Run.pour (rlfleet.runtime.runs)

async def _ticks(n: int, error: BaseException | None = None):
    for i in range(n):
        await asyncio.sleep(0.001)
        yield i
    if error is not None:
        raise error


async def test_pour_hands_events_on_in_the_pump_until_the_sink_refuses_one():
    reg = RunRegistry()
    run = reg.start(Run("p"), lambda run: _ticks(10))
    await run.wait_past(1)  # two are there before the follower comes
    got, tasks = [], []

    def sink(ev) -> bool:
        if ev == 6:
            return False  # say, the stream's window is shut
        got.append(ev)
        tasks.append(asyncio.current_task())
        return True

    i = await run.pour(0, sink)
    assert i == 6 and got == [0, 1, 2, 3, 4, 5]
    me = asyncio.current_task()
    assert tasks[:2] == [me, me] and set(tasks[3:]) == {run.task}  # the live ones: the pump's
    assert await run.pour(7, lambda ev: got.append(ev) or True) == 10
    assert got[6:] == [7, 8, 9] and run.done and not run._taps


async def test_pour_ends_with_the_run_and_a_sink_that_fails_is_only_stopped():
    reg = RunRegistry()
    run = reg.start(Run("e"), lambda run: _ticks(5, ValueError("engine failed")))
    calls = []

    def failing(ev) -> bool:
        calls.append(ev)
        raise RuntimeError("cannot encode")

    other = []
    pours = asyncio.gather(run.pour(0, failing), run.pour(0, lambda ev: other.append(ev) or True))
    assert await pours == [0, 5]  # the failing one gets its first event back, on its own task
    assert calls == [0] and other == [0, 1, 2, 3, 4]
    assert isinstance(run.error, ValueError)


async def test_a_follower_that_leaves_takes_its_tap_away():
    reg = RunRegistry()
    run = reg.start(Run("c"), lambda run: _ticks(1000))
    follower = asyncio.ensure_future(run.pour(0, lambda ev: True))
    await asyncio.sleep(0.01)
    assert len(run._taps) == 1
    follower.cancel()
    with pytest.raises(asyncio.CancelledError):
        await follower
    assert not run._taps
    run.task.cancel()
