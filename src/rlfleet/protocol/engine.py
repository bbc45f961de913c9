"""The request plane between the frontend and a worker: one schema, used by both ends.

The frontend turns OpenAI / SGLang requests into one `GenerateRequest` and reads back the
events of that request. Tokenisation and detokenisation happen on the worker, with the
tokenizer of the model it serves (token authority): the frontend never tokenises.

Two transports carry the same messages (rlfleet.runtime.request_plane):
- the stream plane, what the frontend uses: one persistent TCP connection between a
  frontend process and a worker, every request multiplexed on it, each message one frame
  (`Frame` kind, stream number, msgpack body). Events are written per engine step and the
  frames of one event-loop turn go out in one write;
- HTTP on the worker (`POST /generate`, one JSON object per line) for direct callers:
  the refresh coordinator's probe, tests, curl.

Events of one generation, in order:
  1. `Head`  always first: prompt_token_ids, weight_version, weight_digest
             (with echo, also prompt_text and prompt_token_strs, one string per prompt token)
  2. `Step`  zero or more: {"choices": [Delta, ...]}, what each choice added in one step
  3. `Done`  always last: {"done": true, "prompt_logprobs": [...] | null}
  or, at any point, `ErrorEvent` {"error": {"message", "type", "code"}}, which ends it.
With `stream=false` the worker sends the same kinds, with all tokens of every choice in
one `Step`. Engines yield `Step` and `Done` as plain dicts of exactly these shapes (the
worker writes them as they are; the frontend reads them back as these types).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType, field

MAX_N = 64
MAX_LOGPROBS = 20
MAGIC = b"RLFP\x01"  # first bytes a frontend writes on a stream-plane connection (version 1)
# Per-stream flow control: a worker sends at most WINDOW events of a stream beyond those
# the frontend has acknowledged with CREDIT frames (the last event of a stream is exempt).
# A caller that reads slowly thus holds its request back in the engine instead of piling
# up events in the frontend.
WINDOW = 64


class SamplingOptions(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Sampling parameters, in vLLM's terms."""

    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = 0  # 0 or -1: disabled
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: int | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None  # None: up to the context length
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None  # 0: the sampled token
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    logit_bias: dict[int, float] | None = None  # token ID -> bias in [-100, 100]
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 63:
            raise ValueError("seed must fit in a signed 64-bit integer")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in (self.logit_bias or {}).items()):
            raise ValueError("logit_bias maps token IDs (>= 0) to biases in [-100, 100]")


class GenerateRequest(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """One generation request. Exactly one of prompt, prompt_token_ids, messages.
    `sampling` may be given as a dict; it is checked and converted."""

    request_id: Annotated[str, Meta(min_length=1, max_length=256)]
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stream: bool = True
    echo: bool = False  # Head also carries prompt_text and prompt_token_strs
    # W3C trace context of the caller's span (rlfleet.runtime.tracing): the worker's span,
    # and the engine's, start under it; log lines about the request name its trace
    traceparent: Annotated[str, Meta(max_length=256)] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.sampling, dict):
            try:
                self.sampling = msgspec.convert(self.sampling, SamplingOptions)
            except msgspec.ValidationError as e:
                raise ValueError(f"sampling: {e}") from e
        given = (self.prompt is not None) + (self.prompt_token_ids is not None) \
            + (self.messages is not None)
        if given != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids, messages")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty: send at least one character or token ID")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt is empty: send at least one token ID")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty: send at least one message")


class TokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt, messages")


class Tokens(Struct, kw_only=True):
    """The reply to a TokenizeRequest."""

    token_ids: list[int]
    count: int


class CancelRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """End a running request now: its stream ends with its partial output and finish
    reason `abort` (the engine's abort; the caller is still listening)."""

    request_id: Annotated[str, Meta(min_length=1)]


class Cancelled(Struct, kw_only=True):
    status: str
    request_id: str


# ---------------------------------------------------------------------------- events

class Head(Struct, kw_only=True, omit_defaults=True):
    """The first event: what the engine was given, and the weights that produced the
    first token (a pause may have swapped them since the request arrived)."""

    prompt_token_ids: list[int]
    weight_version: Any  # caller-declared label, or null
    weight_digest: str | None
    prompt_text: str | UnsetType = UNSET  # with echo
    prompt_token_strs: list[str] | UnsetType = UNSET  # with echo
    worker_id: int | UnsetType = UNSET  # set by the frontend: the instance that served it


class TokenLogprob(Struct, kw_only=True):
    """Logprob of one generated token, with the top alternatives."""

    token_id: int
    logprob: float
    rank: int | None = None
    decoded: str = ""
    top: list[tuple[int, float, str]] = []  # best first: (token_id, logprob, decoded)


class WeightSpan(Struct, kw_only=True):
    """Half-open span [start, end) of a choice's output tokens generated under one policy."""

    version: Any
    digest: str | None
    start: int
    end: int


FinishReason = Literal["stop", "length", "abort"]


class Delta(Struct, kw_only=True):
    """What one choice added in one step."""

    index: int
    token_ids: list[int] = []
    text: str = ""
    logprobs: list[TokenLogprob] | None = None  # 1:1 with token_ids when requested
    finish_reason: FinishReason | None = None
    # the stop string or stop token ID that ended the choice; None for EOS or length
    stop_reason: int | str | None = None
    # with the final delta, from an engine that tracks policies per token
    weight_versions: list[WeightSpan] | None = None


class Step(Struct, kw_only=True):
    choices: list[Delta]


class PromptLogprob(Struct, kw_only=True):
    logprob: float
    rank: int | None = None
    decoded_token: str = ""


class Done(Struct, kw_only=True):
    """The last event. prompt_logprobs: one entry per prompt position, position 0 null,
    others {"<token_id>": PromptLogprob} (the prompt token and the top alternatives)."""

    done: bool = True
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class EngineError(Struct, kw_only=True):
    message: str
    type: str = "internal_error"
    code: int = 500


class ErrorEvent(Struct, kw_only=True):
    """Ends a stream: the request failed (code 4xx: refused as given; 5xx: the worker)."""

    error: EngineError


Event = Head | Step | Done | ErrorEvent


class Frame(enum.IntEnum):
    """Kinds of stream-plane frames. A frame: 4-byte little-endian length of the rest,
    1-byte kind, 4-byte little-endian stream number, msgpack body."""

    # frontend -> worker
    GENERATE = 1  # GenerateRequest; answered by HEAD, STEP..., DONE or ERROR
    CLOSE = 2  # (empty) the caller of this stream went away: abort the request
    CANCEL = 3  # CancelRequest; answered by REPLY (Cancelled) or ERROR
    TOKENIZE = 4  # TokenizeRequest; answered by REPLY (Tokens) or ERROR
    CREDIT = 5  # int: the caller has taken this many more events of the stream
    # worker -> frontend
    HEAD = 10
    STEP = 11
    DONE = 12
    ERROR = 13  # EngineError
    REPLY = 14


def detailed_finish_reason(finish_reason: str | None, stop_reason: int | str | None) -> str | None:
    """Map the engine's finish reason to nvext's detailed_finish_reason."""
    if finish_reason is None:
        return None
    if finish_reason == "stop":
        return "eos" if stop_reason is None else "stop"
    if finish_reason == "abort":
        return "cancelled"
    return finish_reason  # length, content_filter
