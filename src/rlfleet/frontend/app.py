"""The frontend's HTTP app: OpenAI routes, native SGLang /generate, health and metrics."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from rlfleet.frontend import openai as render
from rlfleet.frontend.dispatch import Result, dispatch
from rlfleet.frontend.router import NoWorker, WorkerPool
from rlfleet.frontend.runs import RequestIdConflict, RunRegistry
from rlfleet.frontend.sglang import generate_body
from rlfleet.protocol.engine import GenerateRequest
from rlfleet.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    InputTokensRequest,
    TokenizeRequest,
)
from rlfleet.protocol.sglang import SglangGenerateRequest
from rlfleet.runtime import metrics
from rlfleet.runtime.http import (
    ClientGone,
    error_body,
    error_response,
    first_or_gone,
    stop_on_disconnect,
    validation_message,
)
from rlfleet.runtime.request_plane import WorkerClient, WorkerError

REQUEST_ID_HEADER = "x-request-id"
log = logging.getLogger("rlfleet.frontend.requests")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def parse_body(request: Request, cls: type[BaseModel]) -> Any:
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ApiError(499, "client closed the request") from None
    try:
        obj = json.loads(raw) if raw.strip() else None
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        raise ApiError(400, validation_message(e)) from e


def request_id(request: Request, prefix: str) -> str:
    rid = request.headers.get(REQUEST_ID_HEADER)
    if rid is not None:
        if not 0 < len(rid) <= 256:
            raise ApiError(400, "X-Request-Id must be 1 to 256 characters")
        return rid
    return f"{prefix}-{uuid.uuid4().hex}"


def build_app(pool: WorkerPool, client: WorkerClient, runs: RunRegistry | None = None) -> FastAPI:
    runs = runs or RunRegistry()
    app = FastAPI(title="rlfleet frontend", docs_url=None, redoc_url=None)
    metrics.mount_metrics(app)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError):
        return error_response(e.status, e.message, param=e.param)

    @app.exception_handler(NoWorker)
    async def _no_worker(_: Request, e: NoWorker):
        return error_response(e.status, str(e), "model_not_found" if e.status == 404 else None)

    @app.exception_handler(WorkerError)
    async def _worker_error(_: Request, e: WorkerError):
        return JSONResponse(e.body, status_code=e.status)

    @app.middleware("http")
    async def _count(request: Request, call_next):
        route = request.url.path if request.url.path in _ROUTES else "other"
        metrics.FRONTEND_INFLIGHT.labels(route).inc()
        t0 = time.monotonic()
        try:
            resp = await call_next(request)
        finally:
            metrics.FRONTEND_INFLIGHT.labels(route).dec()
        secs = time.monotonic() - t0
        metrics.FRONTEND_LATENCY.labels(route).observe(secs)
        metrics.FRONTEND_REQUESTS.labels(route, str(resp.status_code)).inc()
        rid = request.headers.get(REQUEST_ID_HEADER)
        if rid is not None:
            resp.headers["X-Request-Id"] = rid
        # one structured line per request: the trainer's request ID and trace context line
        # up with what the frontend saw (streams: time to the response head)
        log.info("%s %s -> %d in %.3fs request_id=%s traceparent=%s", request.method,
                 request.url.path, resp.status_code, secs, rid,
                 request.headers.get("traceparent"),
                 extra={"request_id": rid, "traceparent": request.headers.get("traceparent"),
                        "route": route, "status": resp.status_code})
        return resp

    async def run(request: Request, model: str, greq: GenerateRequest, res: Result,
                  ) -> AsyncIterator[dict]:
        """Start (or, for a reused X-Request-Id, rejoin) the request; fail before any byte
        is sent if no worker takes it."""
        keep = REQUEST_ID_HEADER in request.headers
        try:
            r, _ = runs.start(greq.request_id, await request.body(), keep,
                              lambda run: dispatch(pool, client, model, greq,
                                                   lambda w: setattr(run, "worker_url", w.url)))
        except RequestIdConflict as e:
            raise ApiError(409, str(e)) from e
        runs.attach(r)
        events = r.follow()
        try:
            first = await first_or_gone(request, events)
        except ClientGone:
            runs.detach(r)
            raise ApiError(499, "client closed the request") from None
        except BaseException:
            runs.detach(r)
            raise
        res.apply(first)  # the worker's first event: prompt ids, weights

        async def rest() -> AsyncIterator[dict]:
            try:
                async for ev in events:
                    yield ev
            finally:
                runs.detach(r)
        return rest()

    async def unary(request: Request, events: AsyncIterator[dict], res: Result) -> None:
        async for ev in stop_on_disconnect(request, events):
            res.apply(ev)
        if res.finished is None:  # the client went away; nobody reads this
            raise ApiError(499, "client closed the request")

    def streamed(request: Request, chunks: AsyncIterator[str]) -> StreamingResponse:
        async def guarded() -> AsyncIterator[str]:
            try:
                async for c in chunks:
                    yield c
            except (WorkerError, NoWorker) as e:
                body = e.body if isinstance(e, WorkerError) else error_body(e.status, str(e))
                yield _sse(body)  # an error event ends the stream; no [DONE]
                return
            yield "data: [DONE]\n\n"
        return StreamingResponse(stop_on_disconnect(request, guarded()),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await parse_body(request, CompletionRequest)
        rid = request_id(request, "cmpl")
        prompt_lps = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_lps = max(prompt_lps or 0, req.logprobs)
        sampling = req.sampling(req.max_tokens, req.logprobs)
        sampling.prompt_logprobs = prompt_lps
        ids = req.nvext.token_data or (req.prompt if isinstance(req.prompt, list) else None)
        greq = GenerateRequest(request_id=rid, prompt=None if ids else req.prompt,
                               prompt_token_ids=ids, sampling=sampling, stream=req.stream,
                               echo=req.echo)
        res = Result(rid, req.n)
        events = await run(request, req.model, greq, res)
        if not req.stream:
            await unary(request, events, res)
            return render.completion_response(req, res, req.model)

        async def chunks() -> AsyncIterator[str]:
            offsets = [0] * req.n
            if req.echo:
                for i in range(req.n):
                    yield _sse({"id": rid, "object": "text_completion",
                                "created": int(res.received), "model": req.model,
                                "choices": [{"index": i, "text": res.prompt_text,
                                             "logprobs": None, "finish_reason": None}]})
            async for ev in events:
                for d in res.apply(ev):
                    yield _sse(render.completion_chunk(req, res, req.model, d, offsets[d["index"]]))
                    offsets[d["index"]] += len(d.get("text", ""))
            last = render.final_chunk(req, res, req.model, "text_completion")
            if last:
                yield _sse(last)
        return streamed(request, chunks())

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        rid = request_id(request, "chatcmpl")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        ids = req.nvext.token_data
        greq = GenerateRequest(
            request_id=rid, prompt_token_ids=ids,
            messages=None if ids else [m.plain() for m in req.messages],
            add_generation_prompt=req.add_generation_prompt,
            chat_template_kwargs=req.chat_template_kwargs,
            sampling=req.sampling(req.token_budget, logprobs), stream=req.stream)
        res = Result(rid, req.n)
        events = await run(request, req.model, greq, res)
        if not req.stream:
            await unary(request, events, res)
            return render.chat_response(req, res, req.model)

        async def chunks() -> AsyncIterator[str]:
            first = [True] * req.n
            async for ev in events:
                for d in res.apply(ev):
                    yield _sse(render.chat_chunk(req, res, req.model, d, first[d["index"]]))
                    first[d["index"]] = False
            last = render.final_chunk(req, res, req.model, "chat.completion.chunk")
            if last:
                yield _sse(last)
        return streamed(request, chunks())

    @app.post("/generate")
    async def sglang_generate(request: Request):
        req: SglangGenerateRequest = await parse_body(request, SglangGenerateRequest)
        model = req.model
        if model is None:
            models = pool.models()
            if len(models) != 1:
                raise ApiError(400, f"model is required: this frontend serves {len(models)} "
                                    f"models ({', '.join(models) or 'none'})")
            model = models[0]
        rid = req.rid or request_id(request, "gen")
        greq = GenerateRequest(request_id=rid, prompt_token_ids=req.input_ids,
                               sampling=req.sampling(), stream=req.stream)
        res = Result(rid, 1)
        events = await run(request, model, greq, res)
        if not req.stream:
            await unary(request, events, res)
            return generate_body(req, res)

        async def chunks() -> AsyncIterator[str]:
            async for ev in events:
                if res.apply(ev) or (ev.get("done") and res.prompt_logprobs is not None):
                    yield _sse(generate_body(req, res))  # the last one adds the input logprobs
        return streamed(request, chunks())

    @app.post("/v1/responses/input_tokens")
    async def input_tokens(request: Request):
        req: InputTokensRequest = await parse_body(request, InputTokensRequest)
        models = pool.models()
        model = req.model or (models[0] if models else "")
        w = await pool.acquire(model)
        n = (await client.tokenize(w.url, {"messages": req.messages()}))["count"]
        if req.tools:
            n += (await client.tokenize(w.url, {"prompt": json.dumps(req.tools)}))["count"]
        return {"object": "response.input_tokens", "input_tokens": n}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """The token IDs a worker of the model makes of a prompt or of chat messages (its
        tokenizer and chat template: the IDs the engine would be prompted with)."""
        req: TokenizeRequest = await parse_body(request, TokenizeRequest)
        w = await pool.acquire(req.model)
        ids = (await client.tokenize(w.url, req.worker_body()))["token_ids"]
        return {"count": len(ids), "tokens": ids}

    @app.post("/v1/requests/{rid}/cancel")
    async def cancel(rid: str):
        """Abort a request started with this X-Request-Id: the worker ends it now, and its
        result (kept for retries) is the partial output with finish reason `abort`."""
        r = runs.running(rid)
        url = r.worker_url if r is not None else None
        cancelled = url is not None and await client.abort(url, rid)
        return {"request_id": rid, "cancelled": cancelled}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "rlfleet"}
            for m in pool.models()]}

    @app.get("/health")
    async def health():
        workers = [{"instance_id": w.instance_id, "model": w.model, "url": w.url,
                    "usable": w.usable, "inflight": w.inflight} for w in pool.workers.values()]
        return {"status": "healthy" if workers else "no_workers", "workers": workers}

    return app


_ROUTES = {"/v1/completions", "/v1/chat/completions", "/generate", "/v1/models", "/health",
           "/metrics", "/v1/responses/input_tokens", "/tokenize"}
