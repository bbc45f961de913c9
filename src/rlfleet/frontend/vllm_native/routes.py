"""vLLM's own serving routes (beside its OpenAI API), answered as vLLM 0.32 answers them:

- POST /inference/v1/generate: token IDs in; token IDs, logprobs and finish reasons out,
  unary or streamed (server-sent events), `output_mode` "tokens" or "text". Schema:
  vllm/entrypoints/scale_out/token_in_token_out/protocol.py and its serving.py (the
  rendering), sampling parameters from vllm/sampling_params.py, in vLLM 0.32. It goes
  through the same dispatch as /v1/completions (a worker of the model, retries before
  the first event, kept runs under X-Request-Id, nvext.policy), and each choice's
  `weight_versions` names the policy that produced its tokens. (vLLM serves it only when
  started with --enable-scale-out; rlfleet always does.)
- POST /tokenize: a text or a chat, tokenised by a worker of the model (its tokenizer and
  chat template). Schema: vllm/entrypoints/serve/tokenize/protocol.py and serving.py.
- POST /detokenize: token IDs decoded by a worker of the model. Same files.

- POST /v1/chat/completions/render, /v1/completions/render: an OpenAI chat or completion
  request rendered to the /inference/v1/generate request(s) that would run it (the
  prompt's token IDs from a worker of the model, the sampling parameters). Schema:
  vllm/entrypoints/scale_out/render/api_router.py and serving.py (the reply is
  token_in_token_out/protocol.py's GenerateRequest), in vLLM 0.32. `sampling_params`
  holds the parameters that differ from vLLM's defaults, as vLLM serializes them; which
  of them appear may differ from vLLM's own rendering, never their effect.

Where rlfleet differs from vLLM: fields it cannot honour are refused by name with a 400
(multimodal `features` / `content_parts`, KV and encoder-cache transfer, chosen-token
logprobs, `extra_args`, repetition detection, forced decoding, a thinking budget: the
*_REFUSED tables); `weight_versions` names rlfleet's policy (never null when the policy is
known); a request's `nvext` (staleness bound, extra_fields) is answered in a top-level
`nvext`, per chunk when streamed (the final-only fields are not sent on a stream); a
stream that fails ends with its error event and no `[DONE]`; vLLM's
/inference/v1/abort_requests is not served (cancel a run with
POST /v1/requests/{X-Request-Id}/cancel).

Request and response shapes: rlfleet.protocol.vllm_native; the bodies are rendered by
rlfleet.frontend.vllm_native.render."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from rlfleet.frontend import generation as gen
from rlfleet.frontend.result import Result
from rlfleet.frontend.vllm_native.render import (
    generate_body,
    generate_chunk_body,
    rendered_body,
    usage_chunk_body,
)
from rlfleet.protocol.engine import DetokenizeRequest, GenerateRequest, SamplingOptions, TokenizeRequest
from rlfleet.protocol.openai import ChatCompletionRequest, CompletionRequest
from rlfleet.protocol.vllm_native import (
    DetokenizeRouteRequest,
    DetokenizeRouteResponse,
    TokenizeRouteRequest,
    TokenizeRouteResponse,
    TokensGenerateRequest,
)
from rlfleet.runtime.http import HttpError, json_response

# ------------------------------------------------------------------------ generate


async def generate(request: Request) -> Response:
    req, model = await gen.decoded(request, TokensGenerateRequest)
    rid = gen.request_id(request, "generate", req.request_id or uuid.uuid4().hex)
    stream = bool(req.stream)
    sp = req.sampling_params
    session = gen.session_of(request)
    greq = gen.engine_request(lambda: GenerateRequest(
        request_id=rid, prompt_token_ids=req.token_ids, sampling=sp.engine(stream),
        stream=stream, cache_salt=req.cache_salt, priority=req.priority, session_id=session,
        routed_experts_start=sp.routed_experts_start))
    res = Result(rid, sp.n, keep_output=not stream or req.nvext.wants("engine_data"))
    call = await gen.follow(request, model, greq, res, req.nvext.policy)
    if not stream:
        return await call.unary(lambda: generate_body(req, res, model))

    async def chunks() -> AsyncIterator[bytes]:
        prompt_sent = False
        text = req.output_mode == "text"
        async for _, deltas, _ in call.batches():
            out = []
            for d in deltas:
                # vLLM emits a choice's chunk when it has tokens (or text) or it ends
                if not (d.token_ids or d.finish_reason is not None or (text and d.text)):
                    continue
                chunk = generate_chunk_body(req, res, d)
                if req.return_token_ids and not prompt_sent:
                    chunk.prompt_token_ids = res.prompt_token_ids
                    prompt_sent = True
                out.append(gen.sse(chunk))
            if out:
                yield b"".join(out)
        if req.include_usage:
            yield gen.sse(usage_chunk_body(req, res))
    return call.stream(chunks())


# ------------------------------------------------------------------------ tokenize


async def tokenize(request: Request) -> Response:
    """The token IDs a worker of the model makes of a prompt or of chat messages (its
    tokenizer and chat template: the IDs the engine would be prompted with)."""
    req: TokenizeRouteRequest = await gen.parse_body(request, TokenizeRouteRequest)
    gen.engine_request(req.refusals)
    fe = gen.frontend_of(request)
    w = await fe.pool.acquire(gen.served_model(request, req.model))
    out = await fe.client.tokenize(w.address, req.engine_request())
    return json_response(TokenizeRouteResponse(
        count=out.count, max_model_len=_max_model_len(w.entry), tokens=out.token_ids,
        token_strs=out.token_strs if req.return_token_strs else None))


async def detokenize(request: Request) -> Response:
    """The text a worker of the model decodes token IDs to."""
    req: DetokenizeRouteRequest = await gen.parse_body(request, DetokenizeRouteRequest)
    fe = gen.frontend_of(request)
    w = await fe.pool.acquire(gen.served_model(request, req.model))
    out = await fe.client.detokenize(w.address, DetokenizeRequest(token_ids=req.tokens))
    return json_response(DetokenizeRouteResponse(prompt=out.text))


def _max_model_len(entry: dict[str, Any]) -> int:
    mml = entry.get("max_model_len")
    if not isinstance(mml, int):
        raise HttpError(502, "the worker's discovery entry names no max_model_len; restart it "
                             "with a current rlfleet")
    return mml


# ------------------------------------------------------------------------ render


async def render_chat(request: Request) -> Response:
    """A chat completion request as the /inference/v1/generate request that runs it: the
    messages rendered and tokenised by a worker of the model, the sampling parameters."""
    req, model = await gen.decoded(request, ChatCompletionRequest)
    base = gen.request_id(request, "chatcmpl", req.request_id or uuid.uuid4().hex)
    fe = gen.frontend_of(request)
    w = await fe.pool.acquire(model)
    mml = _max_model_len(w.entry)
    ids = req.nvext.token_data
    if ids is None:
        ids = (await fe.client.tokenize(w.address, TokenizeRequest(
            messages=[m.plain() for m in req.messages],
            add_generation_prompt=req.add_generation_prompt,
            chat_template_kwargs=req.template_kwargs(),
            add_special_tokens=bool(req.add_special_tokens)))).token_ids
    ids = _truncated(ids, req.truncate_prompt_tokens, req.truncation_side, mml)

    def build() -> SamplingOptions:
        s = req.sampling(_room(mml, len(ids), req.token_budget), req.engine_logprobs)
        s.prompt_logprobs = req.engine_prompt_logprobs
        return s

    return json_response(rendered_body(req, f"chatcmpl-{base}", ids, gen.engine_request(build)))


async def render_completion(request: Request) -> Response:
    """A completion request as the /inference/v1/generate requests that run it, one per
    prompt: text prompts tokenised by a worker of the model."""
    req, model = await gen.decoded(request, CompletionRequest)
    base = "cmpl-" + gen.request_id(request, "cmpl", req.request_id or uuid.uuid4().hex)
    fe = gen.frontend_of(request)
    w = await fe.pool.acquire(model)
    mml = _max_model_len(w.entry)
    prompts = req.prompts
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            p = (await fe.client.tokenize(w.address, TokenizeRequest(
                prompt=p, add_special_tokens=req.add_special_tokens is not False))).token_ids
        ids = _truncated(list(p), req.truncate_prompt_tokens, req.truncation_side, mml)

        def build(n: int = len(ids)) -> SamplingOptions:
            s = req.sampling(_room(mml, n, req.max_tokens), req.engine_logprobs)
            s.prompt_logprobs = req.engine_prompt_logprobs
            return s

        rid = base if len(prompts) == 1 else f"{base}-{i}"
        out.append(rendered_body(req, rid, ids, gen.engine_request(build)))
    return json_response(out)


def _truncated(ids: list[int], keep: int | None, side: str | None, mml: int) -> list[int]:
    """The prompt as the engine would run it: truncated to `keep` tokens (-1: the context
    less one) from `side` (vLLM's default: the left)."""
    if keep is None:
        return ids
    if keep > mml:
        raise HttpError(400, f"truncate_prompt_tokens={keep} cannot be greater than "
                             f"max_model_len = {mml}. Please request a smaller truncation "
                             "size.", param="truncate_prompt_tokens")
    keep = mml - 1 if keep < 0 else keep
    if keep >= len(ids):
        return ids
    return ids[:keep] if side == "right" else ids[len(ids) - keep:]


def _room(mml: int, prompt_len: int, asked: int | None) -> int:
    """vLLM's max_tokens for a rendered request: what was asked, at most the room the
    prompt leaves."""
    if prompt_len > mml:
        raise HttpError(400, f"Input length ({prompt_len}) exceeds model's maximum context "
                             f"length ({mml}).")
    room = mml - prompt_len
    return room if asked is None else min(asked, room)


#: every route here takes a POST
router = Router(routes=[Route(path, handler, methods=["POST"]) for path, handler in (
    ("/inference/v1/generate", generate),
    ("/tokenize", tokenize),
    ("/detokenize", detokenize),
    ("/v1/chat/completions/render", render_chat),
    ("/v1/completions/render", render_completion),
)])
