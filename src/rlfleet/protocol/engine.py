"""The internal request plane between the frontend and a worker.

The frontend turns OpenAI / SGLang requests into one `GenerateRequest`, POSTs it to the
worker's `/generate`, and reads back newline-delimited JSON events (`EngineEvent`).
Tokenisation and detokenisation happen on the worker, with the tokenizer of the model
it serves (token authority): the frontend never tokenises.

Event stream of one request (one JSON object per line):
  1. {"prompt_token_ids": [...], "weight_version": ..., "weight_digest": ...}   always first
     (with echo, also "prompt_text" and "prompt_token_strs", one string per prompt token)
  2. {"choices": [ChoiceDelta, ...]}                                               zero or more
  3. {"done": true, "prompt_logprobs": [...] | null}                               always last
  or, at any point, {"error": {"message", "type", "code"}} which ends the stream.
With `stream=false` the worker sends the same three kinds, with all tokens of every
choice in one `choices` event.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 64
MAX_LOGPROBS = 20


class SamplingOptions(BaseModel):
    """Sampling parameters, in vLLM's terms."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: disabled
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    max_tokens: int | None = Field(None, ge=1)  # None: up to the context length
    min_tokens: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # 0: the sampled token only
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[int, float] | None = None  # token ID -> bias in [-100, 100]
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @model_validator(mode="after")
    def _check(self) -> SamplingOptions:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in (self.logit_bias or {}).items()):
            raise ValueError("logit_bias maps token IDs (>= 0) to biases in [-100, 100]")
        return self


class GenerateRequest(BaseModel):
    """One generation request. Exactly one of prompt, prompt_token_ids, messages."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=256)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    sampling: SamplingOptions = Field(default_factory=SamplingOptions)
    stream: bool = True
    echo: bool = False  # the first event also carries prompt_text and prompt_token_strs

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids, messages")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty: send at least one character or token ID")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt is empty: send at least one token ID")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty: send at least one message")
        return self


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenLogprob(BaseModel):
    """Logprob of one generated (or prompt) token, with the top alternatives."""

    token_id: int
    logprob: float
    rank: int | None = None
    decoded: str = ""
    # top alternatives, best first: [token_id, logprob, decoded]
    top: list[tuple[int, float, str]] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "abort"]


class ChoiceDelta(BaseModel):
    index: int
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None  # 1:1 with token_ids when requested
    finish_reason: FinishReason | None = None
    # the stop string or stop token ID that ended the choice; None for EOS or length
    stop_reason: int | str | None = None
    # with the final delta: half-open spans of output tokens generated under each weight
    # version, [{"version", "digest", "start", "end"}]
    weight_versions: list[dict] | None = None


class EngineError(BaseModel):
    message: str
    type: str = "internal_error"
    code: int = 500


def detailed_finish_reason(finish_reason: str | None, stop_reason: int | str | None) -> str | None:
    """Map the engine's finish reason to nvext's detailed_finish_reason."""
    if finish_reason is None:
        return None
    if finish_reason == "stop":
        return "eos" if stop_reason is None else "stop"
    if finish_reason == "abort":
        return "cancelled"
    return finish_reason  # length, content_filter
