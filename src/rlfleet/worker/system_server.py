"""A worker's system server: /health (and /live), /metrics and POST /engine/<route>, with the
contract's shared HTTP behaviour, bearer-token auth on mutating routes, per-worker
serialisation of control calls, fleet-epoch fencing, and (tests only) fault injection. The
route table is data (rlfleet.protocol.admin): each engine flavour hands in its `Route`s, a
route of the table with its handler, which takes the route's request Struct and returns its
reply Struct; a body is decoded against the request once, here.

Fencing (an rlfleet extension): a refresh coordinator sends its fleet epoch in
`X-Fleet-Epoch` on every call. The worker remembers the newest epoch a mutating call
brought and refuses any call from an older one with HTTP 409
`{"error": "Stale fleet epoch", "message", "fleet_epoch", "newest_fleet_epoch"}`, so a
coordinator that was paused or partitioned cannot act on a fleet another one has taken
over. Calls without the header (an operator, a test) are not fenced.

/health answers as Dynamo's workers do: HTTP 200 `{"status": "ready", ...}` once the worker
serves, HTTP 503 `{"status": "notready", ...}` before and while it shuts down, with
`uptime` `{"secs", "nanos"}` and whatever the worker adds (identity, weights, gate)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hmac
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlfleet.protocol import admin
from rlfleet.protocol.admin import EPOCH_HEADER, STALE_EPOCH, AdminRoute
from rlfleet.protocol.admin_base import (
    AdminRequestError,
    ErrorBody,
    Reply,
    StaleEpochError,
    UnsupportedRequest,
)
from rlfleet.protocol.admin_faults import FaultReply, FaultRequest
from rlfleet.runtime import metrics, tracing
from rlfleet.runtime.http import bad_json_message, shared_routes

log = logging.getLogger("rlfleet.system")

Handler = Callable[[Any], Awaitable[Any]]
#: a route of the serving table run in-process by a handler of that table (a composite
#: call: commit_policy): `(name, body) -> (HTTP status, reply body)`, under the route's rules
#: (fence, armed faults, `changed`, the mounted routes' view) but the control lock, which the
#: calling handler holds
TableCall = Callable[[str, dict[str, Any]], Awaitable[tuple[int, Any]]]
_TABLE_CALL: contextvars.ContextVar[TableCall | None] = contextvars.ContextVar(
    "rlfleet_table_call", default=None)


def table_call() -> TableCall | None:
    """For a handler: how to run another route of its server's table (None outside one)."""
    return _TABLE_CALL.get()


_CALL_EPOCH: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "rlfleet_call_epoch", default=None)


def call_epoch() -> int | None:
    """For a handler: the fleet epoch its call came with (None: no header, or a route that
    is not fenced), for one that calls other workers on the caller's behalf (the relay)."""
    return _CALL_EPOCH.get()


@dataclass(frozen=True)
class Route:
    """A route of the admin table and the handler that serves it on this worker: it takes
    the route's request Struct and returns its reply Struct."""

    spec: AdminRoute
    handler: Handler

    @property
    def name(self) -> str:
        return self.spec.name


class InjectedFault(Exception):
    pass


#: runs one call of a route outside the table under the table's rules (the admin token,
#: the fence, the control lock, `changed`): `guard(request, name, call, mutating=,
#: serialized=)` answers 401/400/409 itself, else `call()`'s response
Guard = Callable[..., Awaitable[Response]]


class MountedRoutes(Protocol):
    """Routes a worker serves beside /engine/* under the same rules (vLLM's native RL
    routes, rlfleet.worker.native_rl), told of every table call that succeeded."""

    def mount(self, app: FastAPI, guard: Guard) -> None: ...

    def observe(self, spec: AdminRoute, req: Any, reply: Any, epoch: int | None) -> None: ...


class StaleEpoch(Exception):
    """A call from an older fleet epoch than the newest the worker has seen."""

    def __init__(self, epoch: int, newest: int) -> None:
        super().__init__(f"fleet epoch {epoch} is older than epoch {newest}, the newest this "
                         "worker has seen: another refresh coordinator has taken over the "
                         "fleet; this one must stop (its calls are refused)")
        self.epoch, self.newest = epoch, newest

    def response(self) -> Response:
        return _encoded(StaleEpochError(error=STALE_EPOCH, message=str(self),
                                        fleet_epoch=self.epoch, newest_fleet_epoch=self.newest),
                        409)


