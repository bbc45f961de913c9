"""vLLM's own serving routes, beside its OpenAI ones: the token-in/token-out generate route
and tokenize / detokenize. Requests are pydantic models read as vLLM reads them (unknown
fields ignored, numbers as numeric strings accepted); every field vLLM takes is either
honoured with vLLM's meaning or, when set, refused by name (`refusals`). Responses are
msgspec Structs with every field vLLM sends (null included).

Schemas, as vLLM 0.32 defines them:
- POST /inference/v1/generate: vllm/entrypoints/scale_out/token_in_token_out/protocol.py
  (GenerateRequest, GenerateTokensResponse / GenerateTextResponse and their stream chunks),
  the sampling parameters of vllm/sampling_params.py (SamplingParams), usage of
  vllm/entrypoints/serve/engine/protocol.py (UsageInfo);
- POST /tokenize, /detokenize: vllm/entrypoints/serve/tokenize/protocol.py
  (TokenizeCompletionRequest | TokenizeChatRequest, TokenizeResponse, DetokenizeRequest,
  DetokenizeResponse)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Struct, UnsetType
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlfleet.protocol.engine import (
    InvalidParam,
    PromptLogprob,
    SamplingOptions,
    TokenizeRequest,
)
from rlfleet.protocol.nvext import NvExt
from rlfleet.protocol.openai import REFUSED, ChatMessage

# --------------------------------------------------------------------------- generate

# sampling_params fields rlfleet refuses when set (anything but None, or the value given
# here): why, in the user's words
SAMPLING_REFUSED: dict[str, str] = {
    "prompt_logprob_token_ids": "scoring chosen prompt token IDs is not supported by rlfleet "
                                "workers; use sampling_params.prompt_logprobs",
    "prompt_logprob_start": "prompt_logprob_start goes with prompt_logprob_token_ids, which "
                            "rlfleet workers do not support",
    "logprob_token_ids": REFUSED["logprob_token_ids"],
    "extra_args": "custom sampling extensions (sampling_params.extra_args) are not part of "
                  "rlfleet workers",
    "repetition_detection": REFUSED["repetition_detection"],
    "trace_decode_token_ids": "forced decoding (trace_decode_token_ids) is not supported by "
                              "rlfleet workers",
}
# request fields rlfleet refuses when set
GENERATE_REFUSED: dict[str, str] = {
    "features": "multimodal inputs are not supported by rlfleet workers",
    "content_parts": "multimodal inputs are not supported by rlfleet workers",
    "kv_transfer_params": REFUSED["kv_transfer_params"],
    "ec_transfer_params": REFUSED["ec_transfer_params"],
}


class SamplingParamsIn(BaseModel):
    """`sampling_params`, every public field of vLLM's SamplingParams (fields vLLM computes
    itself, such as `output_kind` and `output_text_buffer_length`, are accepted and set by
    the server, as vLLM does)."""

    model_config = ConfigDict(extra="ignore")

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    watermarking: bool | None = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # when not sent: the room the prompt leaves (vLLM's server)
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream_interval: int | None = None
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    thinking_token_budget: int | None = None
    # routed experts (MoE) from this prompt position on; sent: the engine is asked for them
    routed_experts_prompt_start: int = 0
    # accepted, no effect on what is returned (vLLM's server sets or ignores them too)
    output_kind: int = 0
    output_text_buffer_length: int = 0
    skip_clone: bool = False
    flat_logprobs: bool = False
    skip_reading_prefix_cache: bool | None = None
    # refused when set (SAMPLING_REFUSED)
    prompt_logprob_token_ids: list[list[int]] | None = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    trace_decode_token_ids: list[int] | None = None

    def refusals(self) -> None:
        for name, why in SAMPLING_REFUSED.items():
            if getattr(self, name) not in (None, {}, []):
                raise InvalidParam(why, f"sampling_params.{name}")
        if self.thinking_token_budget not in (None, -1):
            raise InvalidParam("thinking_token_budget is set but the workers run no reasoning "
                               "parser (vLLM: --reasoning-parser)",
                               "sampling_params.thinking_token_budget")
        if self.stop and not self.detokenize:
            raise InvalidParam("stop strings are only supported when detokenize is True. Set "
                               "detokenize=True to use stop.", "sampling_params.stop")

    def engine(self, stream: bool) -> SamplingOptions:
        """The engine's sampling options, as sent (their values are checked where the
        frontend builds the request: rlfleet.runtime.request_checks).
        `max_tokens` not sent: None, the room the prompt leaves."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        given = "max_tokens" in self.model_fields_set
        return SamplingOptions(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, max_tokens=self.max_tokens if given else None,
            min_tokens=self.min_tokens, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, logprobs=self.logprobs,
            # the stream schema carries no prompt logprobs: not computed for a stream
            prompt_logprobs=None if stream else self.prompt_logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids, bad_words=list(self.bad_words or []),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            stream_interval=self.stream_interval, watermarking=self.watermarking,
            structured_outputs=self.structured_outputs)

    @property
    def routed_experts_start(self) -> int | None:
        """GenerateRequest.routed_experts_start: asked for when the field is sent."""
        if "routed_experts_prompt_start" not in self.model_fields_set:
            return None
        if self.routed_experts_prompt_start < 0:
            raise InvalidParam("routed_experts_prompt_start must be at least 0, got "
                               f"{self.routed_experts_prompt_start}",
                               "sampling_params.routed_experts_prompt_start")
        return self.routed_experts_prompt_start


class StreamOptionsIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = False  # a last chunk with the whole request's usage
    continuous_usage_stats: bool | None = False  # with include_usage: usage on every chunk


class TokensGenerateRequest(BaseModel):
    """POST /inference/v1/generate: token IDs in, token IDs (and logprobs) out. `nvext`
    (rlfleet's extension, ignored by vLLM) takes a staleness bound (`policy`) and
    `extra_fields`, answered in a top-level `nvext`."""

    model_config = ConfigDict(extra="ignore")

    request_id: str | None = None  # None: a new one (vLLM: a random UUID)
    token_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingParamsIn
    model: str | None = None
    token_offsets: list[tuple[int, int]] | None = None  # what /render computed; not used
    reasoning_ended: bool | None = None  # without a reasoning parser: no effect
    reasoning_parser_kwargs: dict[str, Any] | None = None  # likewise
    return_token_ids: bool | None = None  # prompt_token_ids in the response
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool | None = False
    stream_options: StreamOptionsIn | None = None
    cache_salt: str | None = None
    priority: int = 0
    # refused when set (GENERATE_REFUSED)
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    nvext: NvExt = Field(default_factory=NvExt)

    @field_validator("token_ids")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v

    @field_validator("request_id")
    @classmethod
    def _rid(cls, v: str | None) -> str | None:
        if v is not None and not 0 < len(v) <= 256:
            raise ValueError("must be 1 to 256 characters")
        return v

    @model_validator(mode="after")
    def _check(self) -> TokensGenerateRequest:
        if self.output_mode != "tokens" and not self.sampling_params.detokenize:
            raise ValueError(f"output_mode={self.output_mode!r} requires "
                             "sampling_params.detokenize to be true")
        return self

    def refusals(self) -> None:
        for name, why in GENERATE_REFUSED.items():
            if getattr(self, name) not in (None, {}, []):
                raise InvalidParam(why, name)
        self.sampling_params.refusals()

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)  # type: ignore[union-attr]

    @property
    def prompt_logprobs(self) -> int | None:  # what nvext's prompt_logprobs field reads
        return self.sampling_params.prompt_logprobs


