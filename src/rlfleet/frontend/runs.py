"""Generation runs owned by the frontend, so that a retry reusing an `X-Request-Id` gets the
first attempt's result (in flight or completed) instead of generating again.

A run without a request ID belongs to its connection: when the caller leaves, it is
aborted. A run with a request ID outlives its caller for `orphan_grace` seconds, so a
retry can attach to it; its events are kept for `window` seconds after it ends (at most
`max_runs` runs are remembered)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from rlfleet.runtime import metrics
from rlfleet.runtime.request_plane import WorkerError

REPLAYS = metrics.FRONTEND_REPLAYS  # on the frontend's /metrics


class RequestIdConflict(Exception):
    """The request ID is already used by a different request body."""


@dataclass
class Run:
    request_id: str
    fingerprint: str
    keep: bool  # outlives its callers (it has a caller-chosen request ID)
    # events from number `base` on: a run that nobody else can join drops what its one
    # caller has read (`release`); a kept run keeps them all for retries
    events: list[dict] = field(default_factory=list)
    base: int = 0
    error: BaseException | None = None
    done: bool = False
    ended_at: float | None = None
    followers: int = 0
    worker: Any = None  # the worker that took it (rlfleet.frontend.router.Worker)
    stream: Any = None  # its paced stream, for a run that nobody else can join
    task: asyncio.Task | None = None
    _waiters: list[asyncio.Future] = field(default_factory=list)
    _orphan_timer: asyncio.TimerHandle | None = None

    def _publish(self) -> None:
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

    def release(self, upto: int) -> None:
        """Its caller has read the events before number `upto`: a run that nobody else can
        join forgets them."""
        if not self.keep and upto > self.base:
            n = upto - self.base
            del self.events[:n]
            self.base = upto
            if self.stream is not None:  # the worker may send as many more
                self.stream.taken(n)

    async def wait_past(self, i: int) -> None:
        """Until the run has more than `i` events or has ended."""
        while self.base + len(self.events) <= i and not self.done:
            w = asyncio.get_running_loop().create_future()
            self._waiters.append(w)
            await w

    async def follow(self) -> AsyncIterator[dict]:
        """Every event of the run from the start, then new ones as they come."""
        i = self.base
        while True:
            while i < self.produced:
                yield self.events[i - self.base]
                i += 1
            if self.done:
                if self.error is not None:
                    raise self.error
                return
            await self.wait_past(i)


@dataclass
class RunRegistry:
    orphan_grace: float = 30.0
    window: float = 600.0
    max_runs: int = 10_000
    runs: OrderedDict[str, Run] = field(default_factory=OrderedDict)

    def _expire(self) -> None:
        """Forget runs that ended more than `window` ago, and the oldest beyond `max_runs`
        (a forgotten run still in flight finishes for the callers attached to it)."""
        now = time.monotonic()
        while self.runs:
            run = next(iter(self.runs.values()))
            old = run.done and run.ended_at is not None and now - run.ended_at > self.window
            if not old and len(self.runs) <= self.max_runs:
                break
            self.runs.popitem(last=False)

    def start(self, request_id: str, body: bytes, keep: bool,
              source: Callable[[Run], AsyncIterator[dict]]) -> tuple[Run, bool]:
        """The run for `request_id`: an existing one (replayed) or a new one fed by `source`.
        Returns (run, replayed)."""
        fp = hashlib.blake2b(body, digest_size=16).hexdigest()
        self._expire()
        run = self.runs.get(request_id)
        if run is not None:
            if run.fingerprint != fp:
                raise RequestIdConflict(
                    f"X-Request-Id {request_id!r} was already used for a different request; "
                    "use a new request ID for a new request")
            REPLAYS.inc()
            return run, True
        run = Run(request_id, fp, keep)
        run.task = asyncio.create_task(self._pump(run, source(run)))
        if keep:
            self.runs[request_id] = run
        return run, False

    async def _pump(self, run: Run, events: AsyncIterator[dict]) -> None:
        append = run.events.append
        try:
            async for ev in events:
                append(ev)
                if run._waiters:
                    run._publish()
        except asyncio.CancelledError:
            run.error = WorkerError("the request was cancelled before it finished", 499)
        except BaseException as e:  # noqa: BLE001 - handed to every follower
            run.error = e
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]
            run.done = True
            run.ended_at = time.monotonic()
            run._publish()

    def attach(self, run: Run) -> None:
        run.followers += 1
        if run._orphan_timer is not None:
            run._orphan_timer.cancel()
            run._orphan_timer = None

    def detach(self, run: Run) -> None:
        """A caller stopped listening: abort the run if nobody can come back for it."""
        run.followers -= 1
        if run.followers > 0 or run.done or run.task is None:
            return
        if not run.keep:
            run.task.cancel()
            return
        run._orphan_timer = asyncio.get_running_loop().call_later(
            self.orphan_grace, lambda: run.followers == 0 and run.task.cancel())

    def running(self, request_id: str) -> Run | None:
        run = self.runs.get(request_id)
        return None if run is None or run.done else run