@dataclass
class FleetFence:
    """The newest fleet epoch this worker has seen; one per worker, shared by its system
    server (which enforces it) and whatever reports it (get_weight_version, discovery)."""

    newest: int = 0

    @staticmethod
    def parse(raw: str | None) -> int | None:
        """The header's epoch; ValueError says what is wrong with it."""
        if raw is None:
            return None
        text = raw.strip()
        if not text.isdigit() or len(text) > 19:
            raise ValueError(f"{EPOCH_HEADER} must be a non-negative integer, not {raw!r}")
        return int(text)

    def check(self, epoch: int | None, *, advance: bool) -> None:
        """Refuse an epoch older than the newest seen (StaleEpoch); with `advance` (a
        mutating call), a newer one becomes the newest."""
        if epoch is None:
            return
        if epoch < self.newest:
            raise StaleEpoch(epoch, self.newest)
        if advance and epoch > self.newest:
            log.info("fleet epoch %d (was %d)", epoch, self.newest)
            self.newest = epoch


@dataclass
class FaultInjector:
    """Makes named routes fail a given number of times (tests only)."""

    faults: dict[str, dict[str, Any]] = field(default_factory=dict)

    async def arm(self, req: FaultRequest) -> FaultReply:
        if req.times == 0:
            self.faults.pop(req.route, None)
        else:
            self.faults[req.route] = {"mode": req.mode, "times": req.times,
                                      "hang_seconds": float(req.hang_seconds), "body": req.body}
        return FaultReply(route=req.route, mode=req.mode, times=req.times)

    async def check(self, route: str) -> Any:
        """Apply an armed fault for `route`: returns an error body, raises, hangs or exits."""
        f = self.faults.get(route)
        if f is None:
            return None
        f["times"] -= 1
        if f["times"] <= 0:
            self.faults.pop(route)
        log.warning("injecting fault %s into %s", f["mode"], route)
        if f["mode"] == "exit":
            os._exit(17)
        if f["mode"] == "delay":
            await asyncio.sleep(f["hang_seconds"])
            return None
        if f["mode"] == "hang":
            await asyncio.sleep(f["hang_seconds"])
        if f["mode"] == "http500":
            raise InjectedFault(f"injected failure of {route}")
        if f["mode"] == "respond":
            return dict(f["body"])
        return Reply.failed(f"injected failure of {route}")


def _encoded(body: Any, status_code: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status_code,
                    media_type="application/json")


def _http_error(error: str, message: str, status_code: int) -> Response:
    return _encoded(ErrorBody(error=error, message=message), status_code)


def system_app(routes: list[Route], *, admin_token: str | None = None,
               faults: FaultInjector | None = None,
               health: Callable[[], dict[str, Any]] | None = None,
               ready: Callable[[], bool] | None = None,
               fence: FleetFence | None = None,
               changed: Callable[[], Awaitable[None]] | None = None,
               mounted: MountedRoutes | None = None) -> FastAPI:
    """`health` adds fields to /health; `ready` says whether the worker serves (default:
    always, once this app answers); `fence`: the worker's fleet epoch (default: one of this
    app's own); `changed` is awaited after every mutating call (under the control lock for
    serialized routes), for a worker that publishes its state (discovery); `mounted`: routes
    served beside the table under its rules."""
    table = {r.name: r for r in routes}
    if faults is not None:
        table_with_faults = {**table, admin.FAULT_INJECTION.name:
                             Route(admin.FAULT_INJECTION, faults.arm)}
    else:
        table_with_faults = table
    app = FastAPI(title="rlfleet worker system server", docs_url=None, redoc_url=None)
    app.add_exception_handler(StarletteHTTPException, _route_not_served)
    # a coordinator's control calls join its trace (a policy refresh: a span per call)
    app.add_middleware(tracing.ServerSpans,
                       match=lambda path: path.startswith(f"{admin.ROUTE_PREFIX}/"))
    app.state.status = _Status(time.monotonic_ns(), health, ready)
    app.router.routes.extend(shared_routes(_status_routes))
    calls = _Calls(table_with_faults, admin_token, faults,
                   fence if fence is not None else FleetFence(), changed, mounted)
    app.state.calls = calls
    app.state.listed = sorted(n for n, r in table.items() if r.spec.listed)
    if mounted is not None:
        mounted.mount(app, calls.guard)
    app.router.routes.extend(shared_routes(_engine_routes))
    return app


def _engine_routes(r: APIRouter) -> None:
    """The route table's routes, shared by the process's workers (shared_routes): each
    app's own table in `app.state`."""
    @r.get(admin.ROUTE_PREFIX)
    async def _routes(request: Request):
        """The advertised route table (what the RL listener probes; fault name `engine`)."""
        return await request.app.state.calls.listing(request.app.state.listed)

    @r.api_route(admin.ROUTE_PREFIX + "/{name:path}", methods=["GET", "POST"])
    async def _engine_route(name: str, request: Request):
        return await request.app.state.calls.serve(name, request)


