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
             (with echo, also prompt_text and prompt_token_strs, one string per prompt token;
             with echo and stream, also prompt_logprobs when asked for)
  2. `Step`  zero or more: {"choices": [Delta, ...]}, what each choice added in one step
  3. `Done`  always last: {"done": true, "prompt_logprobs": [...] | null}
  or, at any point, `ErrorEvent` {"error": {"message", "type", "code"}}, which ends it.
With `stream=false` the worker sends the same kinds, with all tokens of every choice in
one `Step`. Engines yield these very `Step` and `Done` structs (the worker encodes them as
they are; the frontend decodes them as the same types). A field an engine leaves unset
(`UNSET`: `Delta.weight_versions`, `Delta.routed_experts`, `Done.cached_tokens`) is left
out of the frame; the reader sees it unset too. With echo and stream an engine puts the
prompt logprobs into its first `Step` (`Step.prompt_logprobs`), which the worker moves into
the Head before the Step is sent.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType, field

from rlfleet.protocol.identity import PolicyIdentity, WeightSpan

MAX_N = 64
MAX_LOGPROBS = 20
MAGIC = b"RLFP\x01"  # first bytes a frontend writes on a stream-plane connection (version 1)
# Per-stream flow control: a worker sends at most WINDOW events of a stream beyond those
# the frontend has acknowledged with CREDIT frames (the last event of a stream is exempt).
# A caller that reads slowly thus holds its request back in the engine instead of piling
# up events in the frontend.
WINDOW = 64


class InvalidParam(ValueError):
    """A request parameter the engine would refuse; `param` names it (the error's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class SamplingOptions(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Sampling parameters, in vLLM's terms. Their values are checked as vLLM's engine
    checks them where a request is built or decoded (rlfleet.runtime.request_checks), not
    here: a struct holds its fields only."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None  # -1: none (vLLM's convention)
    max_tokens: int | None = None  # None: up to the context length; clamped to the room left
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # 0: the sampled token; -1: the whole vocabulary
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token ID -> bias, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] = []  # words never generated
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream_interval: int | None = None  # tokens per streamed event (at least)
    watermarking: bool | None = None  # None/true: watermark where the engine is set up to
    # constrained decoding, as vLLM's request fields of these names (engines that cannot
    # honour them refuse the request)
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class GenerateRequest(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """One generation request. Exactly one of prompt, prompt_token_ids, messages (its
    shape, checked here); the values are checked where the request is built or decoded
    (rlfleet.runtime.request_checks.check_request). `sampling` may be given as a dict; it
    is converted."""

    request_id: Annotated[str, Meta(min_length=1, max_length=256)]
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    # passed to the chat template (besides the messages): tools, documents,
    # continue_final_message, reasoning_effort, ... as transformers' apply_chat_template
    # takes them
    chat_template_kwargs: dict[str, Any] | None = None
    # special tokens (BOS) added when tokenising: None = the default (yes for a text prompt,
    # no for chat, whose template adds them)
    add_special_tokens: bool | None = None
    # keep this many prompt tokens (-1: as many as the context allows, less one), cut from
    # `truncation_side` (None: the tokenizer's side)
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stream: bool = True
    echo: bool = False  # Head also carries prompt_text and prompt_token_strs
    cache_salt: str | None = None  # prefix-cache salt (vLLM's cache_salt)
    priority: int = 0  # scheduling priority (lower: earlier), for engines that schedule by it
    session_id: str | None = None  # related requests' shared identity (vLLM's session_id)
    # routed experts (MoE; engines started with --enable-return-routed-experts): None, not
    # asked for; -1, one row per completion token (the forward pass that produced it: the
    # last prompt position for the first); k >= 0, vLLM's routed_experts_prompt_start: from
    # prompt position k to the last token forwarded (see RoutedExperts)
    routed_experts_start: int | None = None
    # W3C trace context of the caller's span (rlfleet.runtime.tracing): the worker's span,
    # and the engine's, start under it; log lines about the request name its trace
    traceparent: Annotated[str, Meta(max_length=256)] | None = None
    # set by a frontend for a request with a caller-chosen X-Request-Id: what that ID stands
    # for (a digest of the route and body). The worker then owns the run under its request
    # ID: another request with the same ID and `retain` attaches to it (all its events from
    # the start) instead of generating again, whichever frontend (process) sends it; the
    # same ID with another `retain` is refused (409). See rlfleet.worker.kept.
    retain: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    # with `retain`: the SHA-256 (hex) of the X-Cancel-Token the request was started with;
    # a cancel relayed by a frontend that does not hold the run must present the same
    cancel_hash: Annotated[str, Meta(max_length=64)] | None = None
    # with `retain`: only follow the run the worker keeps under this ID (running, or ended
    # whole); where it keeps none, the answer is an error ATTACH_NOT_FOUND and nothing is
    # generated. A frontend asks this of the workers an ID ranks first before it places the
    # request elsewhere (rlfleet.frontend.router.WorkerPool.owners).
    attach_only: bool = False
    # with attach_only: the stream-plane address of the worker the request goes to where
    # this one keeps no run; this one remembers it for the ID, and a later request for the
    # ID (same `retain`) that comes here follows the run there (relayed) before this worker
    # would generate it again (rlfleet.worker.kept)
    placed_at: Annotated[str, Meta(max_length=256)] | None = None
    # the LoRA adapter to run on (its name, as the request's `model` gave it); None: the
    # base model
    adapter: Annotated[str, Meta(min_length=1, max_length=256)] | None = None

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
        if self.attach_only and self.retain is None:
            raise ValueError("attach_only follows a kept run: give its retain too")


class TokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # special tokens (BOS) added when tokenising: None = the default (yes for a text prompt,
    # no for chat, whose template adds them)
    add_special_tokens: bool | None = None
    # the reply also carries each token as the tokenizer's vocabulary spells it
    return_token_strs: bool = False

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt, messages")


class Tokens(Struct, kw_only=True, omit_defaults=True):
    """The reply to a TokenizeRequest."""

    token_ids: list[int]
    count: int
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """The text of token IDs, as the worker's tokenizer decodes them (special tokens kept)."""

    token_ids: list[int]


