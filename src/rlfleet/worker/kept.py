"""Runs a worker owns by request ID, so that a retry of an `X-Request-Id` through any
frontend (another process on the same port, another frontend on the same discovery store)
attaches to the first attempt instead of generating again.

A frontend marks such a request with `GenerateRequest.retain` (what the ID stands for: a
digest of the route and body) and routes it by its ID (every frontend ranks the model's
workers the same way for one ID: rlfleet.frontend.router.rank). The worker keeps the run
under its request ID: a second request with the same ID and `retain` follows it from its
Head (every event so far, then the new ones); the same ID with another `retain` is refused
with 409. A kept run outlives the connections that follow it by `orphan_grace` seconds
(then it is aborted), and its events are kept for `window` seconds after it ends (at most
`max_runs` runs and about `max_bytes` of events; beyond that the oldest finished runs are
forgotten, and while runs in flight hold it all, new kept requests are refused with 429).

A run the engine refused (the request as given) is not kept: a retry is checked again. A
run the engine failed, or that was abandoned, starts anew on a retry (nothing of it was
admitted: it never ended). A run ended by a cancel is kept with its partial output."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from rlfleet.protocol.engine import Frame, GenerateRequest
from rlfleet.runtime.http import HttpError


def event_bytes(ev: Any) -> int:
    """About how much memory one kept engine event (a dict) holds."""
    if not isinstance(ev, dict):
        return 256
    n = 64
    for c in ev.get("choices") or ():
        n += 64 + 40 * len(c.get("token_ids") or ()) + len(c.get("text") or "") \
            + 200 * len(c.get("logprobs") or ())
    plps = ev.get("prompt_logprobs")
    return n + (200 * len(plps) if isinstance(plps, list) else 0)


class KeptRun:
    """One run kept by its request ID: its Head, its events after it, how it ended."""

    __slots__ = ("request_id", "retain", "cancel_hash", "head", "events", "error", "done",
                 "failed", "ended_at", "followers", "bytes", "task", "_waiters", "_orphan")

    def __init__(self, req: GenerateRequest) -> None:
        self.request_id, self.retain = req.request_id, req.retain
        self.cancel_hash = req.cancel_hash
        self.head: Any = None
        self.events: list[tuple[Frame, Any]] = []  # (STEP | DONE | ERROR, event) after the Head
        self.error: HttpError | None = None  # refused when opened
        self.done = False
        self.failed = False  # the engine failed it or it was abandoned: a retry starts anew
        self.ended_at: float | None = None
        self.followers = 0
        self.bytes = 0
        self.task: asyncio.Task | None = None
        self._waiters: list[asyncio.Future] = []
        self._orphan: asyncio.TimerHandle | None = None

    def publish(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def wait_past(self, i: int) -> None:
        """Until the run has its Head and more than `i` events after it, or has ended."""
        while not self.done and (self.head is None or len(self.events) <= i):
            w = asyncio.get_running_loop().create_future()
            self._waiters.append(w)
            await w

    def may_cancel(self, owner: str) -> bool:
        return self.cancel_hash is not None and hmac.compare_digest(owner, self.cancel_hash)


Opener = Callable[[GenerateRequest], Awaitable[Any]]  # WorkerPlane.open
Rest = Callable[[Any], AsyncIterator[tuple[Frame, Any]]]  # WorkerPlane.rest


class KeptRuns:
    """The runs one worker keeps (see the module docstring)."""

    def __init__(self, open_: Opener, rest: Rest, orphan_grace: float = 30.0,
                 window: float = 600.0, max_runs: int = 10_000, max_bytes: int = 1 << 30,
                 attached: Callable[[], None] | None = None) -> None:
        self._open, self._rest = open_, rest
        self._attached = attached  # told of each request that joins a kept run
        self.orphan_grace, self.window = orphan_grace, window
        self.max_runs, self.max_bytes = max_runs, max_bytes
        self.runs: OrderedDict[str, KeptRun] = OrderedDict()
        self.kept_bytes = 0
        self.started = 0  # runs started (each one generation); attaches are not counted

    def _forget(self, rid: str) -> None:
        run = self.runs.pop(rid)
        self.kept_bytes -= run.bytes

    def _expire(self) -> None:
        now = time.monotonic()
        while self.runs:
            rid, run = next(iter(self.runs.items()))
            old = run.done and run.ended_at is not None and now - run.ended_at > self.window
            if not old and len(self.runs) <= self.max_runs:
                break
            self._forget(rid)
        if self.kept_bytes > self.max_bytes:
            for rid in [rid for rid, run in self.runs.items() if run.done]:
                self._forget(rid)
                if self.kept_bytes <= self.max_bytes:
                    break

    def start(self, req: GenerateRequest) -> KeptRun:
        """The run kept for `req.request_id`: the one running or ended (same `retain`), or a
        new one. HttpError 409 (the ID names another request) or 429 (no room)."""
        self._expire()
        rid = req.request_id
        run = self.runs.get(rid)
        if run is not None:
            if run.retain != req.retain:
                raise HttpError(409, f"X-Request-Id {rid!r} was already used for a different "
                                     "request; use a new request ID for a new request")
            if not (run.done and (run.failed or run.error is not None)):
                if self._attached is not None:
                    self._attached()
                return run
            self._forget(rid)  # it failed: this attempt starts anew
        if self.kept_bytes > self.max_bytes:
            raise HttpError(429, "this worker holds as much of requests with an X-Request-Id as "
                                 "it may (runs in flight); retry shortly")
        run = KeptRun(req)
        self.runs[rid] = run
        self.started += 1
        run.task = asyncio.ensure_future(self._pump(run, req))
        return run

    async def _pump(self, run: KeptRun, req: GenerateRequest) -> None:
        try:
            try:
                opened = await self._open(req)
            except HttpError as e:
                run.error = e
                return
            except asyncio.CancelledError:
                run.error = HttpError(499, "the request was abandoned before its first token")
                return
            run.head = opened.head
            run.publish()
            try:
                async for kind, ev in self._rest(opened):
                    run.events.append((kind, ev))
                    size = event_bytes(ev)
                    run.bytes += size
                    if self.runs.get(run.request_id) is run:
                        self.kept_bytes += size
                    if kind is Frame.ERROR:
                        run.failed = True
                    if run._waiters:
                        run.publish()
            except asyncio.CancelledError:  # orphaned: nobody came back for it
                opened.left()
                run.failed = True
            finally:
                await opened.aclose()
        finally:
            if run.error is not None and self.runs.get(run.request_id) is run:
                self._forget(run.request_id)  # refused as given: nothing to keep
            run.done = True
            run.ended_at = time.monotonic()
            run.publish()

    def attach(self, run: KeptRun) -> None:
        run.followers += 1
        if run._orphan is not None:
            run._orphan.cancel()
            run._orphan = None

    def detach(self, run: KeptRun) -> None:
        """A follower left: abort the run `orphan_grace` seconds after the last one did."""
        run.followers -= 1
        if run.followers > 0 or run.done or run.task is None:
            return
        task = run.task
        run._orphan = asyncio.get_running_loop().call_later(
            self.orphan_grace, lambda: run.followers == 0 and task.cancel())

    async def follow(self, run: KeptRun) -> AsyncIterator[tuple[Frame, Any]]:
        """(HEAD, head), then (kind, event) of every event of the run from the start, as
        they come. Raises the HttpError that refused it."""
        await run.wait_past(-1)
        if run.head is None:
            raise run.error or HttpError(500, "the request ended before its first event")
        yield Frame.HEAD, run.head
        i = 0
        while True:
            events = run.events
            while i < len(events):
                yield events[i]
                i += 1
            if run.done:
                return
            await run.wait_past(i)

    async def close(self) -> None:
        for run in list(self.runs.values()):
            if run.task is not None and not run.task.done():
                run.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await run.task
