"""OpenAI-compatible schemas: requests (pydantic, with vLLM's sampling extensions and
nvext) and the responses the frontend renders (msgspec structs: fields set to UNSET are
left out of the JSON, every other field is always there, null included)."""

from __future__ import annotations

from typing import Any, Literal

from msgspec import UNSET, Struct, UnsetType
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlfleet.protocol.engine import (
    MAX_LOGPROBS,
    MAX_N,
    PromptLogprob,
    SamplingOptions,
    TokenizeRequest,
    WeightSpan,
)
from rlfleet.protocol.nvext import NvExt


class _Request(BaseModel):
    # strict: "5" is not an integer; unknown fields are ignored, as vLLM does
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    # {"<token_id>": bias}: added to that token's logit before sampling (OpenAI's range)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False
    nvext: NvExt = Field(default_factory=NvExt)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys are token IDs (\"123\"), not {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{key}] is {bias}; biases are in [-100, 100]")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None and (v == "" or (isinstance(v, list) and any(s == "" for s in v))):
            raise ValueError("stop strings must be non-empty")
        return v

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingOptions:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        return SamplingOptions(
            n=self.n, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): b for k, b in self.logit_bias.items()} if self.logit_bias else None,
            **{k: v for k, v in given.items() if v is not None},
        )

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[int] | None = None
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.prompt is None and self.nvext.token_data is None:
            raise ValueError("prompt is required (a string or a list of token IDs)")
        if self.prompt is not None and len(self.prompt) == 0 and self.nvext.token_data is None:
            raise ValueError("prompt is empty: send at least one character or token ID")
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported; use n")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if isinstance(v, list):
            for part in v:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) "
                                     "are supported")
        return v

    def plain(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p["text"] for p in content)
        out = self.model_dump(exclude_none=True)
        out["content"] = content or ""
        return out


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(default_factory=list)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if not self.messages and self.nvext.token_data is None:
            raise ValueError("messages is empty: send at least one message")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRouteRequest(BaseModel):
    """POST /tokenize (vLLM's route): the IDs the served model's tokenizer makes of `prompt`,
    or of `messages` rendered with its chat template."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str = Field(min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> TokenizeRouteRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt, messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty: send at least one message")
        return self

    def engine_request(self) -> TokenizeRequest:
        if self.prompt is not None:
            return TokenizeRequest(prompt=self.prompt)
        return TokenizeRequest(messages=[m.plain() for m in self.messages or ()],
                               add_generation_prompt=self.add_generation_prompt,
                               chat_template_kwargs=self.chat_template_kwargs)


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


class CompletionResponse(Struct, kw_only=True):
    """A unary completion, and (with `usage` unset or set) each chunk of a stream."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | UnsetType = UNSET
    nvext: NvExtResponse | UnsetType = UNSET


class ChatTopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
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


class ChatCompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None | UnsetType = UNSET
    nvext: NvExtResponse | UnsetType = UNSET


class ChatDelta(Struct, kw_only=True):
    role: str | UnsetType = UNSET  # in each choice's first chunk
    content: str


class ChatChunkChoice(Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | UnsetType = UNSET
    nvext: NvExtResponse | UnsetType = UNSET


class ModelCard(Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "rlfleet"


class ModelList(Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class InputTokens(Struct, kw_only=True):
    object: str = "response.input_tokens"
    input_tokens: int
