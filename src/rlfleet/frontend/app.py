"""The frontend's HTTP app: the API routers (OpenAI, SGLang), the fleet's own routes
(models, health, metrics, cancel by request ID), errors rendered in one place, and the
per-request accounting."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlfleet.frontend import sglang, skyrl, vllm_native
from rlfleet.frontend.fleet_control import ControlForward, control_routes
from rlfleet.frontend.generation import Frontend, frontend_of, parse_body
from rlfleet.frontend.openai import routes as openai_routes
from rlfleet.frontend.router import WorkerPool, rank
from rlfleet.frontend.runs import CANCEL_TOKEN_HEADER, GenerationRuns, token_hash
from rlfleet.protocol import dynamo_health
from rlfleet.protocol.engine import CANCEL_FORBIDDEN, CANCEL_OK, CANCEL_UNKNOWN
from rlfleet.protocol.openai import ModelCard, ModelList, ModelPermission
from rlfleet.protocol.sglang import AbortRequest
from rlfleet.runtime import metrics, tracing
from rlfleet.runtime.http import DIRECT_SEND, ERROR_HANDLERS, HttpError, json_response
from rlfleet.runtime.request_plane import StreamClient

log = logging.getLogger("rlfleet.frontend.requests")

ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/models", "/health",
          "/metrics", "/v1/responses/input_tokens",
          "/inference/v1/generate", "/tokenize", "/detokenize")


async def models(request: Request) -> Response:
    """The served models, as vLLM lists them: `root` (where the weights came from),
    `max_model_len` and a permission entry, from the workers' discovery entries; then the
    LoRA adapters they serve, each with `parent` its base model."""
    pool = frontend_of(request).pool
    now = int(time.time())
    cards = []
    for m in pool.models():
        entry = next((w.entry for w in pool.for_model(m)), {})
        root = entry.get("model_path")
        mml = entry.get("max_model_len")
        cards.append(ModelCard(
            id=m, created=now, root=root if isinstance(root, str) else m,
            max_model_len=mml if isinstance(mml, int) else None,
            permission=[ModelPermission(id=f"modelperm-{uuid.uuid4().hex[:16]}", created=now)]))
    for name, parent in sorted(pool.adapters().items()):  # as vLLM lists LoRA adapters
        w = next(w for w in pool.for_model(name))
        cards.append(ModelCard(
            id=name, created=now, root=w.adapters[name].get("path") or name, parent=parent,
            max_model_len=w.entry.get("max_model_len"),
            permission=[ModelPermission(id=f"modelperm-{uuid.uuid4().hex[:16]}", created=now)]))
    return json_response(ModelList(data=cards))


async def health(request: Request) -> Response:
    pool = frontend_of(request).pool
    workers = [{"instance_id": w.instance_id, "model": w.model, "url": w.url,
                "usable": w.usable, "inflight": w.inflight, "step": w.step,
                **({"kv": pool.kv.describe(w.instance_id)} if pool.kv is not None else {}),
                **({"off_policy": w.off_policy} if w.off_policy else {})}
               for w in pool.workers.values()]
    # `process`: which process of the frontend answered (python -m rlfleet.frontend --processes);
    # no worker: 503 (vLLM's and SGLang's clients read the status code: not ready to serve)
    status = "healthy" if workers else "no_workers"
    instances = await _instances(pool)
    return json_response({"status": status, "message": dynamo_health.HEALTH_MESSAGES[status],
                          "process": os.getpid(), "workers": workers,
                          "endpoints": dynamo_health.endpoints_of(instances),
                          "instances": instances},
                         200 if workers else 503)


#: seconds /health waits for the discovery store's listing (then it lists no instance)
HEALTH_LISTING_DEADLINE = 2.0


async def _instances(pool: WorkerPool) -> list[dynamo_health.Instance]:
    """Every endpoint the workers of this frontend's namespace registered (`generate`, `rl`,
    ...), read from discovery now, as Dynamo's /health lists them; none while the store
    cannot be read (as Dynamo: the rest of the answer stands)."""
    try:
        async with asyncio.timeout(HEALTH_LISTING_DEADLINE):
            entries = await pool.discovery.list(pool.namespace)
    except Exception as e:  # the store is down or slow: the workers the pool knows stand
        log.warning("/health: discovery could not be listed: %r", e)
        return []
    return dynamo_health.instances_of(entries)


async def live(request: Request) -> Response:
    """Dynamo's /live: the frontend answers (whatever its workers' state)."""
    return json_response(dynamo_health.Live())


async def metrics_route(request: Request) -> Response:
    return metrics.metrics_response(metrics.FRONTEND)


async def cancel(request: Request) -> Response:
    """Abort a request started with this X-Request-Id: the worker ends it now, and its
    result (kept for retries) is the partial output with finish reason `abort`."""
    fe = frontend_of(request)
    rid = request.path_params["rid"]
    auth = request.headers.get("authorization", "")
    admin = auth[7:] if auth[:7].lower() == "bearer " else None
    token = request.headers.get(CANCEL_TOKEN_HEADER)
    parts = [(part, fe.runs.running(part)) for part in _parts(fe, rid)]  # or each of a batch
    if all(run is None for _, run in parts):  # another frontend (process) may hold it
        return json_response({"request_id": rid,
                              "cancelled": await _cancel_elsewhere(fe, rid, token, admin)})
    for _, run in parts:
        if run is not None and not fe.runs.may_cancel(run, token, admin):
            raise _not_owner(rid)
    cancelled = False
    for part, run in parts:  # the request, or each prompt of a batch (<id>-<i>)
        worker = run.worker if run is not None else None
        if worker is not None and await fe.client.cancel(worker.address, part):
            cancelled = True
    return json_response({"request_id": rid, "cancelled": cancelled})


async def abort_request(request: Request) -> Response:
    """SGLang's POST /abort_request ({"rid"} or {"abort_all": true}): this process's
    requests (rlfleet.frontend.sglang.abort_runs), else, for a rid, the kept run another
    frontend process holds (as the cancel route relays it)."""
    fe = frontend_of(request)
    req: AbortRequest = await parse_body(request, AbortRequest)
    auth = request.headers.get("authorization", "")
    admin = auth[7:] if auth[:7].lower() == "bearer " else None
    token = request.headers.get(CANCEL_TOKEN_HEADER)
    rid = None if req.abort_all else req.rid
    if rid == "":
        return json_response({"rid": "", "aborted": 0})  # SGLang: nothing named, nothing done
    found, aborted = await sglang.abort_runs(request, rid, token, admin)
    if rid is not None and not found:
        aborted = int(await _cancel_elsewhere(fe, rid, token, admin))
    return json_response({"rid": rid, "abort_all": req.abort_all, "aborted": aborted})


def _not_owner(rid: str) -> HttpError:
    return HttpError(403, f"only the owner of request {rid!r} can cancel it: send the "
                          "X-Cancel-Token header it was started with (or the frontend's "
                          "admin token as Authorization: Bearer)")


# how many workers, in the request ID's rank order, a relayed cancel asks per model (the
# one that took the run is the first usable one when it started)
RELAY_TRIES = 3


async def _cancel_elsewhere(fe: Frontend, rid: str, token: str | None, admin: str | None
                            ) -> bool:
    """Cancel a run this process does not hold: the worker that keeps it (where every
    frontend routes its ID, rlfleet.frontend.router.rank) ends it if the caller owns it
    (the token's hash is checked there; this frontend's admin is vouched for)."""
    owner = None if fe.runs.is_admin(admin) else (token_hash(token) or b"").hex()

    async def relay(part: str) -> str:
        for model in fe.pool.models():
            for w in rank(part, fe.pool.for_model(model))[:RELAY_TRIES]:
                status = await fe.client.cancel_as(w.address, part, owner)
                if status != CANCEL_UNKNOWN:
                    return status
        return CANCEL_UNKNOWN

    statuses = [await relay(rid)]
    if statuses[0] == CANCEL_UNKNOWN:  # or the parts of a batch: <id>-0, <id>-1, ...
        statuses = []
        while len(statuses) < 1024:
            status = await relay(f"{rid}-{len(statuses)}")
            if status == CANCEL_UNKNOWN:
                break
            statuses.append(status)
    if CANCEL_FORBIDDEN in statuses:
        raise _not_owner(rid)
    return CANCEL_OK in statuses


def _parts(fe, rid: str) -> list[str]:
    if rid in fe.runs.runs or f"{rid}-0" not in fe.runs.runs:
        return [rid]
    out = []
    while f"{rid}-{len(out)}" in fe.runs.runs:
        out.append(f"{rid}-{len(out)}")
    return out


class Accounting:
    """Per request: in-flight gauge, latency (to the last byte), count by route and
    status, the X-Request-Id echoed on the response, and a DEBUG line with the request ID
    and trace context."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._inflight = {r: metrics.FRONTEND_INFLIGHT.labels(r) for r in (*ROUTES, "other")}
        # the series of each (model, route[, status]) seen: labels() takes a lock and
        # builds a key on every call, per request
        self._latency: dict[tuple[str, str], Any] = {}
        self._requests: dict[tuple[str, str, int], Any] = {}

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
        scope[DIRECT_SEND] = send  # what follows the response start passes nothing here

        in_flight = True
        t0 = time.monotonic()

        def done() -> None:
            nonlocal in_flight
            in_flight = False
            self._account(route, state.get("model", ""), status, time.monotonic() - t0)
            if log.isEnabledFor(logging.DEBUG):
                self._debug_line(scope, route, rid, traceparent, status, time.monotonic() - t0)

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if rid is not None:
                    message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid)]
            elif not message.get("more_body", False) and in_flight:
                # accounted before the last byte leaves: a client that has the whole response
                # finds it counted, and no longer in flight, in a scrape right after it (on
                # another process of this frontend too)
                done()
            await send(message)

        self._inflight[route].inc()
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            if in_flight:  # it ended before its last byte
                done()

    def _account(self, route: str, model: str, status: int, secs: float) -> None:
        self._inflight[route].dec()
        key = (model, route)
        if (latency := self._latency.get(key)) is None:
            latency = self._latency[key] = metrics.FRONTEND_LATENCY.labels(model, route)
        latency.observe(secs)
        if (counted := self._requests.get((model, route, status))) is None:
            counted = self._requests[(model, route, status)] = \
                metrics.FRONTEND_REQUESTS.labels(model, route, str(status))
        counted.inc()

    @staticmethod
    def _debug_line(scope: Scope, route: str, rid: bytes | None, traceparent: bytes | None,
                    status: int, secs: float) -> None:
        r = rid.decode(errors="replace") if rid is not None else None
        tp = traceparent.decode(errors="replace") if traceparent is not None else None
        model = scope["state"].get("model")
        log.debug("%s %s -> %d in %.3fs", scope["method"], scope["path"], status, secs,
                  extra={"request_id": r, "trace_id": tracing.trace_id_of(tp),
                         "model": model or None, "route": route, "status": status})


def build_app(pool: WorkerPool, client: StreamClient, runs: GenerationRuns | None = None,
              fleet_control: str | ControlForward | None = None) -> ASGIApp:
    """`fleet_control`: the fleet control service (its URL, or the link to it that says who
    may call); its control routes are forwarded there (rlfleet.frontend.fleet_control)."""
    app = Starlette(routes=[
        *openai_routes.router.routes,
        *sglang.router.routes,
        *vllm_native.router.routes,
        *skyrl.router.routes,
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/live", live, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/v1/requests/{rid}/cancel", cancel, methods=["POST"]),
        *(control_routes(fleet_control) if fleet_control else ()),
        Route("/abort_request", abort_request, methods=["POST"]),
    ], exception_handlers=ERROR_HANDLERS)
    app.state.frontend = Frontend(pool, client, runs or GenerationRuns())
    metrics.FLEET.watch(pool)
    # while tracing, a request's span is current for its accounting (the DEBUG line names
    # the trace) and its route (the worker's span starts under it)
    return tracing.ServerSpans(Accounting(app), match=_traced)


def _traced(path: str) -> bool:
    return path not in ("/metrics", "/health", "/live")
