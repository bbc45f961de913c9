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

A request marked `attach_only` only follows a kept run (running, or ended whole); where
there is none it is refused with ATTACH_NOT_FOUND and nothing is generated: a frontend
asks this of the workers an ID ranks above the one it places the request on, and tells
them where it places it (`placed_at`). A worker remembers that (a pointer per ID, for
`window` seconds, at most `max_runs`), and a later request for the ID (same `retain`),
attach-only or not, follows the run there (relayed: the peer's events become this run's)
before it would say "none" or generate it again.

A run the engine refused (the request as given) is not kept: a retry is checked again. A
run the engine failed, or that was abandoned, starts anew on a retry (nothing of it was
admitted: it never ended). A run ended by a cancel is kept with its partial output. The
registry itself (followers, orphan grace, bounds) is rlfleet.runtime.runs, shared with
the frontend's."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from rlfleet.protocol.engine import ATTACH_NOT_FOUND, Frame, GenerateRequest
from rlfleet.runtime.http import HttpError
from rlfleet.runtime.runs import KEPT_WINDOW, Run, RunRegistry, event_bytes


class KeptRun(Run):
    """One run kept by its request ID (rlfleet.runtime.runs.Run): its events are (kind,
    event) pairs, the Head first; what its ID stands for and its owner."""

    __slots__ = ("retain", "cancel_hash", "failed", "relayed_from")

    def __init__(self, req: GenerateRequest) -> None:
        super().__init__(req.request_id)
        self.retain, self.cancel_hash = req.retain, req.cancel_hash
        self.failed = False  # the engine failed it or it was abandoned: a retry starts anew
        # the worker whose run of the ID this one follows (a pointer said it was there)
        self.relayed_from: str | None = None

    @property
    def head(self) -> Any:
        return self.events[0][1] if self.events else None

    def may_cancel(self, owner: str) -> bool:
        return self.cancel_hash is not None and hmac.compare_digest(owner, self.cancel_hash)


Opener = Callable[[GenerateRequest], Awaitable[Any]]  # WorkerPlane.open
Rest = Callable[[Any], AsyncIterator[tuple[Frame, Any]]]  # WorkerPlane.rest
# the (kind, event) pairs of the run another worker keeps for the request, or None
Peer = Callable[[str, GenerateRequest], Awaitable[AsyncIterator[tuple[Frame, Any]] | None]]


def _not_found(req: GenerateRequest) -> HttpError:
    return HttpError(ATTACH_NOT_FOUND, f"this worker keeps no run under X-Request-Id "
                                       f"{req.request_id!r} (attach_only)")


