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

Request and response shapes: rlfleet.protocol.vllm_native."""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from rlfleet.frontend.generation import (
    engine_request,
    follow,
    frontend_of,
    parse_body,
    request_id,
    served_model,
    session_of,
    sse,
)
from rlfleet.frontend.openai.render import nvext_body, routed_experts
from rlfleet.frontend.result import Choice, Result
from rlfleet.protocol.engine import (
    Delta,
    DetokenizeRequest,
    GenerateRequest,
    PromptLogprob,
    SamplingOptions,
    TokenizeRequest,
    TokenLogprob,
)
from rlfleet.protocol.identity import WeightSpan
from rlfleet.protocol.openai import ChatCompletionRequest, CompletionRequest, NvExtResponse
from rlfleet.protocol.vllm_native import (
    DetokenizeRouteRequest,
    DetokenizeRouteResponse,
    GenerateChoice,
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
    TextLogProb,
    TextLogProbs,
    TextLogProbsContent,
    TokenizeRouteRequest,
    TokenizeRouteResponse,
    TokensGenerateChunk,
    TokensGenerateRequest,
    TokensGenerateResponse,
    UsageInfo,
    WeightVersion,
)
from rlfleet.runtime.http import HttpError, json_response

RESPONSE_ID_PREFIX = "generate-tokens-"  # vLLM's: the response's request_id is this + the ID
LOGPROB_FLOOR = -9999.0  # what -inf and NaN are sent as (vLLM's)


def _clamp(lp: float) -> float:
    return LOGPROB_FLOOR if math.isnan(lp) else max(lp, LOGPROB_FLOOR)


# ------------------------------------------------------------------------ generate


async def generate(request: Request) -> Response:
    req: TokensGenerateRequest = await parse_body(request, TokensGenerateRequest)
    engine_request(req.refusals)
    model = served_model(request, req.model)
    rid = request_id(request, "generate", req.request_id or uuid.uuid4().hex)
    stream = bool(req.stream)
    sp = req.sampling_params
    session = session_of(request)
    greq = engine_request(lambda: GenerateRequest(
        request_id=rid, prompt_token_ids=req.token_ids, sampling=sp.engine(stream),
        stream=stream, cache_salt=req.cache_salt, priority=req.priority, session_id=session,
        routed_experts_start=sp.routed_experts_start))
    res = Result(rid, sp.n, keep_output=not stream or req.nvext.wants("engine_data"))
    call = await follow(request, model, greq, res, req.nvext.policy)
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
                out.append(sse(chunk))
            if out:
                yield b"".join(out)
        if req.include_usage:
            yield sse(usage_chunk_body(req, res))
    return call.stream(chunks())


def _usage(res: Result, completion: int | None = None) -> UsageInfo:
    p = len(res.prompt_token_ids)
    c = res.completion_tokens if completion is None else completion
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def weight_versions(res: Result, choice: Choice) -> list[WeightVersion] | None:
    """vLLM's weight_versions of a finished choice: spans of output tokens with the label
    of the weights that sampled them (rlfleet's: the declared version, else the span
    label "<version>|<digest>|<step>"), with the policy's digest and step beside; null when
    nothing about the policy is known (as vLLM without a label)."""
    spans: Sequence[WeightSpan] = res.spans(choice)
    if not any(s.policy for s in spans):
        return None
    return [WeightVersion(version=s.version if s.version is not None else s.policy.span_label(),
                          start=s.start, end=s.end, digest=s.digest, step=s.step,
                          adapter=s.adapter or None)
            for s in spans]


def _tops(lp: TokenLogprob, k: int | None) -> list[tuple[int, float, int | None, str]]:
    """vLLM's top list of one position: the sampled token, then the most likely others in
    rank order, max(k, 1) entries: (token_id, logprob, rank or None, decoded)."""
    out = [(lp.token_id, lp.logprob, lp.rank or None, lp.decoded)]
    out += [(t, v, j + 1, dec) for j, (t, v, dec) in enumerate(lp.top) if t != lp.token_id]
    return out[:max(k or 0, 1)]


def token_logprobs(lps: Sequence[TokenLogprob], k: int | None) -> GenerateLogProbs:
    return GenerateLogProbs(content=[GenerateLogProbsContent(
        token_id=lp.token_id, logprob=_clamp(lp.logprob), rank=lp.rank or None,
        top_logprobs=[GenerateLogProb(token_id=t, logprob=_clamp(v), rank=r)
                      for t, v, r, _ in _tops(lp, k)]) for lp in lps])


def _utf8(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


def text_logprobs(lps: Sequence[TokenLogprob], k: int | None) -> TextLogProbs:
    return TextLogProbs(content=[TextLogProbsContent(
        token=lp.decoded, logprob=_clamp(lp.logprob), bytes=_utf8(lp.decoded),
        top_logprobs=[TextLogProb(token=dec, logprob=_clamp(v), bytes=_utf8(dec))
                      for _, v, _, dec in _tops(lp, k)]) for lp in lps])


def _choice(req: TokensGenerateRequest, index: int, token_ids: list[int], text: str,
            lps: Sequence[TokenLogprob] | None, finish_reason: str | None,
            stop_reason: int | str | None) -> GenerateChoice:
    k = req.sampling_params.logprobs
    c = GenerateChoice(index=index, finish_reason=finish_reason, stop_reason=stop_reason,
                       token_ids=token_ids)
    if req.output_mode == "text":
        c.text = text
        if k is not None:
            c.logprobs = text_logprobs(lps or (), k)
    elif k is not None:
        c.logprobs = token_logprobs(lps or (), k)
    return c


def _prompt_logprobs(res: Result) -> list[dict[str, PromptLogprob] | None] | None:
    pls = res.prompt_logprobs
    if pls is None:
        return None
    return [None if e is None else
            {t: PromptLogprob(logprob=_clamp(p.logprob), rank=p.rank,
                              decoded_token=p.decoded_token) for t, p in e.items()}
            for e in pls]


def generate_body(req: TokensGenerateRequest, res: Result, model: str) -> TokensGenerateResponse:
    """The unary response (vLLM's GenerateTokensResponse / GenerateTextResponse)."""
    asked_experts = req.sampling_params.routed_experts_start is not None
    choices = []
    for c in res.choices:
        ch = _choice(req, c.index, list(c.token_ids), c.text, c.logprobs,
                     c.finish_reason or "stop", c.stop_reason)
        ch.weight_versions = weight_versions(res, c)
        if asked_experts:
            ch.routed_experts = routed_experts(c.routed_experts)
        choices.append(ch)
    body = TokensGenerateResponse(
        request_id=RESPONSE_ID_PREFIX + res.request_id, model=model, created=int(res.received),
        usage=_usage(res), prompt_logprobs=_prompt_logprobs(res),
        prompt_token_ids=res.prompt_token_ids if req.return_token_ids else None,
        output_mode=req.output_mode, choices=choices)
    nv = _nvext(req, res)
    if nv is not None:
        body.nvext = nv
    return body


def _nvext(req: TokensGenerateRequest, res: Result) -> NvExtResponse | None:
    """rlfleet's nvext (what nvext.extra_fields asked for): choice 0's fields, and with
    several choices each one's under `choices`."""
    nv = nvext_body(req, res, res.choices[0], final=True)  # type: ignore[arg-type]
    if nv is not None and len(res.choices) > 1:
        nv.choices = [nvext_body(req, res, c, final=False)  # type: ignore[arg-type]
                      or NvExtResponse() for c in res.choices]
    return nv


def generate_chunk_body(req: TokensGenerateRequest, res: Result, d: Delta
                        ) -> TokensGenerateChunk:
    """One stream chunk: one choice's delta (vLLM's GenerateTokensStreamResponse /
    GenerateTextStreamResponse)."""
    ch = _choice(req, d.index, list(d.token_ids), d.text, d.logprobs, d.finish_reason,
                 d.stop_reason)
    if d.finish_reason is not None:
        ch.weight_versions = weight_versions(res, res.choices[d.index])
        if req.sampling_params.routed_experts_start is not None:
            ch.routed_experts = routed_experts(d.routed_experts)
    chunk = TokensGenerateChunk(request_id=RESPONSE_ID_PREFIX + res.request_id,
                                output_mode=req.output_mode, choices=[ch])
    if req.continuous_usage:
        chunk.usage = _usage(res, res.choices[d.index].count)
    nv = nvext_body(req, res, d, final=False)  # type: ignore[arg-type]
    if nv is not None:
        chunk.nvext = nv
    return chunk


def usage_chunk_body(req: TokensGenerateRequest, res: Result) -> dict[str, Any]:
    """The last chunk with include_usage (vLLM leaves its null fields out)."""
    u = _usage(res)
    return {"request_id": RESPONSE_ID_PREFIX + res.request_id,
            "usage": {"prompt_tokens": u.prompt_tokens, "total_tokens": u.total_tokens,
                      "completion_tokens": u.completion_tokens},
            "output_mode": req.output_mode, "choices": []}


# ------------------------------------------------------------------------ tokenize


async def tokenize(request: Request) -> Response:
    """The token IDs a worker of the model makes of a prompt or of chat messages (its
    tokenizer and chat template: the IDs the engine would be prompted with)."""
    req: TokenizeRouteRequest = await parse_body(request, TokenizeRouteRequest)
    engine_request(req.refusals)
    fe = frontend_of(request)
    w = await fe.pool.acquire(served_model(request, req.model))
    out = await fe.client.tokenize(w.address, req.engine_request())
    return json_response(TokenizeRouteResponse(
        count=out.count, max_model_len=_max_model_len(w.entry), tokens=out.token_ids,
        token_strs=out.token_strs if req.return_token_strs else None))


async def detokenize(request: Request) -> Response:
    """The text a worker of the model decodes token IDs to."""
    req: DetokenizeRouteRequest = await parse_body(request, DetokenizeRouteRequest)
    fe = frontend_of(request)
    w = await fe.pool.acquire(served_model(request, req.model))
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
    req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
    engine_request(req.refusals)
    model = served_model(request, req.model)
    base = request_id(request, "chatcmpl", req.request_id or uuid.uuid4().hex)
    fe = frontend_of(request)
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

    return json_response(_rendered(req, f"chatcmpl-{base}", ids, engine_request(build)))


async def render_completion(request: Request) -> Response:
    """A completion request as the /inference/v1/generate requests that run it, one per
    prompt: text prompts tokenised by a worker of the model."""
    req: CompletionRequest = await parse_body(request, CompletionRequest)
    engine_request(req.refusals)
    model = served_model(request, req.model)
    base = "cmpl-" + request_id(request, "cmpl", req.request_id or uuid.uuid4().hex)
    fe = frontend_of(request)
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
        out.append(_rendered(req, rid, ids, engine_request(build)))
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


# vLLM's RequestOutputKind: deltas for a stream, the final output otherwise
_OUTPUT_KIND = {True: 1, False: 2}


def _rendered(req: ChatCompletionRequest | CompletionRequest, rid: str, ids: list[int],
              s: SamplingOptions) -> dict[str, Any]:
    """vLLM's GenerateRequest, as its render routes answer it."""
    if s.response_format is not None:
        raise HttpError(400, "response_format cannot be rendered for /inference/v1/generate; "
                             "send the constraint as structured_outputs", param="response_format")
    if not ids:
        raise HttpError(400, "No token_ids rendered")
    sp = msgspec.to_builtins(s)  # the fields that differ from the defaults
    sp.pop("response_format", None)
    if sp.get("top_k") == -1:
        sp.pop("top_k")
    sp["max_tokens"] = s.max_tokens
    sp["output_kind"] = _OUTPUT_KIND[bool(req.stream)]
    return {"request_id": rid, "token_ids": ids, "token_offsets": None, "features": None,
            "content_parts": None, "sampling_params": sp, "model": req.model,
            "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": None,
            "output_mode": "tokens", "stream": bool(req.stream),
            "stream_options": req.stream_options.model_dump() if req.stream
            and req.stream_options is not None else None,
            "cache_salt": req.cache_salt, "priority": req.priority,
            "kv_transfer_params": None, "ec_transfer_params": None}


router = Router(routes=[
    Route("/inference/v1/generate", generate, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/v1/chat/completions/render", render_chat, methods=["POST"]),
    Route("/v1/completions/render", render_completion, methods=["POST"]),
])

