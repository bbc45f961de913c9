"""What one attempt brought back, in one shape for both routes.

The parsers read the wire (OpenAI completions and chat completions with nvext, unary or
streamed; native SGLang /generate, unary or streamed) without judging it: a missing or
malformed field becomes None or an empty list, so that the admission checks, not a parse
error, say what is wrong. Nothing here re-tokenises text: token IDs come from the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlfleet.protocol.identity import PolicyIdentity

TOKEN_ID_PREFIX = "token_id:"


class StreamError(Exception):
    """The server ended a stream with an error event (e.g. its worker died mid-request)."""


@dataclass
class GeneratedChoice:
    index: int
    token_ids: list[int] | None = None  # the engine's generated IDs (authoritative)
    logprobs: list[Any] | None = None  # the sampled token's logprob, one per generated token
    # the token each logprob says it belongs to ("token_id:<id>" / output_token_logprobs[i][1])
    logprob_token_ids: list[int | None] | None = None
    finish_reason: str | None = None
    detailed_finish_reason: str | None = None
    weight_spans: list[Any] | None = None  # nvext.weight_versions, raw
    stale_policy: bool = False  # the server marked it: its worker left the request's bound
    routed_experts: Any = None  # the choice's `routed_experts`, raw (base64 .npy string)


@dataclass
class Generation:
    route: str  # "openai" | "sglang"
    echoed_request_id: str | None = None  # the X-Request-Id response header
    response_id: str | None = None  # body "id" / meta_info.id
    model: str | None = None
    choices: list[GeneratedChoice] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None  # what the engine says it was prompted with
    # one entry per prompt position: None or {"<token_id>": {"logprob": f, ...}, ...}
    prompt_logprobs: list[Any] | None = None
    # the policy the worker reports (nvext.engine_data / SGLang meta_info); None: none
    policy: PolicyIdentity | None = None
    worker_id: int | None = None


def _dict(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def _list(x: Any) -> list | None:
    return x if isinstance(x, list) else None


def _token_of(s: Any) -> int | None:
    if isinstance(s, str) and s.startswith(TOKEN_ID_PREFIX):
        try:
            return int(s[len(TOKEN_ID_PREFIX):])
        except ValueError:
            return None
    return None


# ---------------------------------------------------------------- OpenAI /v1/completions

def _openai_logprobs(lp: Any) -> tuple[list | None, list | None]:
    """(sampled-token logprobs, the token each names): completions carry `token_logprobs`
    and `tokens`; chat completions a `content` list of {"token", "logprob", ...}."""
    lp = _dict(lp)
    content = _list(lp.get("content"))
    if content is not None:
        entries = [_dict(e) for e in content]
        return [e.get("logprob") for e in entries], [_token_of(e.get("token")) for e in entries]
    values, tokens = _list(lp.get("token_logprobs")), _list(lp.get("tokens"))
    return values, None if tokens is None else [_token_of(t) for t in tokens]


def _worker_id(nv: dict) -> int | None:
    wid = _dict(nv.get("worker_id")).get("decode_worker_id")
    return wid if isinstance(wid, int) else None


def _engine_policy(nv: dict) -> PolicyIdentity | None:
    """nvext.engine_data's policy, when it is an object."""
    data = nv.get("engine_data")
    return PolicyIdentity.from_stamped(data) if isinstance(data, dict) else None


def _engine_tokens(nv: dict, key: str) -> list | None:
    """A token list from nvext.engine_data (Dynamo's shape: a choice's whole
    `completion_token_ids` and its `prompt_token_ids`, where the choice ends)."""
    return _list(_dict(nv.get("engine_data")).get(key))


def _token_ids(nv: dict, key: str) -> list | None:
    """nvext's own `key` (malformed: None), else, where it is absent, engine_data's (a
    server that fills only engine_data)."""
    return _list(nv[key]) if key in nv else _engine_tokens(nv, key)


def parse_openai(body: Any, echoed_request_id: str | None = None) -> Generation:
    """A unary /v1/completions or /v1/chat/completions response."""
    body = _dict(body)
    nv = _dict(body.get("nvext"))
    per_choice = _list(nv.get("choices"))
    gen = Generation("openai", echoed_request_id, body.get("id"), body.get("model"),
                     prompt_token_ids=_token_ids(nv, "prompt_token_ids"),
                     prompt_logprobs=_list(nv.get("prompt_logprobs")),
                     policy=_engine_policy(nv),
                     worker_id=_worker_id(nv))
    for pos, raw in enumerate(_list(body.get("choices")) or []):
        raw = _dict(raw)
        index = raw.get("index", pos)
        # n > 1: per-choice nvext under nvext.choices; n == 1: top level (choice 0)
        cnv = _dict(per_choice[index]) if per_choice is not None and isinstance(index, int) \
            and 0 <= index < len(per_choice) else nv if index == 0 else {}
        values, tokens = _openai_logprobs(raw.get("logprobs"))
        gen.choices.append(GeneratedChoice(
            index=index, token_ids=_token_ids(cnv, "completion_token_ids"), logprobs=values,
            logprob_token_ids=tokens, finish_reason=raw.get("finish_reason"),
            detailed_finish_reason=cnv.get("detailed_finish_reason"),
            weight_spans=_list(cnv.get("weight_versions")),
            stale_policy=cnv.get("stale_policy") is True,
            routed_experts=raw.get("routed_experts")))
    gen.choices.sort(key=lambda c: c.index if isinstance(c.index, int) else -1)
    return gen