class Detokenized(Struct, kw_only=True):
    """The reply to a DetokenizeRequest."""

    text: str


class CancelRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """End a running request now: its stream ends with its partial output and finish
    reason `abort` (the engine's abort; the caller is still listening)."""

    request_id: Annotated[str, Meta(min_length=1)]
    # set by a frontend relaying its caller's cancel: the SHA-256 (hex) of the X-Cancel-Token
    # the caller presented; the worker ends only a run it keeps (GenerateRequest.retain)
    # that was started with the same token. Unset: the frontend vouches for the caller (its
    # admin, or the frontend's own staleness abort)
    owner: Annotated[str, Meta(max_length=64)] | None = None


# Cancelled.status: ended (or ending) / a relayed cancel whose token is not the run's /
# a relayed cancel for a run this worker does not keep
CANCEL_OK, CANCEL_FORBIDDEN, CANCEL_UNKNOWN = "ok", "forbidden", "unknown"
#: the error status of an attach-only request (GenerateRequest.attach_only) for an ID the
#: worker keeps no run under
ATTACH_NOT_FOUND = 404


class Cancelled(Struct, kw_only=True):
    status: str  # CANCEL_OK, CANCEL_FORBIDDEN or CANCEL_UNKNOWN
    request_id: str


# ---------------------------------------------------------------------------- events

# The events (Head, Step, Delta, TokenLogprob, PromptLogprob, Done) are made with gc=False:
# the garbage collector does not track them (their lists still are). One is made per token
# on both sides of the stream plane and a run kept for retries holds its events for
# minutes; none of them ever refers back to what holds it, so they can never be part of a
# reference cycle, which is all the collector is for.

class Head(Struct, kw_only=True, omit_defaults=True, gc=False):
    """The first event: what the engine was given, and the weights that produced the
    first token (a pause may have swapped them since the request arrived)."""

    prompt_token_ids: list[int]
    weight_version: Any  # caller-declared label, or null
    weight_digest: str | None
    weight_step: int | None = None  # the policy's fleet step, when declared
    weight_adapter: str | UnsetType = UNSET  # the LoRA adapter's name (its own policy)
    prompt_text: str | UnsetType = UNSET  # with echo
    prompt_token_strs: list[str] | UnsetType = UNSET  # with echo
    # with echo and stream: the prompt logprobs up front (Done then carries none), so that a
    # stream can start with the echoed prompt and its logprobs
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | UnsetType = UNSET
    worker_id: int | UnsetType = UNSET  # set by the frontend: the instance that served it

    @classmethod
    def of(cls, prompt_token_ids: list[int], policy: PolicyIdentity) -> Head:
        """The Head of a generation whose first token `policy` produced."""
        return cls(prompt_token_ids=prompt_token_ids, **policy.stamped())

    @property
    def policy(self) -> PolicyIdentity:
        """The policy that produced the first token."""
        return PolicyIdentity.from_stamped(msgspec.structs.asdict(self))


