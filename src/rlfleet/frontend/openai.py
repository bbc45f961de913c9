"""The OpenAI API: POST /v1/completions, /v1/chat/completions (unary and streamed, with
nvext) and /v1/responses/input_tokens. Rendering does only what the request asked for."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from rlfleet.frontend.dispatch import Choice, Result
from rlfleet.frontend.generation import (
    engine_request,
    follow,
    frontend_of,
    parse_body,
    request_id,
    sse,
)
from rlfleet.protocol.engine import (
    Delta,
    GenerateRequest,
    TokenizeRequest,
    TokenLogprob,
    detailed_finish_reason,
)
from rlfleet.protocol.openai import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    InputTokens,
    InputTokensRequest,
    NvExtResponse,
    TokenizeRouteRequest,
)
from rlfleet.runtime.http import json_response

Req = CompletionRequest | ChatCompletionRequest


# ------------------------------------------------------------------------ routes


async def completions(request: Request) -> Response:
    req: CompletionRequest = await parse_body(request, CompletionRequest)
    rid = request_id(request, "cmpl")
    prompt_lps = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_lps = max(prompt_lps or 0, req.logprobs)
    ids = req.nvext.token_data or (req.prompt if isinstance(req.prompt, list) else None)

    def build() -> GenerateRequest:
        sampling = req.sampling(req.max_tokens, req.logprobs)
        sampling.prompt_logprobs = prompt_lps
        return GenerateRequest(request_id=rid, prompt=None if ids else req.prompt,
                               prompt_token_ids=ids, sampling=sampling, stream=req.stream,
                               echo=req.echo)

    greq = engine_request(build)
    res = Result(rid, req.n, keep_output=not req.stream)
    f = await follow(request, req.model, greq, res)
    if not req.stream:
        return await f.unary(lambda: completion_body(req, res, req.model))

    async def chunks() -> AsyncIterator[bytes]:
        offsets = [0] * req.n
        if req.echo:
            yield b"".join(sse(CompletionResponse(
                id=rid, created=int(res.received), model=req.model, choices=[
                    CompletionChoice(index=i, text=res.prompt_text)])) for i in range(req.n))
        async for deltas, _ in f.batches():
            if deltas:
                out = []
                for d in deltas:
                    out.append(sse(completion_chunk_body(req, res, req.model, d, offsets[d.index])))
                    offsets[d.index] += len(d.text)
                yield b"".join(out)
        last = final_chunk_body(req, res, req.model)
        if last is not None:
            yield sse(last)
    return f.stream(chunks())


async def chat(request: Request) -> Response:
    req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
    rid = request_id(request, "chatcmpl")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    ids = req.nvext.token_data
    greq = engine_request(lambda: GenerateRequest(
        request_id=rid, prompt_token_ids=ids,
        messages=None if ids else [m.plain() for m in req.messages],
        add_generation_prompt=req.add_generation_prompt,
        chat_template_kwargs=req.chat_template_kwargs,
        sampling=req.sampling(req.token_budget, logprobs), stream=req.stream))
    res = Result(rid, req.n, keep_output=not req.stream)
    f = await follow(request, req.model, greq, res)
    if not req.stream:
        return await f.unary(lambda: chat_body(req, res, req.model))

    async def chunks() -> AsyncIterator[bytes]:
        first = [True] * req.n
        async for deltas, _ in f.batches():
            if deltas:
                out = []
                for d in deltas:
                    out.append(sse(chat_chunk_body(req, res, req.model, d, first[d.index])))
                    first[d.index] = False
                yield b"".join(out)
        last = final_chunk_body(req, res, req.model)
        if last is not None:
            yield sse(last)
    return f.stream(chunks())


async def input_tokens(request: Request) -> Response:
    """An estimate for preflight: the chat rendering of `input` (and the tools as JSON)
    counted by a worker's tokenizer."""
    req: InputTokensRequest = await parse_body(request, InputTokensRequest)
    fe = frontend_of(request)
    models = fe.pool.models()
    model = req.model or (models[0] if models else "")
    w = await fe.pool.acquire(model)
    n = (await fe.client.tokenize(w.address, TokenizeRequest(messages=req.messages()))).count
    if req.tools:
        n += (await fe.client.tokenize(w.address,
                                       TokenizeRequest(prompt=json.dumps(req.tools)))).count
    return json_response(InputTokens(input_tokens=n))


