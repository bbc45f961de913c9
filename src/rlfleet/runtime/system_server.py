"""A worker's system server: /health (and /live), /metrics and POST /engine/<route>, with the
contract's shared HTTP behaviour, bearer-token auth on mutating routes, per-worker
serialisation of control calls, and (tests only) fault injection. The route table is data:
each engine flavour hands in its `Route`s.

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

from rlfleet.protocol.admin import AdminRequestError
from rlfleet.runtime import metrics, tracing

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


# error: 200 with status "error"; http500: the contract's 500; hang: sleep hang_seconds first;
# exit: the process dies; respond: answer with the given `body` instead of running the route
FAULT_MODES = ("error", "http500", "hang", "exit", "respond")


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
               ready: Callable[[], bool] | None = None) -> FastAPI:
    """`health` adds fields to /health; `ready` says whether the worker serves (default:
    always, once this app answers)."""
    table = {r.name: r for r in routes}
    started = time.monotonic_ns()
    lock = asyncio.Lock()
    app = FastAPI(title="rlfleet worker system server", docs_url=None, redoc_url=None)
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
                body = json.loads(raw)
            except ValueError as e:
                return JSONResponse({"error": "Invalid JSON", "message": str(e)}, status_code=400)
        else:
            body = {}
        if not isinstance(body, dict):
            return failed("request body must be a JSON object")
        try:
            if faults is not None and route.name != "fault_injection":
                injected = await faults.check(route.name)
                if injected is not None:
                    return injected
            if route.serialized:
                async with lock:
                    return await route.handler(body)
            return await route.handler(body)
        except AdminRequestError as e:  # a bad body: the contract's expected failure
            return failed(str(e))
        except Exception as e:  # the contract's 500: the handler raised
            log.exception("route %s failed", name)
            return JSONResponse({"error": "Handler error", "message": f"{type(e).__name__}: {e}"},
                                status_code=500)

    return app


def _arm(faults: FaultInjector) -> Handler:
    async def handler(body: dict[str, Any]) -> dict[str, Any]:
        return faults.arm(body)
    return handler
