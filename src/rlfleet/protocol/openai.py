"""OpenAI-compatible schemas: requests (pydantic, with vLLM's sampling extensions and
nvext) and the responses the frontend renders (msgspec structs: fields set to UNSET are
left out of the JSON, every other field is always there, null included)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from msgspec import UNSET, Struct, UnsetType
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlfleet.protocol.engine import (
    InvalidParam,
    PromptLogprob,
    SamplingOptions,
    WeightSpan,
)
from rlfleet.protocol.nvext import NvExt

MAX_PROMPTS = 1024  # prompts in one batch request (vLLM's VLLM_MAX_COMPLETION_PROMPTS)

# vLLM request fields rlfleet refuses when set to anything but their default (None, or the
# value given): why, in the user's words. Listed in the README.
REFUSED: dict[str, str] = {
    "use_beam_search": "beam search is not run by rlfleet workers (rollouts are sampled; use n)",
    "logprob_token_ids": "logprobs of chosen token IDs are not supported; use logprobs / "
                         "top_logprobs",
    "prompt_embeds": "prompt embeddings are not supported: rlfleet's token authority needs "
                     "token IDs (send prompt as token IDs)",
    "suffix": "suffix is only supported for models with FIM completion rendering",
    "kv_transfer_params": "disaggregated serving (KV transfer) is not part of rlfleet workers",
    "ec_transfer_params": "disaggregated serving (encoder-cache transfer) is not part of "
                          "rlfleet workers",
    "vllm_xargs": "custom engine extensions (vllm_xargs) are not part of rlfleet workers",
    "repetition_detection": "repetition detection is not supported by rlfleet workers",
    "chat_template": "Chat template is passed with request, but rlfleet workers use the "
                     "model's own template (as vLLM without --trust-request-chat-template): "
                     "refused request with untrusted chat template",
    "media_io_kwargs": "multimodal inputs are not supported by rlfleet workers",
    "mm_processor_kwargs": "multimodal inputs are not supported by rlfleet workers",
}
# request fields that change nothing on these routes, in vLLM as here: accepted, no effect
NO_EFFECT = ("user", "length_penalty", "return_token_offsets", "mm_payload", "return_mm_kwargs",
             "include_reasoning", "parallel_tool_calls")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool | None = False  # usage so far on every chunk


class _Request(BaseModel):
    """What the completions and chat routes share: vLLM's request fields (read as vLLM
    reads them: numbers sent as numeric strings are accepted, unknown fields are ignored)
    plus nvext. Every vLLM field is either honoured with vLLM's meaning or, when set,
    refused by name (REFUSED)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the one model this frontend serves
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # {"<token_id>": bias}: added to that token's logit before sampling, clamped to ±100
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool | None = None  # None: the route's default
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None  # token_ids / prompt_token_ids beside the text
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    watermarking: bool | None = None
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None  # names the request when no X-Request-Id is sent
    session_id: str | None = None
    stream_interval: int | None = None
    thinking_token_budget: int | None = None
    # accepted, no effect (see NO_EFFECT)
    user: str | None = None
    length_penalty: float | None = 1.0
    return_token_offsets: bool | None = False
    mm_payload: str | None = None
    return_mm_kwargs: bool | None = None
    # refused when set (see REFUSED)
    use_beam_search: bool | None = False
    logprob_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    # vLLM: routed experts from this prompt position on (rlfleet: asking for them; see
    # routed_experts_start)
    routed_experts_prompt_start: Annotated[int, Field(ge=0)] = 0
    nvext: NvExt = Field(default_factory=NvExt)

    # fields vLLM wants as JSON numbers (numeric strings refused), checked on the raw body
    numbers_only: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)

    @model_validator(mode="before")
    @classmethod
    def _before(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        # vLLM's rules, checked on the raw body: stream_options only with stream; the
        # logprob counts as numbers (other numbers may come as numeric strings)
        if data.get("stream_options") and not data.get("stream"):
            raise ValueError("Stream options can only be defined when `stream=True`.")
        for name in cls.numbers_only:
            v = data.get(name)
            if v is not None and not isinstance(v, (int, float)):
                raise ValueError(f"`{name}` must be an integer.")
        return data

    @field_validator("request_id", "session_id")
    @classmethod
    def _ids(cls, v: str | None) -> str | None:
        if v is not None and not 0 < len(v) <= 256:
            raise ValueError("must be 1 to 256 characters")
        return v

    def refusals(self) -> None:
        """InvalidParam for the first field rlfleet refuses that is set (REFUSED), and for
        vLLM's own cross-field rules of these routes."""
        defaults = {"use_beam_search": False}
        for name, why in REFUSED.items():
            if name not in type(self).model_fields:
                continue
            v = getattr(self, name)
            if v in (None, defaults.get(name)) or v == {} or v == []:
                continue
            raise InvalidParam(why, name)
        if self.thinking_token_budget not in (None, -1):
            raise InvalidParam("thinking_token_budget is set but the workers run no reasoning "
                               "parser (vLLM: --reasoning-parser)", "thinking_token_budget")
        if self.stream and (self.prompt_logprobs or 0) != 0 \
                and not self.nvext.wants("prompt_logprobs"):
            # rlfleet's extension (docs/contract.md): streamed prompt logprobs come in the last
            # chunk's nvext when asked for there
            raise InvalidParam("`prompt_logprobs` are not available when `stream=True` (unless "
                               "nvext.extra_fields asks for \"prompt_logprobs\": they come in "
                               "the last chunk)", "prompt_logprobs")

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingOptions:
        """The engine's sampling options, as sent (their values are checked where the
        frontend builds the request: rlfleet.runtime.request_checks); InvalidParam: a
        logit_bias key that is not a token ID."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        bias = None
        if self.logit_bias:
            bias, bad = {}, []
            for k, b in self.logit_bias.items():
                try:
                    bias[int(k)] = b
                except ValueError:
                    bad.append(k)
            if bad:
                raise InvalidParam(f"logit_bias contains key(s) that cannot be converted to "
                                   f"integer token IDs: {bad[:8]!r}", "logit_bias")
        rf = self.response_format
        if rf is not None and rf.get("type") == "text":
            rf = None  # plain text: no constraint
        return SamplingOptions(
            n=self.n, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=bias, allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []), stream_interval=self.stream_interval,
            watermarking=self.watermarking, structured_outputs=self.structured_outputs,
            response_format=rf,
            **{k: v for k, v in given.items() if v is not None},
        )

    def request_options(self) -> dict[str, Any]:
        """GenerateRequest fields every prompt of this request shares."""
        return {"truncate_prompt_tokens": self.truncate_prompt_tokens,
                "truncation_side": self.truncation_side,
                "add_special_tokens": self.add_special_tokens, "stream": bool(self.stream),
                "cache_salt": self.cache_salt, "priority": self.priority,
                "session_id": self.session_id, "routed_experts_start": self.routed_experts_start}

    @property
    def routed_experts_start(self) -> int | None:
        """What the engine is asked for (GenerateRequest.routed_experts_start): asked by
        nvext.extra_fields "routed_experts" (Dynamo's name) or by vLLM's
        routed_experts_prompt_start; that field's value when sent, else -1 (one row per
        completion token)."""
        given = "routed_experts_prompt_start" in self.model_fields_set
        if not given and not self.nvext.wants("routed_experts"):
            return None
        return self.routed_experts_prompt_start if given else -1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


PromptIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(_Request):
    numbers_only: ClassVar[tuple[str, ...]] = ("prompt_logprobs", "logprobs")

    prompt: PromptIds | list[PromptIds] | str | list[str] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    prompt_embeds: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_max_tokens(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_tokens" in data and data["max_tokens"] is None:
            data = {**data, "max_tokens": 16}  # vLLM: null means the default
        return data

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.nvext.token_data is not None:
            return self
        p = self.prompt
        if p is None or p == "":
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        if isinstance(p, list):
            if not p:
                raise ValueError("You must pass at least one prompt")
            if not isinstance(p[0], int) and len(p) > MAX_PROMPTS:
                raise ValueError(f"prompt list length {len(p)} exceeds the maximum allowed count "
                                 f"of {MAX_PROMPTS}")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt of the request: a text, or token IDs."""
        if self.nvext.token_data is not None:
            return [self.nvext.token_data]
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p or [])  # type: ignore[arg-type]

    @property
    def engine_logprobs(self) -> int | None:
        """The logprobs the engine computes: the requested ones; asked for none, the
        sampled token's when nvext.engine_data is requested (it carries them)."""
        if self.logprobs is not None:
            return self.logprobs
        return 0 if self.nvext.wants("engine_data") else None

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """vLLM: echo computes prompt logprobs at the requested `logprobs` unless
        `prompt_logprobs` says otherwise."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs


class ChatMessage(BaseModel):
    """One message, passed to the chat template as sent (role and extra fields included);
    content parts must be text."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if isinstance(v, list):
            for part in v:
                if part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...})"
                                     " are supported: the served model is not multimodal")
        return v

    def text(self) -> str:
        """The content as one string (text parts joined as they are, as vLLM 0.32 renders
        them for a chat template that takes a string)."""
        c = self.content
        if isinstance(c, list):
            return "".join(p["text"] for p in c)
        return c or ""

    def plain(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=True)
        out["content"] = self.text()
        return out