async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: the token IDs a worker of the model makes of a prompt or of chat
    messages (its tokenizer and chat template: the IDs the engine would be prompted with)."""
    req: TokenizeRouteRequest = await parse_body(request, TokenizeRouteRequest)
    fe = frontend_of(request)
    w = await fe.pool.acquire(req.model)
    ids = (await fe.client.tokenize(w.address, req.engine_request())).token_ids
    return json_response({"count": len(ids), "tokens": ids})


router = Router(routes=[
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat, methods=["POST"]),
    Route("/v1/responses/input_tokens", input_tokens, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
])


# ------------------------------------------------------------------------ nvext


def nvext_body(req: Req, res: Result, choice: Choice | Delta | None, final: bool
               ) -> NvExtResponse | None:
    """The response's top-level "nvext" for what the request asked for, or None. Unary
    responses (final, a whole choice) carry everything; stream chunks carry deltas in
    `completion_token_ids` and the final-only fields in the last chunk."""
    wanted = req.nvext.extra_fields
    if not wanted:
        return None
    out = NvExtResponse()
    if choice is not None:
        if "completion_token_ids" in wanted:
            out.completion_token_ids = list(choice.token_ids)
        if choice.finish_reason:
            if "detailed_finish_reason" in wanted:
                out.detailed_finish_reason = detailed_finish_reason(choice.finish_reason,
                                                                    choice.stop_reason)
            if "stop_reason" in wanted:
                out.stop_reason = choice.stop_reason
            if "weight_versions" in wanted:  # whole, also when streamed
                out.weight_versions = res.spans(res.choices[choice.index])
    if "engine_data" in wanted:  # on every chunk: a broken stream still names its policy
        out.engine_data = {"weight_version": res.weight.get("weight_version"),
                           "weight_digest": res.weight.get("weight_digest")}
    if final:
        if "prompt_token_ids" in wanted:
            out.prompt_token_ids = res.prompt_token_ids
        if "prompt_logprobs" in wanted and req.prompt_logprobs is not None:
            out.prompt_logprobs = res.prompt_logprobs
        if "worker_id" in wanted:
            out.worker_id = {"prefill_worker_id": res.worker_id,
                             "decode_worker_id": res.worker_id}
        if "timing" in wanted:
            out.timing = res.timing()
    return out if out != _EMPTY else None


_EMPTY = NvExtResponse()


def _unary_nvext(req: Req, res: Result) -> NvExtResponse | None:
    """Unary: per-choice fields come from choice 0 (the contract's `choices[0]`), and for
    n > 1 also as a list over all choices under `choices`."""
    nv = nvext_body(req, res, res.choices[0], final=True)
    if nv is not None and len(res.choices) > 1:
        per = [nvext_body(req, res, c, final=False) or NvExtResponse() for c in res.choices]
        if any(p != _EMPTY for p in per):
            nv.choices = per
    return nv


def final_chunk_body(req: Req, res: Result, model: str, obj: str | None = None
                     ) -> CompletionResponse | ChatCompletionChunk | None:
    """The last chunk of a stream: `completion_token_ids: []` plus the final-only nvext
    fields, and usage when asked for."""
    nv = nvext_body(req, res, None, final=True)
    if req.nvext.wants("completion_token_ids"):
        nv = nv or NvExtResponse()
        nv.completion_token_ids = []
    if nv is None and not req.include_usage:
        return None
    completion = obj == "text_completion" if obj else isinstance(req, CompletionRequest)
    cls = CompletionResponse if completion else ChatCompletionChunk
    chunk = cls(id=res.request_id, created=int(res.received), model=model, choices=[])
    if nv is not None:
        chunk.nvext = nv
    if req.include_usage:
        chunk.usage = res.usage()
    return chunk


# ------------------------------------------------------------------------ completions


def token_str(tid: int, decoded: str, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids else decoded


def _completion_logprobs(lps: list[TokenLogprob], as_ids: bool, offset0: int,
                         prompt: list[tuple[int, str, tuple[float, dict] | None]] | None = None
                         ) -> CompletionLogprobs:
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    off = offset0
    for tid, decoded, entry in prompt or ():
        tokens.append(token_str(tid, decoded, as_ids))
        token_lps.append(None if entry is None else entry[0])
        tops.append(None if entry is None else entry[1])
        offsets.append(off)
        off += len(decoded)
    for lp in lps:
        s = token_str(lp.token_id, lp.decoded, as_ids)
        tokens.append(s)
        token_lps.append(lp.logprob)
        top = {s: lp.logprob}
        for tid, val, dec in lp.top:
            top.setdefault(token_str(tid, dec, as_ids), val)
        tops.append(top)
        offsets.append(off)
        off += len(lp.decoded)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops,
                              text_offset=offsets)


def _echo_prompt(res: Result, as_ids: bool) -> list[tuple[int, str, tuple[float, dict] | None]]:
    """(token_id, decoded, (logprob, top) | None) per prompt position, from prompt logprobs."""
    out: list[tuple[int, str, tuple[float, dict] | None]] = []
    strs = res.prompt_token_strs or [""] * len(res.prompt_token_ids)
    for i, tid in enumerate(res.prompt_token_ids):
        entry = res.prompt_logprobs[i] if res.prompt_logprobs else None
        if entry is None:
            out.append((tid, strs[i], None))
            continue
        top = {token_str(int(t), e.decoded_token, as_ids): e.logprob for t, e in entry.items()}
        out.append((tid, strs[i], (entry[str(tid)].logprob, top)))
    return out


def completion_body(req: CompletionRequest, res: Result, model: str) -> CompletionResponse:
    as_ids = req.return_tokens_as_token_ids
    choices = []
    for c in res.choices:
        ch = CompletionChoice(index=c.index, text=(res.prompt_text + c.text) if req.echo else c.text,
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        if req.logprobs is not None and c.logprobs is not None:
            prompt = _echo_prompt(res, as_ids) if req.echo else None
            ch.logprobs = _completion_logprobs(c.logprobs, as_ids, 0, prompt)
        if req.prompt_logprobs is not None:
            ch.prompt_logprobs = res.prompt_logprobs
        choices.append(ch)
    body = CompletionResponse(id=res.request_id, created=int(res.received), model=model,
                              choices=choices, usage=res.usage())
    nv = _unary_nvext(req, res)
    if nv is not None:
        body.nvext = nv
    return body


def completion_chunk_body(req: CompletionRequest, res: Result, model: str, d: Delta,
                          text_offset: int) -> CompletionResponse:
    c = CompletionChoice(index=d.index, text=d.text, finish_reason=d.finish_reason,
                         stop_reason=d.stop_reason)
    if req.logprobs is not None and d.logprobs is not None:
        c.logprobs = _completion_logprobs(d.logprobs, req.return_tokens_as_token_ids, text_offset)
    chunk = CompletionResponse(id=res.request_id, created=int(res.received), model=model,
                               choices=[c])
    nv = nvext_body(req, res, d, final=False)
    if nv is not None:
        chunk.nvext = nv
    return chunk


# ------------------------------------------------------------------------ chat


def _chat_logprobs(lps: list[TokenLogprob], as_ids: bool) -> ChatLogprobs:
    return ChatLogprobs(content=[ChatTokenLogprob(
        token=token_str(lp.token_id, lp.decoded, as_ids), logprob=lp.logprob,
        bytes=list(lp.decoded.encode()),
        top_logprobs=[ChatTopLogprob(token=token_str(t, dec, as_ids), logprob=v,
                                     bytes=list(dec.encode())) for t, v, dec in lp.top])
        for lp in lps])


def chat_body(req: ChatCompletionRequest, res: Result, model: str) -> ChatCompletionResponse:
    choices = []
    for c in res.choices:
        ch = ChatChoice(index=c.index, message=ChatMessageOut(content=c.text),
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        if req.logprobs and c.logprobs is not None:
            ch.logprobs = _chat_logprobs(c.logprobs, req.return_tokens_as_token_ids)
        choices.append(ch)
    body = ChatCompletionResponse(id=res.request_id, created=int(res.received), model=model,
                                  choices=choices, usage=res.usage())
    if req.prompt_logprobs is not None:
        body.prompt_logprobs = res.prompt_logprobs
    nv = _unary_nvext(req, res)
    if nv is not None:
        body.nvext = nv
    return body


def chat_chunk_body(req: ChatCompletionRequest, res: Result, model: str, d: Delta,
                    first: bool) -> ChatCompletionChunk:
    delta = ChatDelta(role="assistant", content=d.text) if first else ChatDelta(content=d.text)
    c = ChatChunkChoice(index=d.index, delta=delta, finish_reason=d.finish_reason)
    if req.logprobs and d.logprobs is not None:
        c.logprobs = _chat_logprobs(d.logprobs, req.return_tokens_as_token_ids)
    chunk = ChatCompletionChunk(id=res.request_id, created=int(res.received), model=model,
                                choices=[c])
    nv = nvext_body(req, res, d, final=False)
    if nv is not None:
        chunk.nvext = nv
    return chunk


# ------------------------------------------------------------------------ as plain data
# The same renderings as JSON-ready dicts, for code that builds responses without a
# frontend (test fakes of a frontend, tools).


def completion_response(req: CompletionRequest, res: Result, model: str) -> dict:
    return msgspec.to_builtins(completion_body(req, res, model))


def completion_chunk(req: CompletionRequest, res: Result, model: str, d: Delta,
                     text_offset: int) -> dict:
    return msgspec.to_builtins(completion_chunk_body(req, res, model, d, text_offset))


def final_chunk(req: Req, res: Result, model: str, obj: str | None = None) -> dict | None:
    last = final_chunk_body(req, res, model, obj)
    return None if last is None else msgspec.to_builtins(last)


def chat_response(req: ChatCompletionRequest, res: Result, model: str) -> dict:
    return msgspec.to_builtins(chat_body(req, res, model))


def chat_chunk(req: ChatCompletionRequest, res: Result, model: str, d: Delta, first: bool
               ) -> dict:
    return msgspec.to_builtins(chat_chunk_body(req, res, model, d, first))
