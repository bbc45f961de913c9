"""Runs kept by request ID, so that a retry reusing an `X-Request-Id` follows the first
attempt (in flight or ended) instead of generating again: the one registry that both the
frontend (rlfleet.frontend.runs: the runs it drives) and the worker (rlfleet.worker.kept:
the runs it owns for every frontend) build on.

A run is fed by one source (an async iterator of events) read by a task of its own, to
its end whoever listens; its events are kept, and every follower reads them all from the
start, then new ones as they come. A run that is not kept (`keep` false: nobody can come
back for it) belongs to its one follower: it is aborted when that follower leaves, and
is never registered. A kept run outlives its followers by `orphan_grace` seconds (then
it is aborted), and is remembered for `window` seconds after it ends: at most `max_runs`
runs and about `max_bytes` of their events (the oldest finished runs are forgotten
first; while runs still in flight hold more than that, new kept runs are refused with
429). `window` is `RLFLEET_KEPT_WINDOW` seconds (600 by default) in every process: how long
after a run ended a retry of its request ID still finds it. What a request ID stands for
(its body), and which ended runs a retry starts anew, are the layers' own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar

from rlfleet.protocol.engine import Head, Step
from rlfleet.runtime.http import HttpError

#: seconds an ended run is kept for a retry of its request ID (frontends and workers)
KEPT_WINDOW = float(os.environ.get("RLFLEET_KEPT_WINDOW", "600"))


def event_bytes(ev: Any) -> int:
    """How much memory one kept request-plane event (Head, Step, Done) holds as the Python
    objects msgspec decodes it into, by tracemalloc's count (tests/unit/test_kept_runs
    .py keeps the two within a few tens of percent, never below): a Step about 110 bytes, a
    choice's delta about 180 with its list, each token ID 36, text its length and a str's 49,
    each token's logprob 300 and each of its top alternatives 180; a Head 37 per prompt token
    ID; a Done 200 per prompt logprob entry. The allocator's own overhead and fragmentation
    come on top (BENCHMARKS.md, "Kept runs' memory")."""
    kind = type(ev)
    if kind is Step:
        n = 112
        for d in ev.choices:
            n += 176 + 36 * len(d.token_ids) + (len(d.text) + 49 if d.text else 0)
            if d.logprobs:
                n += sum(300 + 180 * len(lp.top) for lp in d.logprobs)
        return n
    if kind is Head:
        return 400 + 37 * len(ev.prompt_token_ids)
    prompt_logprobs = getattr(ev, "prompt_logprobs", None)
    return 96 + (sum(100 + 200 * len(p) for p in prompt_logprobs if p) if prompt_logprobs else 0)


class Run:
    """One run: its events from number `base` on, how it ended, who follows it."""

    __slots__ = ("request_id", "keep", "events", "base", "error", "done", "ended_at",
                 "followers", "bytes", "task", "_waiters", "_orphan")

    def __init__(self, request_id: str, keep: bool = True) -> None:
        self.request_id = request_id
        self.keep = keep  # outlives its followers (a retry may come back for it)
        self.events: list[Any] = []
        self.base = 0  # a run nobody else can join drops what its follower read (`release`)
        self.error: BaseException | None = None  # what ended it early (raised to followers)
        self.done = False
        self.ended_at: float | None = None
        self.followers = 0
        self.bytes = 0  # about how much its kept events hold
        self.task: asyncio.Task | None = None
        self._waiters: list[asyncio.Future] = []
        self._orphan: asyncio.TimerHandle | None = None

    def publish(self) -> None:
        """Wake every follower waiting for news (each waits on its own future, so that a
        follower that leaves cancels nobody else's wait)."""
        waiters = self._waiters
        if waiters:
            self._waiters = []
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    @property
    def produced(self) -> int:
        """How many events the run has produced so far."""
        return self.base + len(self.events)

    def since(self, i: int) -> list:
        """The events from number `i` on."""
        return self.events[i - self.base:]

    async def wait_past(self, i: int) -> None:
        """Until the run has more than `i` events or has ended."""
        while self.base + len(self.events) <= i and not self.done:
            w = asyncio.get_running_loop().create_future()
            self._waiters.append(w)
            await w

    async def follow(self) -> AsyncIterator[Any]:
        """Every event of the run from the start, then new ones as they come; then the
        error that ended it, if one did."""
        i = self.base
        while True:
            while i < self.base + len(self.events):
                yield self.events[i - self.base]
                i += 1
            if self.done:
                if self.error is not None:
                    raise self.error
                return
            await self.wait_past(i)


R = TypeVar("R", bound=Run)


def _abandoned() -> BaseException:
    return HttpError(499, "the request was abandoned before it finished")


class RunRegistry(Generic[R]):
    """The kept runs of one process, by request ID (see the module docstring). `size`:
    about how many bytes one event holds; `abandoned`: the error of a run aborted before
    its end (its last follower left, or the registry closed); `full`: what a kept run
    refused for want of room is told (429)."""

    def __init__(self, orphan_grace: float = 30.0, window: float = KEPT_WINDOW,
                 max_runs: int = 10_000, max_bytes: int = 1 << 30,
                 size: Callable[[Any], int] = lambda ev: 256,
                 abandoned: Callable[[], BaseException] = _abandoned,
                 full: str = "this process holds as much of requests with an X-Request-Id as "
                             "it may (runs in flight); retry shortly") -> None:
        self.orphan_grace, self.window = orphan_grace, window
        self.max_runs, self.max_bytes = max_runs, max_bytes
        self.size, self.abandoned, self.full = size, abandoned, full
        self.runs: OrderedDict[str, R] = OrderedDict()
        self.kept_bytes = 0

    def forget(self, request_id: str) -> None:
        run = self.runs.pop(request_id)
        self.kept_bytes -= run.bytes

    def _expire(self) -> None:
        """Forget runs that ended more than `window` ago, the oldest beyond `max_runs`, and
        the oldest finished ones while all hold more than `max_bytes` (a forgotten run
        still in flight finishes for the followers attached to it)."""
        now = time.monotonic()
        while self.runs:
            rid, run = next(iter(self.runs.items()))
            old = run.done and run.ended_at is not None and now - run.ended_at > self.window
            if not old and len(self.runs) <= self.max_runs:
                break
            self.forget(rid)
        if self.kept_bytes > self.max_bytes:
            for rid in [rid for rid, run in self.runs.items() if run.done]:
                self.forget(rid)
                if self.kept_bytes <= self.max_bytes:
                    break

    def get(self, request_id: str) -> R | None:
        """The run kept under `request_id` (after forgetting what is past keeping)."""
        self._expire()
        return self.runs.get(request_id)

    def running(self, request_id: str) -> R | None:
        run = self.runs.get(request_id)
        return None if run is None or run.done else run

    def start(self, run: R, source: Callable[[R], AsyncIterator[Any]]) -> R:
        """Feed `run` from `source(run)` (registered under its request ID if it is kept).
        HttpError 429 when kept runs in flight hold all the memory allowed."""
        if run.keep:
            if self.kept_bytes > self.max_bytes:
                raise HttpError(429, self.full)
            self.runs[run.request_id] = run
        run.task = asyncio.ensure_future(self._pump(run, source(run)))
        return run

    async def _pump(self, run: R, events: AsyncIterator[Any]) -> None:
        append = run.events.append
        size = self.size if run.keep else None
        try:
            async for ev in events:
                append(ev)
                if size is not None:
                    n = size(ev)
                    run.bytes += n
                    if self.runs.get(run.request_id) is run:
                        self.kept_bytes += n
                if run._waiters:
                    run.publish()
        except asyncio.CancelledError:
            run.error = self.abandoned()
        except BaseException as e:  # noqa: BLE001 - handed to every follower
            run.error = e
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]
            run.done = True
            run.ended_at = time.monotonic()
            self.ended(run)
            run.publish()

    def ended(self, run: R) -> None:
        """Told of every run that ends (before its followers hear of it)."""

    def attach(self, run: R) -> None:
        run.followers += 1
        if run._orphan is not None:
            run._orphan.cancel()
            run._orphan = None

    def detach(self, run: R) -> None:
        """A follower left: abort the run if nobody can come back for it, or
        `orphan_grace` seconds after the last follower of a kept run left."""
        run.followers -= 1
        task = run.task
        if run.followers > 0 or run.done or task is None:
            return
        if not run.keep:
            task.cancel()
            return
        run._orphan = asyncio.get_running_loop().call_later(
            self.orphan_grace, lambda: run.followers == 0 and task.cancel())

    async def close(self) -> None:
        """Abort every kept run still in flight."""
        for run in list(self.runs.values()):
            if run.task is not None and not run.task.done():
                run.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await run.task
