"""HTTP pieces every rlfleet server shares: the error type and its OpenAI-shaped body,
fast JSON responses, streamed responses, and noticing that the caller went away (one watcher
per request, nothing per streamed event). Binding and serving an app under the server
limits is `rlfleet.runtime.server`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

import msgspec
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import Receive, Scope, Send

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "method_not_allowed_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    502: "worker_error",
    503: "service_unavailable",
    504: "timeout_error",
}

_json = msgspec.json.Encoder()


def error_body(status: int, message: str, type_: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_ or _ERROR_TYPES.get(status, "internal_error"),
                      "param": param, "code": status}}


class HttpError(Exception):
    """A request failed with an HTTP status; servers render it once, as `error_body`
    (a JSON response, or the last event of a stream)."""

    def __init__(self, status: int, message: str, type_: str | None = None,
                 param: str | None = None, body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.body = body or error_body(status, message, type_, param)

    def response(self) -> Response:
        return json_response(self.body, self.status)


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None
                  ) -> Response:
    """A JSON response encoded with msgspec (dicts, lists or msgspec Structs; NaN and
    infinities become null)."""
    return Response(_json.encode(content), status, headers, media_type="application/json")


def error_response(status: int, message: str, type_: str | None = None,
                   param: str | None = None) -> Response:
    return json_response(error_body(status, message, type_, param), status)


async def _render_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HttpError)
    return exc.response()


async def _render_starlette_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"{request.url.path} is not a route of this server"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, message)


async def _render_unexpected(request: Request, exc: Exception) -> Response:
    """A bug, not bad input: still the error shape (never Starlette's plain-text 500);
    Starlette logs the traceback after this response is sent."""
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}"[:500])


# Starlette exception handlers: HttpError and Starlette's own 404/405 as error_body JSON,
# anything unexpected as a 500 in the same shape
ERROR_HANDLERS = {HttpError: _render_http_error, StarletteHTTPException: _render_starlette_error,
                  Exception: _render_unexpected}


_LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def bad_json_message(exc: Exception, raw: bytes = b"") -> str:
    """What is wrong with a request body that is not JSON rlfleet can read, in words."""
    if isinstance(exc, RecursionError):
        return "the request body is nested too deeply"
    if isinstance(exc, UnicodeError) or (raw and _LONE_SURROGATE.search(raw)):
        return ("the request body contains a lone UTF-16 surrogate (\\uD800-\\uDFFF not "
                "part of a pair), which is not a character: send valid Unicode")
    return str(exc) or type(exc).__name__


class ClientWatch:
    """Notices when the caller of one HTTP request closes its connection, and then cancels
    the task serving it (which aborts whatever that task waits on). One watcher task per
    request, started once the request body has been read; nothing per streamed event.

    The serving task catches that cancellation with `gone_on(exc)`. Call `finish()` before
    the last byte of the response is sent: from then on a closed connection is not a
    caller going away."""

    __slots__ = ("gone", "_done", "_task", "_target")

    def __init__(self, request: Request) -> None:
        self.gone = False
        self._done = False
        self._target = asyncio.current_task()
        self._task = asyncio.ensure_future(self._watch(request.receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self._done:
            self.gone = True
            if self._target is not None:
                self._target.cancel()

    def finish(self) -> None:
        self._done = True

    def gone_on(self, exc: BaseException) -> bool:
        """True when `exc` is this watcher's cancellation (then it is cleared, so that the
        task can finish its clean-up normally)."""
        if self.gone and isinstance(exc, asyncio.CancelledError):
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                task.uncancel()
            return True
        return False


# ASGI scope key: the server's `send` as the outermost middleware that looks only at the
# response start got it; a StreamResponse writes its body chunks with it, past the layers
# in between (one call per streamed token instead of one per layer)
DIRECT_SEND = "rlfleet.direct_send"


class StreamResponse(Response):
    """A streamed response (SSE or NDJSON) written chunk by chunk from `chunks`; when the
    caller goes away (the `watch` cancels this task), `chunks` is closed, which ends the
    work behind it, and nothing more is written."""

    def __init__(self, chunks: AsyncIterator[bytes], watch: ClientWatch, media_type: str,
                 headers: dict[str, str] | None = None,
                 on_end: Callable[[], None] | None = None) -> None:
        self.chunks, self.watch, self.on_end = chunks, watch, on_end
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            # the chunks are written by a task of their own, right under the event loop (as
            # Starlette's StreamingResponse does): a chunk then resumes that task's few frames,
            # not the middleware stack this request runs under. Cancelling this task (the
            # watch) cancels it too.
            await asyncio.ensure_future(self._write(scope.get(DIRECT_SEND, send)))
            self.watch.finish()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except BaseException as e:
            if not self.watch.gone_on(e):
                raise
        finally:
            self.watch.finish()
            with contextlib.suppress(Exception):
                await self.chunks.aclose()  # type: ignore[attr-defined]
            if self.on_end is not None:
                self.on_end()

    async def _write(self, send: Send) -> None:
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})


@functools.cache
def shared_routes(build: Callable[..., None], *args: Hashable) -> tuple[BaseRoute, ...]:
    """The routes `build(router, *args)` declares on a FastAPI router, made once per process
    and shared by every app that adds them (`app.router.routes.extend(...)`). FastAPI
    analyses a route's signature as it makes it (~1-2 ms a route): a process of 1,024
    simulated workers (the mocker's --replicas) would pay that for every worker's ~60 routes.
    A shared route's handler finds its own app's objects in `request.app.state`."""
    from fastapi import APIRouter

    router = APIRouter()
    build(router, *args)
    return tuple(router.routes)
