"""HTTP pieces every rlfleet server shares: OpenAI-shaped errors, binding, serving
several apps in one process, and ending work when the caller goes away."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi.responses import JSONResponse
from starlette.requests import Request

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "worker_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_body(status: int, message: str, type_: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_ or _ERROR_TYPES.get(status, "internal_error"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, type_: str | None = None,
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_, param), status_code=status)


def validation_message(exc: Exception) -> str:
    """One readable line from a pydantic ValidationError (or any exception)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    parts = []
    for e in errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msg = e.get("msg", "invalid").removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free one (read it back with getsockname)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the process that runs it."""

    def capture_signals(self):  # type: ignore[override]
        return contextlib.nullcontext()


class AppServer:
    """One ASGI app on one bound socket, started and stopped as an asyncio task."""

    def __init__(self, app: Any, sock: socket.socket, log_level: str = "warning") -> None:
        self.sock = sock
        host, port = sock.getsockname()[:2]
        self.host, self.port = host, port
        self._server = _Server(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                              access_log=False, timeout_keep_alive=30,
                                              timeout_graceful_shutdown=5))
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self.sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def until_disconnected(request: Request) -> None:
    """Return when the client closes its connection (the body must already be read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The caller closed its connection."""


async def first_or_gone(request: Request, items: AsyncIterator[Any]) -> Any:
    """The first item of `items`, unless the caller leaves first (then ClientGone, and the
    pending step is cancelled). StopAsyncIteration passes through."""
    first = asyncio.ensure_future(anext(items))
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait((first, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this task was cancelled: leave nothing running behind
        first.cancel()
        raise
    finally:
        gone.cancel()
    if not first.done():
        first.cancel()
        with contextlib.suppress(BaseException):
            await first
        raise ClientGone()
    return first.result()


async def stop_on_disconnect(request: Request, items: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """Relay `items` until the client goes away; then close `items` (which aborts the
    work behind it) and stop."""
    watcher = asyncio.ensure_future(until_disconnected(request))
    it = items.__aiter__()
    nxt: asyncio.Future | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            await asyncio.wait((nxt, watcher), return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                with contextlib.suppress(BaseException):
                    await nxt
                return
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        watcher.cancel()
        if nxt is not None and not nxt.done():  # this task was cancelled mid-wait
            nxt.cancel()
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