class ChatCompletionRequest(_Request):
    numbers_only: ClassVar[tuple[str, ...]] = ("prompt_logprobs", "top_logprobs")

    messages: list[ChatMessage] = Field(default_factory=list)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    echo: bool = False  # prefix the reply with the last message when it has the reply's role
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None
    return_prompt_text: bool | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    chat_template: str | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if not self.messages and self.nvext.token_data is None:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at "
                             "least one message.")
        if self.top_logprobs not in (None, 0) and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.")
        return self

    def refusals(self) -> None:
        super().refusals()
        if self.tools == []:
            raise InvalidParam("`tools` must not be an empty array. Either provide at least one "
                               "tool or omit the field entirely.", "tools")
        choice = self.tool_choice
        if choice is None and self.tools:
            choice = "auto"  # vLLM's default with tools
        if choice not in (None, "none"):
            raise InvalidParam(f"tool_choice={choice!r} needs a tool-call parser, which rlfleet "
                               "workers do not run; send tool_choice \"none\" (the tools are "
                               "still rendered by the chat template)", "tool_choice")

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        """The logprobs the engine computes: the requested ones; asked for none, the
        sampled token's when nvext.engine_data is requested (it carries them)."""
        if self.logprobs:
            return self.top_logprobs or 0
        return 0 if self.nvext.wants("engine_data") else None

    @property
    def engine_prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is None and self.echo:
            return self.top_logprobs or 0
        return self.prompt_logprobs

    @property
    def reply_role(self) -> str:
        """The role of the reply (vLLM: the last message's role when no generation prompt
        is added)."""
        if self.add_generation_prompt or not self.messages:
            return "assistant"
        return self.messages[-1].role

    def template_kwargs(self) -> dict[str, Any] | None:
        """What the chat template gets besides the messages (vLLM's merge: the request's
        own fields win over chat_template_kwargs)."""
        kw = dict(self.chat_template_kwargs or {})
        if self.continue_final_message:
            kw["continue_final_message"] = True
        if self.documents is not None:
            kw["documents"] = self.documents
        if self.tools:
            kw["tools"] = self.tools
        if self.reasoning_effort is not None:
            kw["reasoning_effort"] = self.reasoning_effort
            kw.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kw or None


class InputTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None

    def messages(self) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = []
        if self.instructions:
            msgs.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            msgs.append({"role": "user", "content": self.input})
            return msgs
        for item in self.input:
            content = item.get("content", "")
            if isinstance(content, list):
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            msgs.append({"role": item.get("role", "user"), "content": str(content)})
        return msgs


# ------------------------------------------------------------------------ responses


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class NvExtResponse(Struct, kw_only=True):
    """The response's top-level "nvext": only the fields the request asked for."""

    completion_token_ids: list[int] | UnsetType = UNSET
    detailed_finish_reason: str | None | UnsetType = UNSET
    stop_reason: int | str | None | UnsetType = UNSET
    weight_versions: list[WeightSpan] | UnsetType = UNSET
    engine_data: dict[str, Any] | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | None | UnsetType = UNSET
    worker_id: dict[str, int | None] | UnsetType = UNSET
    timing: dict[str, float] | UnsetType = UNSET
    stale_policy: bool | UnsetType = UNSET  # the choice left the request's nvext.policy
    choices: list[NvExtResponse] | UnsetType = UNSET  # unary with n > 1: per choice


class CompletionLogprobs(Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET  # with return_token_ids
    prompt_token_ids: list[int] | UnsetType = UNSET  # with return_token_ids
    # asked for (routed_experts_start): vLLM's encoding, RoutedExperts.to_npy_b64; null
    # when the engine returns none
    routed_experts: str | None | UnsetType = UNSET


class CompletionResponse(Struct, kw_only=True):
    """A unary completion, and (with `usage` unset or set) each chunk of a stream."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | UnsetType = UNSET
    usage: Usage | UnsetType = UNSET
    nvext: NvExtResponse | UnsetType = UNSET


class ChatTopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(Struct, kw_only=True):
    content: list[ChatTokenLogprob]


class ChatMessageOut(Struct, kw_only=True):
    role: str = "assistant"
    content: str


class ChatChoice(Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET  # with return_token_ids
    routed_experts: str | None | UnsetType = UNSET  # as CompletionChoice's


class ChatCompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | UnsetType = UNSET
    usage: Usage
    prompt_logprobs: PromptLogprobs | None | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET  # with return_token_ids
    prompt_text: str | UnsetType = UNSET  # with return_prompt_text: the rendered prompt
    nvext: NvExtResponse | UnsetType = UNSET


class ChatDelta(Struct, kw_only=True):
    role: str | UnsetType = UNSET  # in each choice's first (role-only) chunk
    content: str


class ChatChunkChoice(Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None | UnsetType = UNSET  # on the choice's last chunk
    token_ids: list[int] | UnsetType = UNSET  # with return_token_ids
    routed_experts: str | None | UnsetType = UNSET  # on the choice's last chunk, when asked


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: str | UnsetType = UNSET
    usage: Usage | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET  # first chunk, with return_token_ids
    prompt_text: str | UnsetType = UNSET  # first chunk, with return_prompt_text
    nvext: NvExtResponse | UnsetType = UNSET


class ModelPermission(Struct, kw_only=True):
    id: str
    object: str = "model_permission"
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "rlfleet"
    root: str | None = None  # where the weights came from (the model path)
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = []


class ModelList(Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class InputTokens(Struct, kw_only=True):
    object: str = "response.input_tokens"
    input_tokens: int
