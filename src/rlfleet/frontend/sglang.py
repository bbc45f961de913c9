"""The native SGLang API: POST /generate (unary, or streamed cumulatively as SGLang does)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from rlfleet.frontend.dispatch import Result
from rlfleet.frontend.generation import (
    engine_request,
    follow,
    parse_body,
    request_id,
    served_model,
    sse,
)
from rlfleet.protocol.engine import STALE_POLICY, GenerateRequest
from rlfleet.protocol.sglang import GenerateResponse, MetaInfo, SglangGenerateRequest


def _finish(reason: str | None, stop_reason, length: int, stale: bool = False) -> dict | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": length}
    if reason == "abort":
        return {"type": "abort", "message": STALE_POLICY if stale else "request aborted"}
    return {"type": "stop", "matched": stop_reason}


def generate_response(req: SglangGenerateRequest, res: Result) -> GenerateResponse:
    c = res.choices[0]
    meta = MetaInfo(id=res.request_id,
                    finish_reason=_finish(c.finish_reason, c.stop_reason, len(c.token_ids),
                                          c.stale_policy),
                    prompt_tokens=len(res.prompt_token_ids), completion_tokens=len(c.token_ids),
                    **res.policy.stamped())
    if c.finish_reason is not None:
        meta.weight_versions = res.spans(c)
        if c.stale_policy:
            meta.stale_policy = True
    if req.return_logprob:
        lps = c.logprobs or []
        meta.output_token_logprobs = [[lp.logprob, lp.token_id, None] for lp in lps]
        if req.top_logprobs_num > 0:
            meta.output_top_logprobs = [[[v, t, None] for t, v, _ in lp.top] for lp in lps]
        if req.logprob_start_len >= 0 and res.prompt_logprobs is not None:
            start = req.logprob_start_len
            ids = res.prompt_token_ids
            meta.input_token_logprobs = [
                [None if e is None else e[str(ids[i])].logprob, ids[i], None]
                for i, e in enumerate(res.prompt_logprobs) if i >= start]
    return GenerateResponse(text=c.text, output_ids=list(c.token_ids), meta_info=meta)


async def generate(request: Request) -> Response:
    req: SglangGenerateRequest = await parse_body(request, SglangGenerateRequest)
    model = served_model(request, req.model)
    rid = req.rid or request_id(request, "gen")
    greq = engine_request(lambda: GenerateRequest(
        request_id=rid, prompt_token_ids=req.input_ids, sampling=req.sampling(),
        stream=req.stream))
    res = Result(rid, 1)
    f = await follow(request, model, greq, res, req.policy)
    if not req.stream:
        return await f.unary(lambda: generate_response(req, res))

    async def chunks() -> AsyncIterator[bytes]:
        async for _, deltas, done in f.batches():
            # the last event adds the input logprobs
            if deltas or (done and res.prompt_logprobs is not None):
                yield sse(generate_response(req, res))
    return f.stream(chunks())


router = Router(routes=[Route("/generate", generate, methods=["POST"])])


def generate_body(req: SglangGenerateRequest, res: Result) -> dict:
    """The same rendering as a JSON-ready dict (for code that builds responses without a
    frontend: test fakes, tools)."""
    return msgspec.to_builtins(generate_response(req, res))
