"""A worker's system server: /health (and /live), /metrics and POST /engine/<route>, with the
contract's shared HTTP behaviour, bearer-token auth on mutating routes, per-worker
serialisation of control calls, fleet-epoch fencing, and (tests only) fault injection. The
route table is data: each engine flavour hands in its `Route`s.

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
import hmac
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlfleet.protocol.admin import EPOCH_HEADER, STALE_EPOCH, AdminRequestError
from rlfleet.runtime import metrics, tracing
from rlfleet.runtime.http import bad_json_message

log = logging.getLogger("rlfleet.system")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class Route:
    name: str
    handler: Handler
    mutating: bool = True  # needs the admin token when one is set
    serialized: bool = True  # runs under the worker's control lock


def ok(**fields: Any) -> dict[str, Any]:
    return {"status": "ok", **fields}


def failed(message: str, **fields: Any) -> dict[str, Any]:
    """A failure the handler expected: HTTP 200 with status "error"."""
    return {"status": "error", "message": message, **fields}


class InjectedFault(Exception):
    pass


class StaleEpoch(Exception):
    """A call from an older fleet epoch than the newest the worker has seen."""

    def __init__(self, epoch: int, newest: int) -> None:
        super().__init__(f"fleet epoch {epoch} is older than epoch {newest}, the newest this "
                         "worker has seen: another refresh coordinator has taken over the "
                         "fleet; this one must stop (its calls are refused)")
        self.epoch, self.newest = epoch, newest

    def response(self) -> JSONResponse:
        return JSONResponse({"error": STALE_EPOCH, "message": str(self),
                             "fleet_epoch": self.epoch, "newest_fleet_epoch": self.newest},
                            status_code=409)


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


# error: 200 with status "error"; http500: the contract's 500; hang: sleep hang_seconds first;
# exit: the process dies; respond: answer with the given `body` instead of running the route;
# delay: sleep hang_seconds, then run the route as usual
FAULT_MODES = ("error", "http500", "hang", "exit", "respond", "delay")


@dataclass
class FaultInjector:
    """Makes named routes fail a given number of times (tests only)."""

    faults: dict[str, dict[str, Any]] = field(default_factory=dict)

    def arm(self, body: dict[str, Any]) -> dict[str, Any]:
        route, mode = body.get("route"), body.get("mode", "error")
        if not isinstance(route, str) or not route:
            return failed("route is required (the name of the route to fail)")
        if mode not in FAULT_MODES:
            return failed(f"Invalid mode {mode!r}; expected {'|'.join(FAULT_MODES)}")
        times = body.get("times", 1)
        if not isinstance(times, int) or times < 0:
            return failed("times must be a non-negative integer (0 disarms)")
        hang = body.get("hang_seconds", 3600)
        if not isinstance(hang, (int, float)) or hang < 0:
            return failed("hang_seconds must be a non-negative number")
        if mode == "respond" and not isinstance(body.get("body"), dict):
            return failed("mode respond needs body (the JSON object to answer with)")
        if times == 0:
            self.faults.pop(route, None)
        else:
            self.faults[route] = {"mode": mode, "times": times, "hang_seconds": float(hang),
                                  "body": body.get("body")}
        return ok(route=route, mode=mode, times=times)

    async def check(self, route: str) -> dict[str, Any] | None:
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
        return failed(f"injected failure of {route}")


def system_app(routes: list[Route], *, admin_token: str | None = None,
               faults: FaultInjector | None = None,
               health: Callable[[], dict[str, Any]] | None = None,
               ready: Callable[[], bool] | None = None,
               fence: FleetFence | None = None,
               changed: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """`health` adds fields to /health; `ready` says whether the worker serves (default:
    always, once this app answers); `fence`: the worker's fleet epoch (default: one of this
    app's own); `changed` is awaited after every mutating call (under the control lock for
    serialized routes), for a worker that publishes its state (discovery)."""
    table = {r.name: r for r in routes}
    fence = fence if fence is not None else FleetFence()
    started = time.monotonic_ns()
    lock = asyncio.Lock()  # serialised control calls, one at a time
    running: list[str] = []  # the one that holds the lock
    app = FastAPI(title="rlfleet worker system server", docs_url=None, redoc_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # the contract's error shape for paths and methods no route serves too
        if exc.status_code == 404:
            body = {"error": "Route not found", "message": f"Route {request.url.path} not found"}
        elif exc.status_code == 405:
            body = {"error": "Method not allowed",
                    "message": f"{request.method} is not allowed on {request.url.path}"}
        else:
            body = {"error": str(exc.detail), "message": str(exc.detail)}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    # a coordinator's control calls join its trace (a policy refresh: a span per call)
    app.add_middleware(tracing.ServerSpans, match=lambda path: path.startswith("/engine/"))

    @app.get("/metrics")
    async def _metrics():
        return metrics.metrics_response(metrics.WORKER)

    def authorized(request: Request) -> bool:
        if not admin_token:
            return True
        got = request.headers.get("authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {admin_token}".encode())

    @app.get("/health")
    @app.get("/live")
    async def _health():
        up = time.monotonic_ns() - started
        serving = ready() if ready else True
        body = {"status": "ready" if serving else "notready",
                "uptime": {"secs": up // 1_000_000_000, "nanos": up % 1_000_000_000},
                **(health() if health else {})}
        return JSONResponse(body, status_code=200 if serving else 503)

    @app.get("/engine")
    async def _routes():
        """The advertised route table (what the RL listener probes; fault name `engine`)."""
        if faults is not None:
            try:
                injected = await faults.check("engine")
            except InjectedFault as e:
                return JSONResponse({"error": "Handler error", "message": str(e)},
                                    status_code=500)
            if injected is not None:
                return injected
        return {"routes": sorted(table)}

    @app.api_route("/engine/{name:path}", methods=["GET", "POST"])
    async def engine_route(name: str, request: Request):
        if name == "fault_injection" and faults is not None:
            route: Route | None = Route("fault_injection", _arm(faults))
        else:
            route = table.get(name)
        if route is None:
            return JSONResponse({"error": "Route not found",
                                 "message": f"Route /engine/{name} not found"}, status_code=404)
        if route.mutating and not authorized(request):
            return JSONResponse({"error": "Unauthorized",
                                 "message": "this route needs 'Authorization: Bearer <admin token>'"},
                                status_code=401)
        raw = await request.body()
        if raw.strip():
            try:
                body = _read_json(raw)
            except (ValueError, RecursionError) as e:
                return JSONResponse({"error": "Invalid JSON", "message": bad_json_message(e)},
                                    status_code=400)
        else:
            body = {}
        if not isinstance(body, dict):
            return failed("request body must be a JSON object")
        fenced = route.name != "fault_injection"
        try:
            epoch = FleetFence.parse(request.headers.get(EPOCH_HEADER)) if fenced else None
        except ValueError as e:
            return JSONResponse({"error": "Invalid fleet epoch", "message": str(e)},
                                status_code=400)

        async def run() -> dict[str, Any]:
            fence.check(epoch, advance=route.mutating)  # again: a newer one may have come
            try:
                return await route.handler(body)
            finally:
                if route.mutating and changed is not None and fenced:
                    await changed()
        try:
            fence.check(epoch, advance=route.mutating)
            if faults is not None and fenced:
                injected = await faults.check(route.name)
                if injected is not None:
                    return injected
            if route.serialized:
                if not await _acquire_unless_gone(lock, request):
                    log.warning("%s: the caller left while it waited behind %s; not run", name,
                                running[0] if running else "another call")
                    return JSONResponse({"error": "Client closed request",
                                         "message": "the caller left before the call ran"},
                                        status_code=499)
                try:
                    running[:] = [name]
                    return await run()
                finally:
                    running.clear()
                    lock.release()
            return await run()
        except StaleEpoch as e:
            log.warning("refused %s: %s", name, e)
            return e.response()
        except AdminRequestError as e:  # a bad body: the contract's expected failure
            return failed(str(e))
        except Exception as e:  # the contract's 500: the handler raised
            log.exception("route %s failed", name)
            return JSONResponse({"error": "Handler error", "message": f"{type(e).__name__}: {e}"},
                                status_code=500)

    return app


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


def _arm(faults: FaultInjector) -> Handler:
    async def handler(body: dict[str, Any]) -> dict[str, Any]:
        return faults.arm(body)
    return handler