class TokenLogprob(Struct, kw_only=True, gc=False):
    """Logprob of one generated token, with the top alternatives."""

    token_id: int
    logprob: float
    rank: int | None = None
    decoded: str = ""
    top: list[tuple[int, float, str]] = []  # best first: (token_id, logprob, decoded)


FinishReason = Literal["stop", "length", "abort"]


class RoutedExperts(Struct, kw_only=True, frozen=True):
    """The experts a MoE engine routed tokens to: `data` is a C-order little-endian array of
    `dtype` shaped `shape` = (tokens, MoE layers, top-k); row j is the forward pass at
    position `start + j` of the sequence (prompt, then completion). As a choice's final
    delta carries it for a request's `routed_experts_start` -1, `start` is the last prompt
    position and row i produced completion token i. On the OpenAI routes it is vLLM's
    encoding: base64 of the array's .npy bytes. The array and both encodings are
rlfleet.runtime.routed_experts."""

    data: bytes
    dtype: Literal["uint8", "uint16", "int32"]
    shape: tuple[int, int, int]
    start: int = 0

    def __post_init__(self) -> None:
        size = {"uint8": 1, "uint16": 2, "int32": 4}[self.dtype]
        t, layers, k = self.shape
        if min(self.shape) < 0 or len(self.data) != t * layers * k * size:
            raise ValueError(f"routed experts: {len(self.data)} bytes do not hold a {self.dtype} "
                             f"array of shape {self.shape}")

    @property
    def tokens(self) -> int:
        return self.shape[0]


class Delta(Struct, kw_only=True, gc=False):
    """What one choice added in one step."""

    index: int
    token_ids: list[int] = []
    text: str = ""
    logprobs: list[TokenLogprob] | None = None  # 1:1 with token_ids when requested
    finish_reason: FinishReason | None = None
    # the stop string or stop token ID that ended the choice; None for EOS or length
    stop_reason: int | str | None = None
    # with the final delta, from an engine that tracks policies per token (unset: the
    # engine does not say, left out of the frame)
    weight_versions: list[WeightSpan] | None | UnsetType = UNSET
    # set by the frontend on a final delta: the choice left the request's staleness bound
    # (nvext.policy) while it was generated
    stale_policy: bool | UnsetType = UNSET
    # with the final delta, when the request asked (routed_experts_start) and the engine
    # returns them (unset: none, left out of the frame)
    routed_experts: RoutedExperts | None | UnsetType = UNSET


class Step(Struct, kw_only=True, gc=False):
    choices: list[Delta]
    # from an engine to its worker only, on the first Step of a request with echo and
    # stream: the prompt logprobs, which the worker moves into the Head (never sent)
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None | UnsetType = UNSET


class PromptLogprob(Struct, kw_only=True, gc=False):
    logprob: float
    rank: int | None = None
    decoded_token: str = ""


class Done(Struct, kw_only=True, gc=False):
    """The last event. prompt_logprobs: one entry per prompt position, position 0 null,
    others {"<token_id>": PromptLogprob} (the prompt token and the top alternatives)."""

    done: bool = True
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    # prompt tokens the engine found in its prefix cache (vLLM's num_cached_tokens);
    # unset: the engine does not say (left out of the frame)
    cached_tokens: int | None | UnsetType = UNSET


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
    PING = 6  # (empty, stream 0) are you there? answered by PONG on the worker's event loop
    AUTH = 7  # str, stream 0, first frame: the admin token (workers started with one need it)
    DETOKENIZE = 8  # DetokenizeRequest; answered by REPLY (Detokenized) or ERROR
    # worker -> frontend
    HEAD = 10
    STEP = 11
    DONE = 12
    ERROR = 13  # EngineError
    REPLY = 14
    PONG = 15  # (empty, stream 0) the answer to PING


STALE_POLICY = "stale_policy"  # detailed finish reason of a choice aborted as stale


def detailed_finish_reason(finish_reason: str | None, stop_reason: int | str | None,
                           stale: bool = False) -> str | None:
    """Map the engine's finish reason to nvext's detailed_finish_reason (`stale`: the
    frontend ended it for leaving the request's staleness bound)."""
    if finish_reason is None:
        return None
    if stale and finish_reason == "abort":
        return STALE_POLICY
    if finish_reason == "stop":
        return "eos" if stop_reason is None else "stop"
    if finish_reason == "abort":
        return "cancelled"
    return finish_reason  # length, content_filter
