"""The frontend's HTTP app: the API routers (OpenAI, SGLang), the fleet's own routes
(models, health, metrics, cancel by request ID), errors rendered in one place, and the
per-request accounting."""

from __future__ import annotations

import logging
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlfleet.frontend import openai, sglang
from rlfleet.frontend.generation import Frontend, frontend_of
from rlfleet.frontend.router import WorkerPool
from rlfleet.frontend.runs import RunRegistry
from rlfleet.protocol.openai import ModelCard, ModelList
from rlfleet.runtime import metrics, tracing
from rlfleet.runtime.http import ERROR_HANDLERS, json_response
from rlfleet.runtime.request_plane import WorkerClient

log = logging.getLogger("rlfleet.frontend.requests")

ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/models", "/health",
          "/metrics", "/v1/responses/input_tokens")


async def models(request: Request) -> Response:
    return json_response(ModelList(data=[ModelCard(id=m)
                                         for m in frontend_of(request).pool.models()]))


async def health(request: Request) -> Response:
    workers = [{"instance_id": w.instance_id, "model": w.model, "url": w.url,
                "usable": w.usable, "inflight": w.inflight}
               for w in frontend_of(request).pool.workers.values()]
    return json_response({"status": "healthy" if workers else "no_workers", "workers": workers})


async def metrics_route(request: Request) -> Response:
    return metrics.metrics_response(metrics.FRONTEND)


async def cancel(request: Request) -> Response:
    """Abort a request started with this X-Request-Id: the worker ends it now, and its
    result (kept for retries) is the partial output with finish reason `abort`."""
    fe = frontend_of(request)
    rid = request.path_params["rid"]
    run = fe.runs.running(rid)
    worker = run.worker if run is not None else None
    cancelled = worker is not None and await fe.client.cancel(worker.address, rid)
    return json_response({"request_id": rid, "cancelled": cancelled})


class Accounting:
    """Per request: in-flight gauge, latency (to the last byte), count by route and
    status, the X-Request-Id echoed on the response, and a DEBUG line with the request ID
    and trace context."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._inflight = {r: metrics.FRONTEND_INFLIGHT.labels(r) for r in (*ROUTES, "other")}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in self._inflight else "other"
        rid = traceparent = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                rid = value
            elif name == b"traceparent":
                traceparent = value
        status = 500
        state = scope.setdefault("state", {})  # a generation route puts its `model` here

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if rid is not None:
                    message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid)]
            await send(message)

        gauge = self._inflight[route]
        gauge.inc()
        t0 = time.monotonic()
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            gauge.dec()
            secs = time.monotonic() - t0
            model = state.get("model", "")
            metrics.FRONTEND_LATENCY.labels(model, route).observe(secs)
            metrics.FRONTEND_REQUESTS.labels(model, route, str(status)).inc()
            if log.isEnabledFor(logging.DEBUG):
                r = rid.decode(errors="replace") if rid is not None else None
                tp = traceparent.decode(errors="replace") if traceparent is not None else None
                log.debug("%s %s -> %d in %.3fs", scope["method"], path, status, secs,
                          extra={"request_id": r, "trace_id": tracing.trace_id_of(tp),
                                 "model": model or None, "route": route, "status": status})


def build_app(pool: WorkerPool, client: WorkerClient, runs: RunRegistry | None = None
              ) -> ASGIApp:
    app = Starlette(routes=[
        *openai.router.routes,
        *sglang.router.routes,
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/v1/requests/{rid}/cancel", cancel, methods=["POST"]),
    ], exception_handlers=ERROR_HANDLERS)
    app.state.frontend = Frontend(pool, client, runs or RunRegistry())
    metrics.FLEET.watch(pool)
    # while tracing, a request's span is current for its accounting (the DEBUG line names
    # the trace) and its route (the worker's span starts under it)
    return tracing.ServerSpans(Accounting(app), match=_traced)


def _traced(path: str) -> bool:
    return path not in ("/metrics", "/health")