class UsageInfo(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    completion_tokens_details: dict[str, int] | None = None


class GenerateLogProb(Struct, kw_only=True):
    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(Struct, kw_only=True):
    """The sampled token at one position, then (`top_logprobs`) the sampled token and the
    most likely others, vLLM's order."""

    token_id: int
    logprob: float
    rank: int | None = None
    top_logprobs: list[GenerateLogProb] = []


class GenerateLogProbs(Struct, kw_only=True):
    content: list[GenerateLogProbsContent] | None = None


class TextLogProb(Struct, kw_only=True):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class TextLogProbsContent(Struct, kw_only=True):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None
    top_logprobs: list[TextLogProb] = []


class TextLogProbs(Struct, kw_only=True):
    content: list[TextLogProbsContent] | None = None


class WeightVersion(Struct, kw_only=True, omit_defaults=True):
    """vLLM's WeightVersionSpan (output tokens [start, end) sampled by weights labelled
    `version`), plus rlfleet's digest and step of that policy."""

    version: str
    start: int
    end: int
    digest: str | None = None
    step: int | None = None
    adapter: str | None = None


class GenerateChoice(Struct, kw_only=True):
    """A choice of a unary response, or of a stream chunk; `text` only with output_mode
    "text" (logprobs are then TextLogProbs)."""

    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[WeightVersion] | None = None
    text: str | UnsetType = UNSET
    logprobs: GenerateLogProbs | TextLogProbs | None = None


class TokensGenerateResponse(Struct, kw_only=True):
    request_id: str
    model: str | None = None
    created: int | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_id_logprobs: str | None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    output_mode: str = "tokens"
    choices: list[GenerateChoice]
    nvext: Any = UNSET  # rlfleet: what the request's nvext.extra_fields asked for


class TokensGenerateChunk(Struct, kw_only=True):
    """One stream chunk (vLLM leaves prompt_token_ids out unless it is sent, on the first
    chunk with return_token_ids; usage is null unless continuous usage was asked for)."""

    request_id: str
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET
    output_mode: str = "tokens"
    choices: list[GenerateChoice]
    nvext: Any = UNSET


# --------------------------------------------------------------------------- tokenize

class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class Tool(BaseModel):
    """A tool the chat template is given, as vLLM hands it over: type, function (name,
    description, parameters; strict and defer_loading when set), defer_loading when set."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: ToolFunction
    defer_loading: bool | None = None

    def for_template(self) -> dict[str, Any]:
        f = self.function
        fn: dict[str, Any] = {"name": f.name, "description": f.description,
                              "parameters": f.parameters}
        if f.strict is not None:
            fn["strict"] = f.strict
        defer = f.defer_loading if f.defer_loading is not None else self.defer_loading
        if defer is not None:
            fn["defer_loading"] = defer
        out: dict[str, Any] = {"type": self.type, "function": fn}
        if self.defer_loading is not None:
            out["defer_loading"] = self.defer_loading
        return out


# chat fields rlfleet refuses when set
TOKENIZE_REFUSED: dict[str, str] = {
    "chat_template": REFUSED["chat_template"],
    "media_io_kwargs": REFUSED["media_io_kwargs"],
    "mm_processor_kwargs": REFUSED["mm_processor_kwargs"],
}


class TokenizeRouteRequest(BaseModel):
    """POST /tokenize, both of vLLM's forms: a text `prompt` (special tokens added unless
    add_special_tokens is false), or chat `messages` rendered by the model's chat template
    (with the tools, and the generation prompt unless add_generation_prompt is false; no
    special tokens on top unless add_special_tokens is true)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the one model served
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    return_token_strs: bool | None = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    # refused when set (TOKENIZE_REFUSED)
    chat_template: str | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _before(cls, data: Any) -> Any:
        # vLLM checks it on any body, the text form's too
        if isinstance(data, dict) \
                and data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise ValueError("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.")
        return data

    @model_validator(mode="after")
    def _check(self) -> TokenizeRouteRequest:
        if self.prompt is None and self.messages is None:
            raise ValueError("give prompt (a text) or messages (a chat)")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty: send at least one message")
        return self

    @property
    def chat(self) -> bool:
        """vLLM's chat form: `messages` given (it wins over `prompt`)."""
        return self.messages is not None

    def refusals(self) -> None:
        if not self.chat:
            return
        for name, why in TOKENIZE_REFUSED.items():
            if getattr(self, name) not in (None, {}, []):
                raise InvalidParam(why, name)

    def engine_request(self) -> TokenizeRequest:
        strs = bool(self.return_token_strs)
        if not self.chat:
            return TokenizeRequest(prompt=self.prompt,
                                   add_special_tokens=self.add_special_tokens is not False,
                                   return_token_strs=strs)
        # vLLM's merge: the request's own fields win over chat_template_kwargs
        kw = dict(self.chat_template_kwargs or {})
        kw["add_generation_prompt"] = self.add_generation_prompt
        kw["continue_final_message"] = self.continue_final_message
        if self.tools is not None:
            kw["tools"] = [t.for_template() for t in self.tools]
        return TokenizeRequest(messages=[m.plain() for m in self.messages or ()],
                               add_generation_prompt=self.add_generation_prompt,
                               chat_template_kwargs=kw,
                               add_special_tokens=bool(self.add_special_tokens),
                               return_token_strs=strs)


class TokenizeRouteResponse(Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


TokenId = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]


class DetokenizeRouteRequest(BaseModel):
    """POST /detokenize: the text a worker of the model decodes these token IDs to (its
    tokenizer, special tokens kept)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeRouteResponse(Struct, kw_only=True):
    prompt: str
