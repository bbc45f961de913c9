"""Rendering of native SGLang `/generate` responses (cumulative, as SGLang streams them)."""

from __future__ import annotations

from rlfleet.frontend.dispatch import Result
from rlfleet.protocol.sglang import SglangGenerateRequest


def _finish(reason: str | None, stop_reason, length: int) -> dict | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": length}
    if reason == "abort":
        return {"type": "abort", "message": "request aborted"}
    return {"type": "stop", "matched": stop_reason}


def generate_body(req: SglangGenerateRequest, res: Result) -> dict:
    c = res.choices[0]
    meta = {
        "id": res.request_id,
        "finish_reason": _finish(c.finish_reason, c.stop_reason, len(c.token_ids)),
        "prompt_tokens": len(res.prompt_token_ids),
        "completion_tokens": len(c.token_ids),
        "cached_tokens": 0,
    }
    for k, v in res.weight.items():
        meta[k] = v
    if c.finish_reason is not None:
        meta["weight_versions"] = res.spans(c)
    if req.return_logprob:
        lps = c.logprobs or []
        meta["output_token_logprobs"] = [[lp["logprob"], lp["token_id"], None] for lp in lps]
        if req.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [[[v, t, None] for t, v, _ in lp["top"]] for lp in lps]
        if req.logprob_start_len >= 0 and res.prompt_logprobs is not None:
            start = req.logprob_start_len
            ids = res.prompt_token_ids
            meta["input_token_logprobs"] = [
                [None if e is None else e[str(ids[i])]["logprob"], ids[i], None]
                for i, e in enumerate(res.prompt_logprobs) if i >= start]
    return {"text": c.text, "output_ids": list(c.token_ids), "meta_info": meta}