async def _route_not_served(request: Request, exc: Exception) -> Response:
    """The contract's error shape for paths and methods no route serves too."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        body = ErrorBody(error="Route not found", message=f"Route {request.url.path} not found")
    elif exc.status_code == 405:
        body = ErrorBody(error="Method not allowed",
                         message=f"{request.method} is not allowed on {request.url.path}")
    else:
        body = ErrorBody(error=str(exc.detail), message=str(exc.detail))
    return Response(msgspec.json.encode(body), status_code=exc.status_code, headers=exc.headers,
                    media_type="application/json")


@dataclass(frozen=True)
class _Status:
    """What a worker's /health says of it (`app.state.status`)."""
    started: int  # time.monotonic_ns() when its app was made
    health: Callable[[], dict[str, Any]] | None
    ready: Callable[[], bool] | None


def _status_routes(r: APIRouter) -> None:
    @r.get("/metrics")
    async def _metrics():
        return metrics.metrics_response(metrics.WORKER)

    @r.get("/health")
    @r.get("/live")
    async def _health(request: Request):
        status: _Status = request.app.state.status
        up = time.monotonic_ns() - status.started
        serving = status.ready() if status.ready else True
        body = {"status": "ready" if serving else "notready",
                "uptime": {"secs": up // 1_000_000_000, "nanos": up % 1_000_000_000},
                **(status.health() if status.health else {})}
        return JSONResponse(body, status_code=200 if serving else 503)


@dataclass
class _Calls:
    """How a call to a route is served: authorised, decoded, fenced, serialised, answered."""

    table: dict[str, Route]
    admin_token: str | None
    faults: FaultInjector | None
    fence: FleetFence
    changed: Callable[[], Awaitable[None]] | None
    mounted: MountedRoutes | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # control calls, one at a time
    running: list[str] = field(default_factory=list)  # the one that holds the lock

    async def listing(self, names: list[str]) -> Any:
        if self.faults is not None:
            try:
                injected = await self.faults.check("engine")
            except InjectedFault as e:
                return _http_error("Handler error", str(e), 500)
            if injected is not None:
                return _encoded(injected)
        return {"routes": names}

    def authorized(self, request: Request) -> bool:
        if not self.admin_token:
            return True
        got = request.headers.get(admin.AUTH_HEADER, "")
        return hmac.compare_digest(got.encode(), admin.bearer(self.admin_token).encode())

    async def serve(self, name: str, request: Request) -> Response:
        route = self.table.get(name)
        if route is None:
            return _http_error("Route not found",
                               f"Route {admin.ROUTE_PREFIX}/{name} not found", 404)
        spec = route.spec
        metrics.WORKER_ADMIN_CALLS.labels(spec.name).inc()
        if spec.mutating and not self.authorized(request):
            return _http_error("Unauthorized", f"this route needs '{admin.AUTH_HEADER}: "
                               "Bearer <admin token>'", 401)
        raw = await request.body()
        try:
            body = _read_json(raw) if raw.strip() else {}
        except (ValueError, RecursionError) as e:
            return _http_error("Invalid JSON", bad_json_message(e), 400)
        if not isinstance(body, dict):
            return _encoded(Reply.failed("request body must be a JSON object"))
        try:
            epoch = FleetFence.parse(request.headers.get(EPOCH_HEADER)) if spec.fenced else None
        except ValueError as e:
            return _http_error("Invalid fleet epoch", str(e), 400)
        try:
            return _encoded(await self.answer(route, body, epoch, request))
        except StaleEpoch as e:
            log.warning("refused %s: %s", name, e)
            return e.response()
        except UnsupportedRequest as e:  # what the real server runs and this worker does not
            return _http_error("Unsupported request", str(e), e.status)
        except AdminRequestError as e:  # a bad body: the contract's expected failure
            if spec.native:  # SGLang's own methods raise on a bad argument: a 400 here
                return _http_error("Bad request", f"bad arguments: {e}", 400)
            return _encoded(spec.failure(str(e)))
        except _CallerLeft:
            log.warning("%s: the caller left while it waited behind %s; not run", name,
                        self.running[0] if self.running else "another call")
            return _http_error("Client closed request", "the caller left before the call ran",
                               499)
        except Exception as e:  # the contract's 500: the handler raised
            log.exception("route %s failed", name)
            return _http_error("Handler error", f"{type(e).__name__}: {e}", 500)

    async def answer(self, route: Route, body: dict[str, Any], epoch: int | None,
                     request: Request) -> Any:
        """The route's reply: the fence and armed faults first, then the handler (under the
        control lock for a serialized route)."""
        spec = route.spec
        self.fence.check(epoch, advance=spec.mutating)
        if self.faults is not None and spec.name != admin.FAULT_INJECTION.name:
            injected = await self.faults.check(spec.name)
            if injected is not None:
                return injected
        req = admin.read_request(spec, body)
        if not spec.serialized:
            return await self.run(route, req, epoch)
        if not await _acquire_unless_gone(self.lock, request):
            raise _CallerLeft
        try:
            self.running[:] = [spec.name]
            return await self.run(route, req, epoch)
        finally:
            self.running.clear()
            self.lock.release()

    async def run(self, route: Route, req: Any, epoch: int | None) -> Any:
        spec = route.spec
        self.fence.check(epoch, advance=spec.mutating)  # again: a newer one may have come
        token = _TABLE_CALL.set(functools.partial(self.inner, epoch=epoch))
        epoch_token = _CALL_EPOCH.set(epoch)
        try:
            reply = await route.handler(req)
        finally:
            _CALL_EPOCH.reset(epoch_token)
            _TABLE_CALL.reset(token)
            if spec.mutating and self.changed is not None:  # publishes what changed
                await self.changed()
        if self.mounted is not None:
            self.mounted.observe(spec, req, reply, epoch)
        return reply

    async def inner(self, name: str, body: dict[str, Any], *, epoch: int | None
                    ) -> tuple[int, Any]:
        """Run route `name` in-process for a handler that holds the control lock (`TableCall`):
        what a call of it would have answered, status and body."""
        route = self.table.get(name)
        if route is None:
            return 404, {"error": "Route not found", "message": f"Route {name} not served"}
        spec = route.spec
        epoch = epoch if spec.fenced else None
        try:
            self.fence.check(epoch, advance=spec.mutating)
            injected = await self.faults.check(spec.name) if (
                self.faults is not None and spec.name != admin.FAULT_INJECTION.name) else None
            if injected is not None:
                return 200, msgspec.to_builtins(injected)
            req = admin.read_request(spec, body)
            return 200, msgspec.to_builtins(await self.run(route, req, epoch))
        except StaleEpoch as e:
            return 409, msgspec.to_builtins(StaleEpochError(
                error=STALE_EPOCH, message=str(e), fleet_epoch=e.epoch,
                newest_fleet_epoch=e.newest))
        except UnsupportedRequest as e:
            return e.status, {"error": "Unsupported request", "message": str(e)}
        except AdminRequestError as e:
            return 200, msgspec.to_builtins(spec.failure(str(e)))
        except Exception as e:  # the contract's 500, as a call of it would answer
            log.exception("route %s failed", name)
            return 500, {"error": "Handler error", "message": f"{type(e).__name__}: {e}"}

    async def guard(self, request: Request, name: str, call: Callable[[], Awaitable[Response]],
                    *, mutating: bool, serialized: bool) -> Response:
        """One call of a mounted route (`name` in logs) under the table's rules."""
        if mutating and not self.authorized(request):
            return _http_error("Unauthorized", f"this route needs '{admin.AUTH_HEADER}: "
                               "Bearer <admin token>'", 401)
        try:
            epoch = FleetFence.parse(request.headers.get(EPOCH_HEADER))
            self.fence.check(epoch, advance=mutating)
        except ValueError as e:
            return _http_error("Invalid fleet epoch", str(e), 400)
        except StaleEpoch as e:
            log.warning("refused %s: %s", name, e)
            return e.response()
        if not serialized:
            return await call()
        if not await _acquire_unless_gone(self.lock, request):
            return _http_error("Client closed request", "the caller left before the call ran",
                               499)
        try:
            self.running[:] = [name]
            return await call()
        finally:
            if mutating and self.changed is not None:
                await self.changed()
            self.running.clear()
            self.lock.release()


class _CallerLeft(Exception):
    """The caller went away while its call waited for the control lock."""


async def _acquire_unless_gone(lock: asyncio.Lock, request: Request) -> bool:
    """Take the lock, unless the caller goes away first (its deadline passed while the call
    waited behind a long one): a control call nobody waits for must not run later."""
    if not lock.locked():
        await lock.acquire()
        return True

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    take, leave = asyncio.ensure_future(lock.acquire()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait((take, leave), return_when=asyncio.FIRST_COMPLETED)
    finally:
        leave.cancel()
        if not take.done():
            take.cancel()
    if take.done() and not take.cancelled():
        if leave.done() and not leave.cancelled():  # both at once: the caller is gone anyway
            lock.release()
            return False
        return True
    return False


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _read_json(raw: bytes) -> Any:
    """The body as JSON: no NaN or infinities, no lone UTF-16 surrogates (neither can be
    answered back as JSON)."""
    body = json.loads(raw, parse_constant=_not_json)
    json.dumps(body, ensure_ascii=False).encode()  # UnicodeEncodeError on a lone surrogate
    return body
