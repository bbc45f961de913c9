"""What every generation route shares: reading the body, the request ID, starting (or, for
a reused X-Request-Id, rejoining) the run, and following it to a unary response or a
stream of server-sent events. One watcher per request notices a caller that leaves;
nothing is allocated per token beyond the events themselves."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from rlfleet.frontend import smg
from rlfleet.frontend.dispatch import Dispatch
from rlfleet.frontend.result import Result, merge_deltas
from rlfleet.frontend.router import WorkerPool
from rlfleet.frontend.runs import (
    CANCEL_TOKEN_HEADER,
    GenerationRun,
    GenerationRuns,
    RequestIdConflict,
    fingerprint,
    token_hash,
)
from rlfleet.protocol.engine import Delta, Done, GenerateRequest, InvalidParam, SamplingOptions
from rlfleet.protocol.nvext import PolicyBound
from rlfleet.runtime import tracing
from rlfleet.runtime.http import (
    ClientWatch,
    HttpError,
    StreamResponse,
    bad_json_message,
    json_response,
)
from rlfleet.runtime.request_checks import check_request, check_sampling
from rlfleet.runtime.request_plane import StreamClient

REQUEST_ID_HEADER = "x-request-id"
# vLLM's and SkyRL's header naming related requests (an episode): the KV router keeps them
# on one worker (rlfleet.frontend.sessions); vLLM's native route also passes it to the engine
SESSION_ID_HEADER = "X-Session-ID"
_json = msgspec.json.Encoder()


@dataclass
class Frontend:
    """The state every route reads (from `request.app.state.frontend`)."""

    pool: WorkerPool
    client: StreamClient
    runs: GenerationRuns = field(default_factory=GenerationRuns)


def frontend_of(request: Request) -> Frontend:
    return request.app.state.frontend


async def parse_body(request: Request, cls: type[BaseModel]) -> Any:
    """The body as `cls`; HttpError 400 says what is wrong with it (and names the field)."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise HttpError(499, "client closed the request") from None
    try:
        obj = msgspec.json.decode(raw) if raw.strip() else None
    except (msgspec.DecodeError, RecursionError) as e:
        raise HttpError(400, f"the request body is not valid JSON: {bad_json_message(e, raw)}"
                        ) from None
    if not isinstance(obj, dict):
        raise HttpError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        raise HttpError(400, _validation_message(e), param=_validation_param(e)) from e
    except (ValueError, TypeError, RecursionError) as e:  # a validator that failed oddly
        raise HttpError(400, f"the request body cannot be read: {e}") from e


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msg = e.get("msg", "invalid").removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _validation_param(exc: ValidationError) -> str | None:
    for e in exc.errors():
        loc = e.get("loc", ())
        if loc:
            return str(loc[0])
    return None


def request_id(request: Request, prefix: str, given: str | None = None) -> str:
    """The request's ID: its X-Request-Id (a kept run, see runs.py), else the body's
    `request_id` (vLLM's field: names the request, nothing more), else a new one."""
    rid = request.headers.get(REQUEST_ID_HEADER)
    if rid is not None:
        if not 0 < len(rid) <= 256:
            raise HttpError(400, "X-Request-Id must be 1 to 256 characters")
        return rid
    return given or f"{prefix}-{uuid.uuid4().hex}"


def served_model(request: Request, model: str | None) -> str:
    """The model a request names, or, when it names none, the one model served (as vLLM
    serves its one model); several or none: HttpError."""
    if model is not None:
        return model
    models = frontend_of(request).pool.models()
    if len(models) == 1:
        return models[0]
    if not models:
        raise HttpError(503, "no worker serves a model yet; retry shortly")
    raise HttpError(400, f"model is required: this frontend serves {len(models)} models "
                         f"({', '.join(models)})", param="model")


async def decoded(request: Request, cls: type[BaseModel]) -> tuple[Any, str]:
    """A generation route's start: the body as `cls`, the engine's refusals of it checked
    (HttpError 400 naming the parameter), and the model it is for."""
    req = await parse_body(request, cls)
    engine_request(req.refusals)
    return req, served_model(request, req.model)


def engine_request(build: Callable[[], Any]) -> Any:
    """`build()`, from already validated parts; what it builds for the engine (generation
    requests, or sampling options alone) is checked as the engine would check it
    (rlfleet.runtime.request_checks). A value or combination the engine would refuse (say,
    min_tokens above max_tokens) is a 400 naming the parameter."""
    try:
        built = build()
        for item in built if isinstance(built, list) else (built,):
            if isinstance(item, GenerateRequest):
                check_request(item)
            elif isinstance(item, SamplingOptions):
                check_sampling(item)
        return built
    except InvalidParam as e:
        raise HttpError(400, str(e), param=e.param) from e
    except (ValueError, TypeError) as e:
        raise HttpError(400, str(e)) from e


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


class Follower:
    """One run followed by one HTTP request: folds its events into a Result, and detaches
    from the run exactly once."""

    __slots__ = ("runs", "run", "res", "_seen", "_ended")

    def __init__(self, runs: GenerationRuns, run: GenerationRun, res: Result) -> None:
        self.runs, self.run, self.res = runs, run, res
        self._seen = 0
        self._ended = False

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.runs.detach(self.run)

    async def take(self) -> tuple[list[Delta], bool]:
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
        while not (await self.take())[1]:
            pass


