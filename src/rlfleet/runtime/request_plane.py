"""The request plane: the worker's `/generate` app and the frontend's client for it.

Wire format: see rlfleet.protocol.engine. HTTP/1.1, newline-delimited JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from rlfleet.protocol.engine import EngineError, GenerateRequest, TokenizeRequest
from rlfleet.runtime import metrics
from rlfleet.runtime.engine import BadRequest, Engine
from rlfleet.runtime.http import (
    ClientGone,
    error_body,
    error_response,
    first_or_gone,
    stop_on_disconnect,
    validation_message,
)
from rlfleet.runtime.system_server import FaultInjector, InjectedFault


def check_prompt(engine: Engine, req: GenerateRequest) -> list[int]:
    """Tokenise if needed and check the prompt and budget against the model; BadRequest says what to fix."""
    info = engine.info
    if req.prompt_token_ids is not None:
        ids = req.prompt_token_ids
    else:
        ids = engine.tokenize(req.prompt, req.messages, req.add_generation_prompt,
                              req.chat_template_kwargs)
        if not ids:
            raise BadRequest("the prompt tokenises to zero tokens: send a non-empty prompt")
    bad = [t for t in ids if not 0 <= t < info.vocab_size]
    if bad:
        raise BadRequest(f"prompt token ID {bad[0]} is outside the vocabulary "
                         f"[0, {info.vocab_size}) of model {info.served_model_name!r}")
    bad = [t for t in req.sampling.stop_token_ids if not 0 <= t < info.vocab_size]
    if bad:
        raise BadRequest(f"stop_token_ids entry {bad[0]} is outside the vocabulary "
                         f"[0, {info.vocab_size})")
    bad = [t for t in req.sampling.logit_bias or () if not 0 <= t < info.vocab_size]
    if bad:
        raise BadRequest(f"logit_bias token ID {bad[0]} is outside the vocabulary "
                         f"[0, {info.vocab_size})")
    room = info.max_model_len - len(ids)
    if room <= 0:
        raise BadRequest(f"the prompt has {len(ids)} tokens, but the context length of "
                         f"{info.served_model_name!r} is {info.max_model_len}: shorten the prompt")
    mt = req.sampling.max_tokens
    if mt is not None and mt > room:
        raise BadRequest(f"max_tokens is {mt}, but the prompt ({len(ids)} tokens) leaves room for "
                         f"at most {room} in the context of {info.max_model_len}: lower max_tokens")
    if req.sampling.min_tokens > room:
        raise BadRequest(f"min_tokens is {req.sampling.min_tokens}, but at most {room} tokens fit")
    return ids


def _line(obj: dict) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def request_plane_app(engine: Engine, faults: FaultInjector | None = None) -> FastAPI:
    """The worker's request-plane app: POST /generate, POST /tokenize, GET /health, /metrics.
    With fault injection on, the route name `generate` can be made to fail too."""
    app = FastAPI(title="rlfleet worker request plane", docs_url=None, redoc_url=None)
    metrics.mount_metrics(app)

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.body()
        if faults is not None:
            try:
                injected = await faults.check("generate")
            except InjectedFault as e:
                return error_response(500, str(e))
            if injected is not None:
                return error_response(500, injected.get("message", "injected failure"))
        try:
            req = GenerateRequest.model_validate_json(body)
            ids = check_prompt(engine, req)
        except (ValidationError, BadRequest) as e:
            metrics.WORKER_REQUESTS.labels("rejected").inc()
            return error_response(400, validation_message(e))
        events = engine.generate(req, ids)
        start = time.monotonic()
        # Pull the first event before answering, so that a request the engine refuses
        # gets a 400 instead of a stream that breaks; a caller that leaves meanwhile
        # (say, while generation is paused) aborts it.
        try:
            first = await first_or_gone(request, events)
        except ClientGone:
            await events.aclose()
            metrics.WORKER_REQUESTS.labels("abandoned").inc()
            return error_response(499, "the caller went away before the first token")
        except BadRequest as e:
            metrics.WORKER_REQUESTS.labels("rejected").inc()
            return error_response(400, str(e))
        except StopAsyncIteration:
            first = None
        except Exception as e:  # the engine failed on this request: say so, keep serving
            metrics.WORKER_REQUESTS.labels("error").inc()
            return error_response(500, f"engine failed: {type(e).__name__}: {e}")
        # the weights that produced the first token (a pause may have swapped them)
        head = {"prompt_token_ids": ids, **engine.weight_identity()}
        if req.echo:
            head["prompt_text"] = (req.prompt if req.prompt is not None
                                   else engine.detokenize(ids))
            head["prompt_token_strs"] = engine.token_strs(ids)

        async def lines() -> AsyncIterator[bytes]:
            outcome = "error"
            try:
                yield _line(head)
                if first is not None:
                    yield _line(first)
                    if first.get("done"):
                        outcome = "ok"
                        return
                async for ev in events:
                    yield _line(ev)
                    if ev.get("done"):
                        outcome = "ok"
            except Exception as e:  # the engine failed mid-request: tell the caller, keep serving
                yield _line({"error": EngineError(message=f"engine failed: {e}").model_dump()})
            finally:
                await events.aclose()
                metrics.WORKER_REQUESTS.labels(outcome).inc()
                metrics.WORKER_REQUEST_SECONDS.observe(time.monotonic() - start)

        return StreamingResponse(stop_on_disconnect(request, lines()),
                                 media_type="application/x-ndjson")

    @app.post("/abort")
    async def abort(request: Request):
        """End a running request now; its stream finishes with its partial output and
        finish reason `abort`."""
        try:
            rid = json.loads(await request.body()).get("request_id")
        except (ValueError, AttributeError):
            rid = None
        if not isinstance(rid, str) or not rid:
            return error_response(400, "request_id is required")
        await engine.abort(rid)
        return {"status": "ok", "request_id": rid}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            req = TokenizeRequest.model_validate_json(await request.body())
            if (req.prompt is None) == (req.messages is None):
                raise BadRequest("give exactly one of prompt, messages")
            ids = engine.tokenize(req.prompt, req.messages, req.add_generation_prompt,
                                  req.chat_template_kwargs)
        except (ValidationError, BadRequest) as e:
            return error_response(400, validation_message(e))
        return {"token_ids": ids, "count": len(ids)}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.info.served_model_name}

    return app


class WorkerError(Exception):
    """A worker could not serve a request. `status` is the HTTP status to report;
    `retryable` is true when the request never reached the engine."""

    def __init__(self, message: str, status: int = 502, retryable: bool = False,
                 body: dict[str, Any] | None = None, broken: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        self.broken = broken or retryable  # the worker itself looks unhealthy
        self.body = body or error_body(status, message)


class WorkerClient:
    """The frontend's side of the request plane (one pooled HTTP client for all workers)."""

    def __init__(self, connect_timeout: float = 5.0, read_timeout: float = 600.0) -> None:
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=connect_timeout, read=read_timeout, write=30.0,
                                  pool=connect_timeout),
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512),
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def generate(self, base_url: str, req: GenerateRequest,
                       headers: dict[str, str] | None = None) -> AsyncIterator[dict]:
        """Yield the worker's events. Raises WorkerError for a refused request (its 4xx body),
        an unreachable worker (retryable) or a stream that breaks before `done`."""
        try:
            async with self._http.stream("POST", f"{base_url}/generate",
                                         content=req.model_dump_json(exclude_defaults=True),
                                         headers={"content-type": "application/json",
                                                  **(headers or {})}) as resp:
                if resp.status_code != 200:
                    raw = await resp.aread()
                    try:
                        body = json.loads(raw)
                    except ValueError:
                        body = error_body(resp.status_code, raw.decode(errors="replace")[:500])
                    msg = body.get("error", {}).get("message", "worker error")
                    raise WorkerError(msg, resp.status_code, body=body)
                async for line in resp.aiter_lines():
                    if not line:
                        continue
                    ev = json.loads(line)
                    if "error" in ev:
                        err = ev["error"]
                        raise WorkerError(err.get("message", "worker error"), err.get("code", 502))
                    yield ev
                    if ev.get("done"):
                        return
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:
            raise WorkerError(f"worker at {base_url} is unreachable: {e!r}", 503,
                              retryable=True) from e
        except httpx.TimeoutException as e:
            raise WorkerError(f"worker at {base_url} timed out: {e!r}", 504, broken=True) from e
        except httpx.HTTPError as e:
            raise WorkerError(f"worker at {base_url} failed mid-request: {e!r}", 502,
                              broken=True) from e
        raise WorkerError(f"worker at {base_url} closed the stream before the request finished",
                          502, broken=True)

    async def abort(self, base_url: str, request_id: str) -> bool:
        try:
            r = await self._http.post(f"{base_url}/abort", json={"request_id": request_id},
                                      timeout=10.0)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def tokenize(self, base_url: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = await self._http.post(f"{base_url}/tokenize", json=body, timeout=30.0)
        except httpx.ConnectError as e:
            raise WorkerError(f"worker at {base_url} is unreachable: {e!r}", 503,
                              retryable=True) from e
        except httpx.HTTPError as e:
            raise WorkerError(f"worker at {base_url} failed: {e!r}", 502) from e
        data = resp.json()
        if resp.status_code != 200:
            raise WorkerError(data.get("error", {}).get("message", "tokenize failed"),
                              resp.status_code, body=data)
        return data

