"""What every generation route shares: reading the body, the request ID, starting (or, for
a reused X-Request-Id, rejoining) the run, and following it to a unary response or a
stream of server-sent events. One watcher per request notices a caller that leaves;
nothing is allocated per token beyond the events themselves."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from rlfleet.frontend.dispatch import Result, dispatch, merge_deltas
from rlfleet.frontend.router import WorkerPool
from rlfleet.frontend.runs import RequestIdConflict, Run, RunRegistry
from rlfleet.protocol.engine import Delta, Done, GenerateRequest
from rlfleet.runtime import tracing
from rlfleet.runtime.http import ClientWatch, HttpError, StreamResponse, json_response
from rlfleet.runtime.request_plane import WorkerClient

REQUEST_ID_HEADER = "x-request-id"
_json = msgspec.json.Encoder()


@dataclass
class Frontend:
    """The state every route reads (from `request.app.state.frontend`)."""

    pool: WorkerPool
    client: WorkerClient
    runs: RunRegistry = field(default_factory=RunRegistry)


def frontend_of(request: Request) -> Frontend:
    return request.app.state.frontend


async def parse_body(request: Request, cls: type[BaseModel]) -> Any:
    """The body as `cls`; HttpError 400 says what is wrong with it."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise HttpError(499, "client closed the request") from None
    try:
        obj = msgspec.json.decode(raw) if raw.strip() else None
    except msgspec.DecodeError as e:
        raise HttpError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise HttpError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        raise HttpError(400, _validation_message(e)) from e


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msg = e.get("msg", "invalid").removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def request_id(request: Request, prefix: str) -> str:
    rid = request.headers.get(REQUEST_ID_HEADER)
    if rid is not None:
        if not 0 < len(rid) <= 256:
            raise HttpError(400, "X-Request-Id must be 1 to 256 characters")
        return rid
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_request(build: Callable[[], GenerateRequest]) -> GenerateRequest:
    """`build()`, from already validated parts; a combination the engine would refuse
    (say, min_tokens above max_tokens) is a 400."""
    try:
        return build()
    except (ValueError, TypeError) as e:
        raise HttpError(400, str(e)) from e


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


class Follower:
    """One HTTP request following a run: folds its events into a Result, and ends (detach
    from the run, stop watching the caller) exactly once."""

    __slots__ = ("runs", "run", "res", "watch", "_seen", "_ended")

    def __init__(self, runs: RunRegistry, run: Run, res: Result, watch: ClientWatch) -> None:
        self.runs, self.run, self.res, self.watch = runs, run, res, watch
        self._seen = 0
        self._ended = False

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.watch.finish()
            self.runs.detach(self.run)

    async def _take(self) -> tuple[list[Delta], bool]:
        """Apply every event not seen yet (waiting for one if there is none): (the choice
        deltas among them, whether the run's last event was among them). Raises the run's
        error once its events are used up."""
        run = self.run
        await run.wait_past(self._seen)
        new = run.since(self._seen)
        self._seen = run.produced
        run.release(self._seen)
        deltas: list[Delta] = []
        done = False
        apply = self.res.apply
        for ev in new:
            deltas += apply(ev)
            if type(ev) is Done:
                done = True
        if not new and run.done:
            if run.error is not None:
                raise run.error
            done = True
        return deltas, done

    async def head(self) -> None:
        """Until the worker's first event (the Head, or the error that refused it)."""
        run = self.run
        if self._seen == 0:
            await run.wait_past(0)
            if not run.produced and run.error is not None:
                raise run.error
            if run.produced:
                self.res.apply(run.since(0)[0])
                self._seen = 1
                run.release(1)

    async def to_end(self) -> None:
        while not (await self._take())[1]:
            pass

    async def batches(self) -> AsyncIterator[tuple[list[Delta], bool]]:
        """(merged choice deltas, ended) per wake-up, until the run ends."""
        while True:
            deltas, done = await self._take()
            yield merge_deltas(deltas), done
            if done:
                return

    async def unary(self, render: Callable[[], Any]) -> Response:
        """Follow the run to its end and answer with `render()` as JSON."""
        try:
            await self.to_end()
            self.end()
            return json_response(render())
        except BaseException as e:
            if self.watch.gone_on(e):
                raise HttpError(499, "client closed the request") from None
            raise
        finally:
            self.end()

    def stream(self, chunks: AsyncIterator[bytes]) -> Response:
        """Server-sent events from `chunks`, then `[DONE]`; a failure becomes one error
        event and ends the stream without `[DONE]`."""
        async def body() -> AsyncIterator[bytes]:
            try:
                async for c in chunks:
                    yield c
            except HttpError as e:
                yield sse(e.body)
                return
            yield b"data: [DONE]\n\n"

        return StreamResponse(body(), self.watch, "text/event-stream",
                              {"Cache-Control": "no-cache"}, on_end=self.end)


async def follow(request: Request, model: str, greq: GenerateRequest, res: Result) -> Follower:
    """Start the request (or rejoin the run of a reused X-Request-Id) and wait for the
    worker's first event; fail before any byte is sent if no worker takes it."""
    fe = frontend_of(request)
    keep = REQUEST_ID_HEADER in request.headers
    res.model = request.state.model = model  # metrics labels (rlfleet.runtime.metrics)
    greq.traceparent = tracing.outgoing(request.headers.get("traceparent"))

    def source(run: Run) -> AsyncIterator:
        # a run only this caller follows moves at the caller's pace; a kept run is read to
        # its end whoever listens, so that a retry finds it whole
        return dispatch(fe.pool, fe.client, model, greq, lambda w: setattr(run, "worker", w),
                        None if keep else lambda s: setattr(run, "stream", s), paced=not keep)

    try:
        run, _ = fe.runs.start(greq.request_id, await request.body(), keep, source)
    except RequestIdConflict as e:
        raise HttpError(409, str(e)) from e
    fe.runs.attach(run)
    f = Follower(fe.runs, run, res, ClientWatch(request))
    try:
        await f.head()
    except BaseException as e:
        f.end()
        if f.watch.gone_on(e):
            raise HttpError(499, "client closed the request") from None
        raise
    return f
