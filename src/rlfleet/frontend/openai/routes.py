"""The OpenAI API's routes: POST /v1/completions, /v1/chat/completions (unary and
streamed, with nvext) and /v1/responses/input_tokens (vLLM's /tokenize is in
rlfleet.frontend.vllm_native). Each reads its body (rlfleet.protocol.openai), starts the
generation (rlfleet.frontend.generation) and answers with the renderings of
rlfleet.frontend.openai.render.

A completion request may carry several prompts (a list of texts or of token lists): each
is its own generation (its own run, worker and request ID `<id>-<i>`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from rlfleet.frontend import generation as gen
from rlfleet.frontend.openai.render import (
    chat_body,
    chat_chunk_body,
    chat_opening_chunks,
    completion_body,
    completion_chunk_body,
    final_chunk_body,
    keeps_output,
)
from rlfleet.frontend.result import Result
from rlfleet.protocol.engine import GenerateRequest, TokenizeRequest
from rlfleet.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    InputTokens,
    InputTokensRequest,
)
from rlfleet.runtime.http import json_response


async def input_tokens(request: Request) -> Response:
    """An estimate for preflight: the chat rendering of `input` (and the tools as JSON)
    counted by a worker's tokenizer."""
    req: InputTokensRequest = await gen.parse_body(request, InputTokensRequest)
    fe = gen.frontend_of(request)
    w = await fe.pool.acquire(gen.served_model(request, req.model))
    n = (await fe.client.tokenize(w.address, TokenizeRequest(messages=req.messages()))).count
    if req.tools:
        n += (await fe.client.tokenize(w.address,
                                       TokenizeRequest(prompt=json.dumps(req.tools)))).count
    return json_response(InputTokens(input_tokens=n))


async def completions(request: Request) -> Response:
    req, model = await gen.decoded(request, CompletionRequest)
    rid = gen.request_id(request, "cmpl", req.request_id)
    prompts = req.prompts
    logprobs = req.engine_logprobs
    echo = bool(req.echo)

    def build() -> list[GenerateRequest]:
        out = []
        for i, p in enumerate(prompts):
            sampling = req.sampling(req.max_tokens, logprobs)
            sampling.prompt_logprobs = req.engine_prompt_logprobs
            out.append(GenerateRequest(
                request_id=gen.batch_request_id(rid, i, len(prompts)),
                prompt=p if isinstance(p, str) else None,
                prompt_token_ids=None if isinstance(p, str) else p, sampling=sampling,
                echo=echo, **req.request_options()))
        return out

    greqs = gen.engine_request(build)
    results = [Result(rid, req.n, keep_output=keeps_output(req)) for _ in greqs]
    call = await gen.follow(request, model, greqs, results, req.nvext.policy)
    if not req.stream:
        return await call.unary(lambda: completion_body(req, results, model))

    async def chunks() -> AsyncIterator[bytes]:
        n = req.n
        offsets = [0] * (n * len(results))
        started = [False] * (n * len(results))
        async for p, deltas, _ in call.batches():
            if deltas:
                res = results[p]
                out = []
                for d in deltas:
                    k = p * n + d.index
                    chunk, offsets[k] = completion_chunk_body(
                        req, res, model, d, offsets[k], index=k, first=not started[k])
                    started[k] = True
                    out.append(gen.sse(chunk))
                yield b"".join(out)
        last = final_chunk_body(req, results, model)
        if last is not None:
            yield gen.sse(last)
    return call.stream(chunks())


async def chat(request: Request) -> Response:
    req, model = await gen.decoded(request, ChatCompletionRequest)
    rid = gen.request_id(request, "chatcmpl", req.request_id)
    ids = req.nvext.token_data

    def build() -> GenerateRequest:
        sampling = req.sampling(req.token_budget, req.engine_logprobs)
        sampling.prompt_logprobs = req.engine_prompt_logprobs
        opts = req.request_options()
        if opts["add_special_tokens"] is None:
            opts["add_special_tokens"] = False  # the chat template adds them
        return GenerateRequest(
            request_id=rid, prompt_token_ids=ids,
            messages=None if ids else [m.plain() for m in req.messages],
            add_generation_prompt=req.add_generation_prompt,
            chat_template_kwargs=req.template_kwargs(), sampling=sampling,
            echo=bool(req.return_prompt_text), **opts)

    greq = gen.engine_request(build)
    res = Result(rid, req.n, keep_output=keeps_output(req))
    call = await gen.follow(request, model, greq, res, req.nvext.policy)
    if not req.stream:
        return await call.unary(lambda: chat_body(req, res, model))

    async def chunks() -> AsyncIterator[bytes]:
        yield b"".join(gen.sse(c) for c in chat_opening_chunks(req, res, model))
        async for _, deltas, _ in call.batches():
            if deltas:
                yield b"".join(gen.sse(chat_chunk_body(req, res, model, d)) for d in deltas)
        last = final_chunk_body(req, res, model)
        if last is not None:
            yield gen.sse(last)
    return call.stream(chunks())


router = Router(routes=[
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat, methods=["POST"]),
    Route("/v1/responses/input_tokens", input_tokens, methods=["POST"]),
])