class KeptRuns(RunRegistry[KeptRun]):
    """The runs one worker keeps (see the module docstring): the shared registry, with
    the request's `retain` checked (409) and a failed run started anew."""

    def __init__(self, open_: Opener, rest: Rest, orphan_grace: float = 30.0,
                 window: float = KEPT_WINDOW, max_runs: int = 10_000, max_bytes: int = 1 << 30,
                 attached: Callable[[], None] | None = None, peer: Peer | None = None) -> None:
        super().__init__(orphan_grace, window, max_runs, max_bytes,
                         size=lambda item: event_bytes(item[1]),
                         full="this worker holds as much of requests with an X-Request-Id as it "
                         "may (runs in flight); retry shortly")
        self._open, self._rest = open_, rest
        self._attached = attached  # told of each request that joins a kept run
        self._peer = peer  # follows a run another worker keeps (WorkerPlane.from_peer)
        # request ID -> (retain, the address it was placed at, when): told by attach-only
        # requests that found no run here (GenerateRequest.placed_at)
        self.pointers: OrderedDict[str, tuple[str | None, str, float]] = OrderedDict()
        self.started = 0  # runs started (each one generation); attaches are not counted
        self.relayed = 0  # runs followed where a pointer said they were placed

    def find(self, req: GenerateRequest) -> KeptRun | None:
        """The run to follow for `req`: the one kept under its ID (running, or ended
        whole), or None (none, or it failed: a retry starts anew). HttpError 409 when
        the ID names another request."""
        rid = req.request_id
        run = self.get(rid)
        if run is None:
            return None
        if run.retain != req.retain:
            raise HttpError(409, f"X-Request-Id {rid!r} was already used for a different "
                                 "request; use a new request ID for a new request")
        if run.done and (run.failed or run.error is not None):
            self.forget(rid)  # it failed: this attempt starts anew
            return None
        if self._attached is not None:
            self._attached()
        return run

    def start(self, req: GenerateRequest) -> KeptRun:  # type: ignore[override]
        """The run kept for `req.request_id`: the one running or ended (same `retain`), or a
        new one: relayed from where a pointer says the ID went, else generated (an
        attach-only request never generates: HttpError ATTACH_NOT_FOUND, at once or as the
        run's error). HttpError 409 (the ID names another request) or 429 (no room)."""
        run = self.find(req)
        if run is not None:
            return run
        elsewhere = self._pointed(req)
        if req.attach_only:
            if req.placed_at is not None:
                self._point(req)
            if elsewhere is None or self._peer is None:
                raise _not_found(req)
        run = super().start(KeptRun(req), lambda run: self._events(run, req, elsewhere))
        if elsewhere is None:
            self.started += 1
        return run

    def _point(self, req: GenerateRequest) -> None:
        """Remember where a request ID that found no run here was placed (at most
        `max_runs` IDs, for `window` seconds)."""
        now = time.monotonic()
        pointers = self.pointers
        pointers[req.request_id] = (req.retain, req.placed_at, now)  # type: ignore[assignment]
        pointers.move_to_end(req.request_id)
        while pointers and (len(pointers) > self.max_runs
                            or now - next(iter(pointers.values()))[2] > self.window):
            pointers.popitem(last=False)

    def _pointed(self, req: GenerateRequest) -> str | None:
        """Where an attempt of `req` (same ID and retain) was placed, if one was placed
        elsewhere after asking here (the pointer is used up)."""
        p = self.pointers.pop(req.request_id, None)
        if p is None or p[0] != req.retain or time.monotonic() - p[2] > self.window:
            return None
        return p[1]

    async def _events(self, run: KeptRun, req: GenerateRequest, elsewhere: str | None
                      ) -> AsyncIterator[tuple[Frame, Any]]:
        """The run's Head and events: those of the run the worker at `elsewhere` keeps
        under the ID, if it does; else from the engine (refused: the HttpError)."""
        if elsewhere is not None:
            relayed = None if self._peer is None else await self._peer(elsewhere, req)
            if relayed is not None:
                self.relayed += 1
                run.relayed_from = elsewhere
                async for kind, ev in relayed:
                    if kind is Frame.ERROR:
                        run.failed = True
                    yield kind, ev
                return
            if req.attach_only:
                raise _not_found(req)
            self.started += 1  # nothing kept there: generated here
        try:
            opened = await self._open(req)
        except HttpError:
            raise
        except Exception as e:  # noqa: BLE001 - the followers hear of it
            raise HttpError(500, f"worker failed: {type(e).__name__}: {e}") from e
        try:
            yield Frame.HEAD, opened.head
            async for kind, ev in self._rest(opened):
                if kind is Frame.ERROR:
                    run.failed = True
                yield kind, ev
        except (asyncio.CancelledError, GeneratorExit):  # orphaned: nobody came back for it
            opened.left()
            run.failed = True
            raise
        finally:
            await opened.aclose()

    def ended(self, run: KeptRun) -> None:
        if not run.events and self.runs.get(run.request_id) is run:
            self.forget(run.request_id)  # refused as given: nothing to keep

    def follow(self, run: KeptRun) -> AsyncIterator[tuple[Frame, Any]]:
        """(HEAD, head), then (kind, event) of every event of the run from the start, as
        they come. Raises the HttpError that refused it."""
        return run.follow()