class Call:
    """One HTTP generation request following its runs (one per prompt of the request): one
    watcher notices a caller that leaves; every run is detached exactly once."""

    __slots__ = ("followers", "watch", "_ended")

    def __init__(self, followers: list[Follower], watch: ClientWatch) -> None:
        self.followers, self.watch = followers, watch
        self._ended = False

    @property
    def results(self) -> list[Result]:
        return [f.res for f in self.followers]

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.watch.finish()
            for f in self.followers:
                f.end()

    async def to_end(self) -> None:
        if len(self.followers) == 1:
            await self.followers[0].to_end()
        else:
            await asyncio.gather(*(f.to_end() for f in self.followers))

    async def batches(self) -> AsyncIterator[tuple[int, list[Delta], bool]]:
        """(prompt index, merged choice deltas, that prompt's run ended) per wake-up, until
        every run has ended."""
        if len(self.followers) == 1:
            f = self.followers[0]
            while True:
                deltas, done = await f.take()
                yield 0, merge_deltas(deltas), done
                if done:
                    return
        pending = {asyncio.ensure_future(f.take()): p for p, f in enumerate(self.followers)}
        try:
            while pending:
                finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in sorted(finished, key=pending.__getitem__):
                    p = pending.pop(t)
                    deltas, done = t.result()
                    yield p, merge_deltas(deltas), done
                    if not done:
                        pending[asyncio.ensure_future(self.followers[p].take())] = p
        finally:
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def unary(self, render: Callable[[], Any]) -> Response:
        """Follow the runs to their end and answer with `render()` as JSON."""
        try:
            await self.to_end()
            self.end()
            return json_response(render(), headers=smg.response_headers(self.results, True))
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
                              {"Cache-Control": "no-cache",
                               **smg.response_headers(self.results, False)}, on_end=self.end)


async def follow(request: Request, model: str, greqs: GenerateRequest | list[GenerateRequest],
                 results: Result | list[Result], bound: PolicyBound | None = None,
                 on_start: Callable[[list[GenerationRun]], None] | None = None) -> Call:
    """Start the request's runs, one per prompt (or rejoin the runs of a reused
    X-Request-Id), and wait for each worker's first event; fail before any byte is sent if
    a worker refuses its part (the other parts are then abandoned). `bound`: the request's
    staleness bound (nvext.policy), see Dispatch. `on_start` hears of the runs once they
    are started, before their first event (a unary run's worker may send none before its
    end), e.g. so that they can be aborted meanwhile."""
    fe = frontend_of(request)
    bound = smg.request_bound(request.headers, bound)  # or SMG's x-smg-version-policy
    if isinstance(greqs, GenerateRequest):
        greqs = [greqs]
    if isinstance(results, Result):
        results = [results]
    keep = REQUEST_ID_HEADER in request.headers
    session = session_of(request)
    request.state.model = model  # metrics labels (rlfleet.runtime.metrics)
    traceparent = tracing.outgoing(request.headers.get("traceparent"))
    for greq, res in zip(greqs, results, strict=True):
        res.model = model
        greq.traceparent = traceparent
    if keep:
        _check_batch_reuse(fe.runs, request.headers[REQUEST_ID_HEADER], len(greqs))
    body = await request.body()
    cancel_token = request.headers.get(CANCEL_TOKEN_HEADER)
    if keep:  # the worker keeps the run too, for a retry through another frontend
        retain = fingerprint(request.url.path, body)
        owner = token_hash(cancel_token)
        for greq in greqs:
            greq.retain, greq.cancel_hash = retain, None if owner is None else owner.hex()
    followers: list[Follower] = []
    try:
        for greq, res in zip(greqs, results, strict=True):
            # a run only this caller follows moves at the caller's pace; a kept run is read
            # to its end whoever listens, so that a retry finds it whole
            source = Dispatch(fe.pool, fe.client, model, greq, paced=not keep, bound=bound,
                              session=session)
            try:
                run, _ = fe.runs.start(greq.request_id, body, keep, source,
                                       route=request.url.path, cancel_token=cancel_token)
            except RequestIdConflict as e:
                raise HttpError(409, str(e)) from e
            fe.runs.attach(run)
            followers.append(Follower(fe.runs, run, res))
    except BaseException:
        for f in followers:
            f.end()
        raise
    call = Call(followers, ClientWatch(request))
    try:
        if on_start is not None:
            on_start([f.run for f in followers])
        if len(followers) == 1:
            await followers[0].head()
        else:
            heads = await asyncio.gather(*(f.head() for f in followers), return_exceptions=True)
            for h in heads:
                if isinstance(h, BaseException):
                    raise h
    except BaseException as e:
        call.end()
        if call.watch.gone_on(e):
            raise HttpError(499, "client closed the request") from None
        raise
    return call


def session_of(request: Request) -> str | None:
    """The request's X-Session-ID (None: not sent); HttpError 400 when too long."""
    session = request.headers.get(SESSION_ID_HEADER) or None
    if session is not None and len(session) > 256:
        raise HttpError(400, f"{SESSION_ID_HEADER} must be at most 256 characters")
    return session


def batch_request_id(rid: str, index: int, count: int) -> str:
    """The request ID of prompt `index` of a request of `count` prompts: the request's own
    ID for one prompt, else `<id>-<index>` (as vLLM names a batch's parts)."""
    return rid if count == 1 else f"{rid}-{index}"


def _check_batch_reuse(runs: GenerationRuns, rid: str, count: int) -> None:
    """An X-Request-Id used for one prompt is not reused for a batch, nor the reverse."""
    if count == 1:  # a batch has parts <id>-0 and <id>-1 at least
        used = f"{rid}-0" in runs.runs and f"{rid}-1" in runs.runs
    else:
        used = rid in runs.runs
    if used:
        raise HttpError(409, f"X-Request-Id {rid!r} was already used for a different request; "
                             "use a new request ID for a new request")
