"""vLLM's own serving routes' bodies, as vLLM 0.32 renders them: a result
(rlfleet.frontend.result) as /inference/v1/generate's unary answer or stream chunks
(vllm/entrypoints/scale_out/token_in_token_out/serving.py: token or text logprobs, each
choice's `weight_versions`, nvext), and an OpenAI request rendered as the
/inference/v1/generate request that would run it (scale_out/render/serving.py). The
routes are rlfleet.frontend.vllm_native.routes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec

from rlfleet.frontend.openai.render import nvext_body, routed_experts
from rlfleet.frontend.result import Choice, Result
from rlfleet.protocol.engine import Delta, PromptLogprob, SamplingOptions, TokenLogprob
from rlfleet.protocol.identity import WeightSpan
from rlfleet.protocol.openai import ChatCompletionRequest, CompletionRequest, NvExtResponse
from rlfleet.protocol.vllm_native import (
    GenerateChoice,
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
    TextLogProb,
    TextLogProbs,
    TextLogProbsContent,
    TokensGenerateChunk,
    TokensGenerateRequest,
    TokensGenerateResponse,
    UsageInfo,
    WeightVersion,
)
from rlfleet.runtime.http import HttpError

RESPONSE_ID_PREFIX = "generate-tokens-"  # vLLM's: the response's request_id is this + the ID
LOGPROB_FLOOR = -9999.0  # what -inf and NaN are sent as (vLLM's)


def _clamp(lp: float) -> float:
    return LOGPROB_FLOOR if math.isnan(lp) else max(lp, LOGPROB_FLOOR)

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

# vLLM's RequestOutputKind: deltas for a stream, the final output otherwise
_OUTPUT_KIND = {True: 1, False: 2}


def rendered_body(req: ChatCompletionRequest | CompletionRequest, rid: str, ids: list[int],
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
