"""Rendering of OpenAI completions and chat completions (unary and streamed), with nvext."""

from __future__ import annotations

from rlfleet.frontend.dispatch import Choice, Result
from rlfleet.protocol.engine import detailed_finish_reason
from rlfleet.protocol.nvext import NvExt
from rlfleet.protocol.openai import ChatCompletionRequest, CompletionRequest

Req = CompletionRequest | ChatCompletionRequest


def token_str(tid: int, decoded: str, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids else decoded


def nvext_body(req: Req, res: Result, choice: Choice | None, final: bool) -> dict:
    """The response's top-level "nvext" object for what the request asked for.
    Unary responses (final, choice given) carry everything; stream chunks carry deltas
    in `completion_token_ids` and the final-only fields in the last chunk."""
    nv: NvExt = req.nvext
    out: dict = {}
    if choice is not None and nv.wants("completion_token_ids"):
        out["completion_token_ids"] = list(choice.token_ids)
    if choice is not None and nv.wants("detailed_finish_reason") and choice.finish_reason:
        out["detailed_finish_reason"] = detailed_finish_reason(choice.finish_reason,
                                                               choice.stop_reason)
    if choice is not None and nv.wants("stop_reason") and choice.finish_reason:
        out["stop_reason"] = choice.stop_reason
    if choice is not None and nv.wants("weight_versions") and choice.finish_reason:
        out["weight_versions"] = res.spans(res.choices[choice.index])  # whole, also streamed
    if nv.wants("engine_data"):  # on every chunk: a broken stream still names its policy
        out["engine_data"] = {"weight_version": res.weight.get("weight_version"),
                              "weight_digest": res.weight.get("weight_digest")}
    if final:
        if nv.wants("prompt_token_ids"):
            out["prompt_token_ids"] = res.prompt_token_ids
        if nv.wants("prompt_logprobs") and req.prompt_logprobs is not None:
            out["prompt_logprobs"] = res.prompt_logprobs
        if nv.wants("worker_id"):
            out["worker_id"] = {"prefill_worker_id": res.worker_id,
                                "decode_worker_id": res.worker_id}
        if nv.wants("timing"):
            out["timing"] = res.timing()
    return out


# ---------------------------------------------------------------- completions

def _completion_logprobs(lps: list[dict], as_ids: bool, offset0: int,
                         prompt: list[tuple[int, str, dict | None]] | None = None) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    off = offset0
    for tid, decoded, entry in prompt or ():
        tokens.append(token_str(tid, decoded, as_ids))
        token_lps.append(None if entry is None else entry["logprob"])
        tops.append(None if entry is None else entry["top"])
        offsets.append(off)
        off += len(decoded)
    for lp in lps:
        s = token_str(lp["token_id"], lp["decoded"], as_ids)
        tokens.append(s)
        token_lps.append(lp["logprob"])
        top = {s: lp["logprob"]}
        for tid, val, dec in lp["top"]:
            top.setdefault(token_str(tid, dec, as_ids), val)
        tops.append(top)
        offsets.append(off)
        off += len(lp["decoded"])
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def _echo_prompt(res: Result, as_ids: bool) -> list[tuple[int, str, dict | None]]:
    """(token_id, decoded, {"logprob", "top"} | None) per prompt position, from prompt logprobs."""
    out = []
    strs = res.prompt_token_strs or [""] * len(res.prompt_token_ids)
    for i, tid in enumerate(res.prompt_token_ids):
        entry = res.prompt_logprobs[i] if res.prompt_logprobs else None
        if entry is None:
            out.append((tid, strs[i], None))
            continue
        top = {token_str(int(t), e["decoded_token"], as_ids): e["logprob"] for t, e in entry.items()}
        out.append((tid, strs[i], {"logprob": entry[str(tid)]["logprob"], "top": top}))
    return out


def completion_response(req: CompletionRequest, res: Result, model: str) -> dict:
    as_ids = req.return_tokens_as_token_ids
    choices = []
    for c in res.choices:
        text = (res.prompt_text + c.text) if req.echo else c.text
        ch = {"index": c.index, "text": text, "logprobs": None, "finish_reason": c.finish_reason,
              "stop_reason": c.stop_reason}
        if req.logprobs is not None and c.logprobs is not None:
            prompt = _echo_prompt(res, as_ids) if req.echo else None
            ch["logprobs"] = _completion_logprobs(c.logprobs, as_ids, 0, prompt)
        if req.prompt_logprobs is not None:
            ch["prompt_logprobs"] = res.prompt_logprobs
        choices.append(ch)
    body = {"id": res.request_id, "object": "text_completion", "created": int(res.received),
            "model": model, "choices": choices, "usage": res.usage()}
    nv = _merge_choice_nvext(req, res)
    if nv:
        body["nvext"] = nv
    return body


def _merge_choice_nvext(req: Req, res: Result) -> dict:
    """Unary: per-choice fields come from choice 0 (the contract's `choices[0]`), and for
    n > 1 also as lists over all choices under `choices`."""
    nv = nvext_body(req, res, res.choices[0], final=True)
    if len(res.choices) > 1:
        per = [nvext_body(req, res, c, final=False) for c in res.choices]
        if any(per):
            nv["choices"] = per
    return nv


def completion_chunk(req: CompletionRequest, res: Result, model: str, delta: dict,
                     text_offset: int) -> dict:
    c = {"index": delta["index"], "text": delta.get("text", ""), "logprobs": None,
         "finish_reason": delta.get("finish_reason"), "stop_reason": delta.get("stop_reason")}
    if req.logprobs is not None and delta.get("logprobs") is not None:
        c["logprobs"] = _completion_logprobs(delta["logprobs"], req.return_tokens_as_token_ids,
                                             text_offset)
    chunk = {"id": res.request_id, "object": "text_completion", "created": int(res.received),
             "model": model, "choices": [c]}
    nv = nvext_body(req, res, Choice(delta["index"], token_ids=delta.get("token_ids", []),
                                     finish_reason=delta.get("finish_reason"),
                                     stop_reason=delta.get("stop_reason")), final=False)
    if nv:
        chunk["nvext"] = nv
    return chunk


def final_chunk(req: Req, res: Result, model: str, obj: str) -> dict | None:
    """The last chunk of a stream: `completion_token_ids: []` plus the final-only nvext
    fields, and usage when asked for."""
    nv = nvext_body(req, res, None, final=True)
    if req.nvext.wants("completion_token_ids"):
        nv["completion_token_ids"] = []
    if not nv and not req.include_usage:
        return None
    chunk = {"id": res.request_id, "object": obj, "created": int(res.received), "model": model,
             "choices": []}
    if nv:
        chunk["nvext"] = nv
    if req.include_usage:
        chunk["usage"] = res.usage()
    return chunk


# ---------------------------------------------------------------------- chat

def _chat_logprobs(lps: list[dict], as_ids: bool) -> dict:
    content = []
    for lp in lps:
        s = token_str(lp["token_id"], lp["decoded"], as_ids)
        content.append({
            "token": s, "logprob": lp["logprob"], "bytes": list(lp["decoded"].encode()),
            "top_logprobs": [{"token": token_str(t, d, as_ids), "logprob": v,
                              "bytes": list(d.encode())} for t, v, d in lp["top"]],
        })
    return {"content": content}


def chat_response(req: ChatCompletionRequest, res: Result, model: str) -> dict:
    choices = []
    for c in res.choices:
        ch = {"index": c.index, "message": {"role": "assistant", "content": c.text},
              "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if req.logprobs and c.logprobs is not None:
            ch["logprobs"] = _chat_logprobs(c.logprobs, req.return_tokens_as_token_ids)
        choices.append(ch)
    body = {"id": res.request_id, "object": "chat.completion", "created": int(res.received),
            "model": model, "choices": choices, "usage": res.usage()}
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = res.prompt_logprobs
    nv = _merge_choice_nvext(req, res)
    if nv:
        body["nvext"] = nv
    return body


def chat_chunk(req: ChatCompletionRequest, res: Result, model: str, delta: dict,
               first: bool) -> dict:
    d: dict = {"role": "assistant", "content": delta.get("text", "")} if first else \
        {"content": delta.get("text", "")}
    c = {"index": delta["index"], "delta": d, "logprobs": None,
         "finish_reason": delta.get("finish_reason")}
    if req.logprobs and delta.get("logprobs") is not None:
        c["logprobs"] = _chat_logprobs(delta["logprobs"], req.return_tokens_as_token_ids)
    chunk = {"id": res.request_id, "object": "chat.completion.chunk",
             "created": int(res.received), "model": model, "choices": [c]}
    nv = nvext_body(req, res, Choice(delta["index"], token_ids=delta.get("token_ids", []),
                                     finish_reason=delta.get("finish_reason"),
                                     stop_reason=delta.get("stop_reason")), final=False)
    if nv:
        chunk["nvext"] = nv
    return chunk