class OpenAIStream:
    """Folds the SSE chunks of a streamed /v1/completions (or chat) response into a Generation.
    Chunks carry one choice each, with `nvext.completion_token_ids` deltas (or, from a
    server that sends only engine_data, the whole list in the choice's last chunk's
    `nvext.engine_data`); the last chunk (no choices) carries the final-only nvext fields."""

    def __init__(self, n: int, echoed_request_id: str | None = None) -> None:
        self.gen = Generation("openai", echoed_request_id)
        self.gen.choices = [GeneratedChoice(i) for i in range(n)]

    def feed(self, chunk: Any) -> int:
        """Fold one chunk in; return how many generated tokens it carried."""
        chunk = _dict(chunk)
        if "error" in chunk:
            raise StreamError(str(_dict(chunk["error"]).get("message", chunk["error"])))
        g = self.gen
        if g.response_id is None:
            g.response_id, g.model = chunk.get("id"), chunk.get("model")
        nv = _dict(chunk.get("nvext"))
        new = 0
        for raw in _list(chunk.get("choices")) or []:
            raw = _dict(raw)
            i = raw.get("index")
            if not isinstance(i, int) or not 0 <= i < len(g.choices):
                continue  # a choice nobody asked for: the count check will say so
            c = g.choices[i]
            ids = _list(nv.get("completion_token_ids"))
            if ids is not None:
                c.token_ids = (c.token_ids or []) + ids
                new += len(ids)
            values, tokens = _openai_logprobs(raw.get("logprobs"))
            if values is not None:
                c.logprobs = (c.logprobs or []) + values
            if tokens is not None:
                c.logprob_token_ids = (c.logprob_token_ids or []) + tokens
            if "completion_token_ids" not in nv and c.token_ids is None:
                ids = _engine_tokens(nv, "completion_token_ids")
                if ids is not None:
                    c.token_ids = list(ids)
                    new += len(ids)
            if raw.get("routed_experts") is not None:
                c.routed_experts = raw["routed_experts"]
            if raw.get("finish_reason") is not None:
                c.finish_reason = raw["finish_reason"]
                c.detailed_finish_reason = nv.get("detailed_finish_reason")
                c.stale_policy = nv.get("stale_policy") is True
            if "weight_versions" in nv:
                c.weight_spans = _list(nv["weight_versions"])
        for key in ("prompt_token_ids", "prompt_logprobs"):
            if key in nv:
                setattr(g, key, _list(nv[key]))
        if g.prompt_token_ids is None:
            g.prompt_token_ids = _engine_tokens(nv, "prompt_token_ids")
        if isinstance(nv.get("engine_data"), dict):
            g.policy = _engine_policy(nv)
        if "worker_id" in nv:
            g.worker_id = _worker_id(nv)
        if "weight_versions" in nv and not _list(chunk.get("choices")):
            for c in g.choices:  # final-chunk spans apply to choices that carried none
                if c.weight_spans is None:
                    c.weight_spans = _list(nv["weight_versions"])
        return new

    def result(self) -> Generation:
        return self.gen


# ---------------------------------------------------------------- SGLang /generate

def _sglang_prompt_logprobs(entries: Any) -> list | None:
    """input_token_logprobs [[logprob | None, token_id, _], ...] in OpenAI's shape."""
    entries = _list(entries)
    if entries is None:
        return None
    out: list[Any] = []
    for e in entries:
        e = _list(e) or [None, None]
        lp, tid = (e + [None, None])[:2]
        out.append(None if lp is None else {str(tid): {"logprob": lp}})
    return out


def parse_sglang(body: Any, echoed_request_id: str | None = None) -> Generation:
    """A unary /generate response, or the last event of a streamed one (SGLang streams
    cumulative events: the last one holds the whole completion)."""
    body = _dict(body)
    if "error" in body:
        raise StreamError(str(_dict(body["error"]).get("message", body["error"])))
    meta = _dict(body.get("meta_info"))
    lps = _list(meta.get("output_token_logprobs"))
    values = tokens = None
    if lps is not None:
        rows = [(_list(e) or [None, None]) + [None, None] for e in lps]
        values = [r[0] for r in rows]
        tokens = [r[1] if isinstance(r[1], int) else None for r in rows]
    finish = meta.get("finish_reason")
    choice = GeneratedChoice(0, token_ids=_list(body.get("output_ids")), logprobs=values,
                             logprob_token_ids=tokens,
                             finish_reason=_dict(finish).get("type") if finish is not None else None,
                             detailed_finish_reason=_dict(finish).get("message")
                             if _dict(finish).get("message") == "stale_policy" else None,
                             weight_spans=_list(meta.get("weight_versions")),
                             stale_policy=meta.get("stale_policy") is True)
    return Generation("sglang", echoed_request_id, meta.get("id"), meta.get("model"),
                      choices=[choice] if body else [],
                      prompt_logprobs=_sglang_prompt_logprobs(meta.get("input_token_logprobs")),
                      policy=PolicyIdentity.stamped_on(meta))


class SglangStream:
    """Keeps the latest cumulative /generate event."""

    def __init__(self, echoed_request_id: str | None = None) -> None:
        self.echoed = echoed_request_id
        self.last: dict | None = None
        self.tokens = 0

    def feed(self, event: Any) -> int:
        event = _dict(event)
        if "error" in event:
            raise StreamError(str(_dict(event["error"]).get("message", event["error"])))
        self.last = event
        now = len(_list(event.get("output_ids")) or ())
        new, self.tokens = max(0, now - self.tokens), max(now, self.tokens)
        return new

    def result(self) -> Generation:
        return parse_sglang(self.last or {}, self.echoed)
