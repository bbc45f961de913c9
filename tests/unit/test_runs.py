"""The frontend's request-ID runs: replay, conflicts, orphan grace, bounded memory."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.frontend.runs import GenerationRuns, RequestIdConflict
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
    reg = GenerationRuns(orphan_grace=0.1)
    run, _ = reg.start("kept", b"", True, Scripted(events(1000, 0.01)))
    reg.attach(run)
    reg.detach(run)
    await asyncio.sleep(0.05)
    reg.attach(run)  # a retry came back within the grace period
    await asyncio.sleep(0.1)
    assert not run.done
    reg.detach(run)
    await asyncio.sleep(0.2)
    assert run.done and len(run.events) < 1000


async def test_memory_is_bounded():
    reg = GenerationRuns(max_runs=3, window=0.0)
    for i in range(10):
        run, _ = reg.start(f"r{i}", b"", True, Scripted(events(1)))
        await run.task
    reg.start("last", b"", True, Scripted(events(1)))
    assert len(reg.runs) <= 3
