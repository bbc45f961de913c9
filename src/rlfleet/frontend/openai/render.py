"""The OpenAI API's renderings, in vLLM's shapes: a request's result (rlfleet.frontend.result)
as a unary completion or chat completion, as the chunks of a stream, and nvext. Rendering
does only what the request asked for. The routes are rlfleet.frontend.openai.routes.

A completion request may carry several prompts: choice `i * n + j` of the response is
choice `j` of prompt `i`, as the OpenAI API defines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlfleet import __version__
from rlfleet.frontend.result import Choice, Result
from rlfleet.protocol.engine import (
    Delta,
    RoutedExperts,
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
    NvExtResponse,
    Usage,
)
from rlfleet.runtime.routed_experts import to_npy_b64

Req = CompletionRequest | ChatCompletionRequest
Results = Result | Sequence[Result]
LOGPROB_FLOOR = -9999.0  # what -inf is sent as (vLLM's, and OpenAI's, convention)


def _all(res: Results) -> Sequence[Result]:
    return [res] if isinstance(res, Result) else res


# ------------------------------------------------------------------------ shared parts


def routed_experts(r: Any) -> str | None:
    """A choice's routed experts as vLLM encodes them (base64 of the .npy array; null when
    the engine returned none: None or unset)."""
    return to_npy_b64(r) if isinstance(r, RoutedExperts) else None


def system_fingerprint(res: Result) -> str:
    """The backend configuration a response came from: rlfleet's version and the content
    digest of the policy weights that produced its first token."""
    digest = res.policy.digest
    return f"rlfleet-{__version__}" + (f"-{digest[:16]}" if digest else "")


def usage(results: Results) -> Usage:
    p = sum(len(r.prompt_token_ids) for r in _all(results))
    c = sum(r.completion_tokens for r in _all(results))
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def _usage_so_far(res: Result, choice: int) -> Usage:
    p, c = len(res.prompt_token_ids), res.choices[choice].count
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def keeps_output(req: Req) -> bool:
    """Whether a request's results keep each choice's whole output: unary responses render
    it, and a stream's nvext.engine_data carries it at the choice's end."""
    return not req.stream or req.nvext.wants("engine_data")


def token_str(tid: int, decoded: str, as_ids: bool | None) -> str:
    return f"token_id:{tid}" if as_ids else decoded


def _floor(lp: float) -> float:
    return max(lp, LOGPROB_FLOOR)


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
                out.detailed_finish_reason = detailed_finish_reason(
                    choice.finish_reason, choice.stop_reason, choice.stale_policy)
            if choice.stale_policy:
                out.stale_policy = True
            if "stop_reason" in wanted:
                out.stop_reason = choice.stop_reason
            if "weight_versions" in wanted:  # whole, also when streamed
                out.weight_versions = res.spans(res.choices[choice.index])
    if "engine_data" in wanted:
        out.engine_data = engine_data(res, choice)
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


def engine_data(res: Result, choice: Choice | Delta | None) -> dict[str, Any]:
    """nvext.engine_data: the policy identity on every chunk (a broken stream still names
    its policy) and, where a choice ends (its last chunk, or the unary choice), the
    choice's tokens as Dynamo's vLLM handler reports them: the whole
    `completion_token_ids`, `finished`, `completion_logprobs` (the sampled tokens', 1:1
    with the IDs) and the `prompt_token_ids` the engine was prompted with."""
    data: dict[str, Any] = res.policy.stamped()
    if choice is None or choice.finish_reason is None:
        return data
    whole = res.choices[choice.index]
    data["completion_token_ids"] = list(whole.token_ids)
    data["finished"] = True  # rlfleet ends a failed choice with an error event instead
    lps = whole.logprobs
    if lps is not None and len(lps) == len(whole.token_ids):
        data["completion_logprobs"] = [_floor(lp.logprob) for lp in lps]
    if res.prompt_token_ids:
        data["prompt_token_ids"] = res.prompt_token_ids
    return data


def _unary_nvext(req: Req, results: Sequence[Result]) -> NvExtResponse | None:
    """Unary: per-choice fields come from choice 0 (the contract's `choices[0]`), and with
    several choices also as a list over all of them under `choices` (for a batch of
    prompts each entry also carries its prompt's final fields)."""
    first = results[0]
    nv = nvext_body(req, first, first.choices[0], final=True)
    every = [(r, c) for r in results for c in r.choices]
    if nv is not None and len(every) > 1:
        batch = len(results) > 1
        per = [nvext_body(req, r, c, final=batch) or NvExtResponse() for r, c in every]
        if any(p != _EMPTY for p in per):
            nv.choices = per
    return nv


def final_chunk_body(req: Req, res: Results, model: str, obj: str | None = None
                     ) -> CompletionResponse | ChatCompletionChunk | None:
    """The last chunk of a stream: `completion_token_ids: []` plus the final-only nvext
    fields, and the whole request's usage (with the system fingerprint) when asked for."""
    results = _all(res)
    first = results[0]
    nv = nvext_body(req, first, None, final=True)
    if req.nvext.wants("completion_token_ids"):
        nv = nv or NvExtResponse()
        nv.completion_token_ids = []
    if nv is not None and len(results) > 1:
        per = [nvext_body(req, r, None, final=True) or NvExtResponse()
               for r in results for _ in r.choices]
        if any(p != _EMPTY for p in per):
            nv.choices = per
    if nv is None and not req.include_usage:
        return None
    completion = obj == "text_completion" if obj else isinstance(req, CompletionRequest)
    cls = CompletionResponse if completion else ChatCompletionChunk
    chunk = cls(id=first.request_id, created=int(first.received), model=model, choices=[])
    if nv is not None:
        chunk.nvext = nv
    if req.include_usage:
        chunk.usage = usage(results)
        chunk.system_fingerprint = system_fingerprint(first)
    return chunk


# ------------------------------------------------------------------------ completions


def _completion_logprobs(lps: Sequence[TokenLogprob], as_ids: bool | None, offset0: int,
                         prompt: list[tuple[int, str, tuple[float, dict] | None]] | None = None
                         ) -> CompletionLogprobs:
    """vLLM's rendering: `top_logprobs` holds the sampled token and then the top ones;
    each text offset advances by the length of the token as rendered."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    off = offset0
    for tid, decoded, entry in prompt or ():
        s = token_str(tid, decoded, as_ids)
        tokens.append(s)
        token_lps.append(None if entry is None else entry[0])
        tops.append(None if entry is None else entry[1])
        offsets.append(off)
        off += len(s)
    for lp in lps:
        s = token_str(lp.token_id, lp.decoded, as_ids)
        tokens.append(s)
        token_lps.append(_floor(lp.logprob))
        top = {s: _floor(lp.logprob)}
        for tid, val, dec in lp.top:
            top.setdefault(token_str(tid, dec, as_ids), _floor(val))
        tops.append(top)
        offsets.append(off)
        off += len(s)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops,
                              text_offset=offsets)


def _echo_prompt(res: Result, as_ids: bool | None, k: int
                 ) -> list[tuple[int, str, tuple[float, dict] | None]]:
    """(token_id, decoded, (logprob, top) | None) per prompt position, from prompt logprobs
    (the prompt token first, then the others, as vLLM orders them; at most k + 1 entries,
    as for generated tokens, whatever `prompt_logprobs` computed)."""
    out: list[tuple[int, str, tuple[float, dict] | None]] = []
    strs = res.prompt_token_strs or [""] * len(res.prompt_token_ids)
    for i, tid in enumerate(res.prompt_token_ids):
        entry = res.prompt_logprobs[i] if res.prompt_logprobs else None
        if entry is None or str(tid) not in entry:
            out.append((tid, strs[i], None))
            continue
        own = entry[str(tid)]
        top = {token_str(tid, own.decoded_token, as_ids): _floor(own.logprob)}
        for t, e in entry.items():
            if len(top) > k:
                break
            top.setdefault(token_str(int(t), e.decoded_token, as_ids), _floor(e.logprob))
        out.append((tid, strs[i], (_floor(own.logprob), top)))
    return out


def completion_body(req: CompletionRequest, res: Results, model: str) -> CompletionResponse:
    as_ids = req.return_tokens_as_token_ids
    results = _all(res)
    choices = []
    for p, r in enumerate(results):
        # vLLM: echo with return_token_ids echoes the prompt as token IDs only
        prompt_text = "" if req.return_token_ids else r.prompt_text
        for c in r.choices:
            ch = CompletionChoice(index=p * req.n + c.index,
                                  text=(prompt_text + c.text) if req.echo else c.text,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            if req.logprobs is not None and c.logprobs is not None:
                prompt = _echo_prompt(r, as_ids, req.logprobs) if req.echo else None
                ch.logprobs = _completion_logprobs(c.logprobs, as_ids, 0, prompt)
            if r.prompt_logprobs is not None:
                ch.prompt_logprobs = r.prompt_logprobs
            if req.return_token_ids:
                ch.token_ids = list(c.token_ids)
                ch.prompt_token_ids = r.prompt_token_ids
            if req.routed_experts_start is not None:
                ch.routed_experts = routed_experts(c.routed_experts)
            choices.append(ch)
    first = results[0]
    body = CompletionResponse(id=first.request_id, created=int(first.received), model=model,
                              choices=choices, usage=usage(results),
                              system_fingerprint=system_fingerprint(first))
    nv = _unary_nvext(req, results)
    if nv is not None:
        body.nvext = nv
    return body


def completion_chunk_body(req: CompletionRequest, res: Result, model: str, d: Delta,
                          text_offset: int, index: int | None = None, first: bool = False
                          ) -> tuple[CompletionResponse, int]:
    """One stream chunk for a delta of one choice (`index`: its place in the response),
    and the text offset after it. The choice's first chunk echoes the prompt when asked."""
    as_ids = req.return_tokens_as_token_ids
    text = d.text
    prompt = None
    if first and req.echo:
        text = ("" if req.return_token_ids else res.prompt_text) + text
        prompt = _echo_prompt(res, as_ids, req.logprobs or 0)
    c = CompletionChoice(index=d.index if index is None else index, text=text,
                         finish_reason=d.finish_reason, stop_reason=d.stop_reason)
    if req.logprobs is not None and d.logprobs is not None:
        c.logprobs = _completion_logprobs(d.logprobs, as_ids, text_offset, prompt)
        if c.logprobs.tokens:
            text_offset = c.logprobs.text_offset[-1] + len(c.logprobs.tokens[-1])
    if req.return_token_ids:
        c.token_ids = list(d.token_ids)
        if first:
            c.prompt_token_ids = res.prompt_token_ids
    if d.finish_reason is not None and req.routed_experts_start is not None:
        c.routed_experts = routed_experts(d.routed_experts)
    chunk = CompletionResponse(id=res.request_id, created=int(res.received), model=model,
                               choices=[c])
    _chunk_extras(chunk, req, res, d)
    return chunk, text_offset


def _chunk_extras(chunk, req, res: Result, d) -> None:
    """What a streamed completion or chat chunk adds after its choice: the fingerprint on
    the last one (unless a usage chunk follows), usage so far, and nvext."""
    if d.finish_reason is not None and not req.include_usage:
        chunk.system_fingerprint = system_fingerprint(res)
    if req.continuous_usage:
        chunk.usage = _usage_so_far(res, d.index)
    nv = nvext_body(req, res, d, final=False)
    if nv is not None:
        chunk.nvext = nv


# ------------------------------------------------------------------------ chat


def _chat_logprobs(lps: Sequence[TokenLogprob], k: int | None, as_ids: bool | None
                   ) -> ChatLogprobs:
    """vLLM's rendering: `top_logprobs` are the first k of (the sampled token, then the
    most likely others)."""
    content = []
    for lp in lps:
        tok = token_str(lp.token_id, lp.decoded, as_ids)
        tops = [(lp.token_id, lp.logprob, lp.decoded)]
        tops += [t for t in lp.top if t[0] != lp.token_id]
        content.append(ChatTokenLogprob(
            token=tok, logprob=_floor(lp.logprob),
            bytes=list(lp.decoded.encode("utf-8", errors="replace")),
            top_logprobs=[ChatTopLogprob(
                token=(s := token_str(t, dec, as_ids)), logprob=_floor(v),
                bytes=list(s.encode("utf-8", errors="replace")))
                for t, v, dec in tops[:k or 0]]))
    return ChatLogprobs(content=content)


def _echo_prefix(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content when it has the reply's role."""
    if req.echo and req.messages and req.messages[-1].role == req.reply_role:
        return req.messages[-1].text()
    return ""


def chat_body(req: ChatCompletionRequest, res: Result, model: str) -> ChatCompletionResponse:
    as_ids = req.return_tokens_as_token_ids
    role, prefix = req.reply_role, _echo_prefix(req)
    choices = []
    for c in res.choices:
        ch = ChatChoice(index=c.index, message=ChatMessageOut(role=role, content=prefix + c.text),
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        if req.logprobs and c.logprobs is not None:
            ch.logprobs = _chat_logprobs(c.logprobs, req.top_logprobs, as_ids)
        if req.return_token_ids:
            ch.token_ids = list(c.token_ids)
        if req.routed_experts_start is not None:
            ch.routed_experts = routed_experts(c.routed_experts)
        choices.append(ch)
    body = ChatCompletionResponse(id=res.request_id, created=int(res.received), model=model,
                                  choices=choices, usage=usage(res),
                                  system_fingerprint=system_fingerprint(res))
    if res.prompt_logprobs is not None:
        body.prompt_logprobs = res.prompt_logprobs
    if req.return_token_ids:
        body.prompt_token_ids = res.prompt_token_ids
    if req.return_prompt_text:
        body.prompt_text = res.prompt_text
    nv = _unary_nvext(req, [res])
    if nv is not None:
        body.nvext = nv
    return body


def chat_opening_chunks(req: ChatCompletionRequest, res: Result, model: str
                        ) -> list[ChatCompletionChunk]:
    """What a chat stream opens with, per choice: a role-only chunk, then the echoed last
    message when asked for (vLLM's order)."""
    out = []
    zero = Usage(prompt_tokens=len(res.prompt_token_ids), completion_tokens=0,
                 total_tokens=len(res.prompt_token_ids))
    for i in range(res.n):
        chunk = ChatCompletionChunk(id=res.request_id, created=int(res.received), model=model,
                                    choices=[ChatChunkChoice(index=i, delta=ChatDelta(
                                        role=req.reply_role, content=""))])
        if req.return_token_ids:
            chunk.prompt_token_ids = res.prompt_token_ids
        if req.return_prompt_text:
            chunk.prompt_text = res.prompt_text
        if req.continuous_usage:
            chunk.usage = zero
        out.append(chunk)
    prefix = _echo_prefix(req)
    if prefix:
        for i in range(res.n):
            chunk = ChatCompletionChunk(id=res.request_id, created=int(res.received), model=model,
                                        choices=[ChatChunkChoice(index=i,
                                                                 delta=ChatDelta(content=prefix))])
            if req.continuous_usage:
                chunk.usage = zero
            out.append(chunk)
    return out


def chat_chunk_body(req: ChatCompletionRequest, res: Result, model: str, d: Delta,
                    first: bool = False) -> ChatCompletionChunk:
    """A content chunk of one choice (the role came in its opening chunk; `first` is
    accepted for callers that render without one and puts the role here too)."""
    delta = ChatDelta(role=req.reply_role, content=d.text) if first else ChatDelta(content=d.text)
    c = ChatChunkChoice(index=d.index, delta=delta, finish_reason=d.finish_reason)
    if d.finish_reason is not None:
        c.stop_reason = d.stop_reason
    if req.logprobs and d.logprobs is not None:
        c.logprobs = _chat_logprobs(d.logprobs, req.top_logprobs, req.return_tokens_as_token_ids)
    if req.return_token_ids:
        c.token_ids = list(d.token_ids)
    if d.finish_reason is not None and req.routed_experts_start is not None:
        c.routed_experts = routed_experts(d.routed_experts)
    chunk = ChatCompletionChunk(id=res.request_id, created=int(res.received), model=model,
                                choices=[c])
    _chunk_extras(chunk, req, res, d)
    return chunk
