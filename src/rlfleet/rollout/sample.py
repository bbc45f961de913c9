"""What the trainer asks for (a prompt, a sample and its sampling parameters) and what it
gets back (an admitted sample, or the reason there is none).

A prompt is what the trainer has:
- token IDs (`list[int]`): sent as they are;
- text (`str`): the worker's tokenizer makes the IDs;
- chat messages (`list[dict]`, or `Chat` for template options): the worker renders them
  with the served model's chat template;
- `NextTurn`: an earlier admitted sample's prompt and completion tokens, verbatim, then new
  messages rendered by the worker's chat template (multi-turn).
Whatever the kind, the admitted sample's `prompt_ids` are the IDs the engine was prompted
with, as the engine reported them: nothing is tokenised on the trainer's side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from rlfleet.protocol.engine import RoutedExperts
from rlfleet.protocol.identity import UNKNOWN, PolicyIdentity, WeightSpan

#: bounds the frontend enforces (protocol/openai.py); refused here first, with the field named
__all__ = ["AdmittedSample", "Chat", "Completion", "NextTurn", "RolloutOutcome", "SampleFailed",
           "SampleRequest", "SamplingSpec"]

_PENALTY = (-2.0, 2.0)
_LOGIT_BIAS = (-100.0, 100.0)


def _number(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"SamplingSpec.{name} must be a number, not {value!r}")
    if value < low or value > high or (low_open and value == low):
        bound = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise ValueError(f"SamplingSpec.{name} is {value!r}; it must be in {bound}")


def _token_ids(name: str, ids: Any) -> tuple[int, ...]:
    ids = tuple(ids)
    bad = [t for t in ids if type(t) is not int or t < 0]
    if bad:
        raise ValueError(f"SamplingSpec.{name} must hold token IDs (non-negative integers); "
                         f"{bad[0]!r} is not one")
    return ids


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters of one sample, in vLLM's terms, each checked here and each
    honoured by the engine on both routes unless said otherwise:

    max_tokens, min_tokens: bounds on the generated tokens; temperature, top_p, top_k, min_p;
    seed: per-request sampling seed; stop: strings that end a completion (the completion
    ends with the tokens that completed the string); stop_token_ids; ignore_eos;
    presence_penalty, frequency_penalty (in [-2, 2]), repetition_penalty (> 0);
    logit_bias: {token_id: bias in [-100, 100]} added to the logits (OpenAI route only:
    the native SGLang route refuses it); prompt_logprobs=True asks for the logprob of every
    prompt token (checked by `prompt_logprobs_unshifted`); routed_experts=True asks a MoE
    engine (--enable-return-routed-experts) for the experts it routed each completion
    token to (OpenAI route only; `Completion.routed_experts`).

    The engine's logprobs are what it sampled from: with the workers' default
    `processed_logprobs`, after temperature, penalties and logit bias."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    prompt_logprobs: bool = False
    routed_experts: bool = False

    def __post_init__(self) -> None:
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise ValueError(f"SamplingSpec.max_tokens must be an integer >= 1, not {self.max_tokens!r}")
        if type(self.min_tokens) is not int or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"SamplingSpec.min_tokens is {self.min_tokens!r}; it must be an integer "
                             f"in [0, max_tokens={self.max_tokens}]")
        _number("temperature", self.temperature, 0.0, 100.0)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _number("min_p", self.min_p, 0.0, 1.0)
        if self.top_k is not None and (type(self.top_k) is not int or self.top_k < -1):
            raise ValueError(f"SamplingSpec.top_k must be an integer >= -1 (or None), not {self.top_k!r}")
        if self.seed is not None and (type(self.seed) is not int or not -2**63 <= self.seed < 2**63):
            raise ValueError(f"SamplingSpec.seed must be a 64-bit integer (or None), not {self.seed!r}")
        _number("presence_penalty", self.presence_penalty, *_PENALTY)
        _number("frequency_penalty", self.frequency_penalty, *_PENALTY)
        _number("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("SamplingSpec.stop must hold non-empty strings")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        if self.logit_bias is not None:
            bias = dict(self.logit_bias)
            _token_ids("logit_bias keys", bias)
            for t, b in bias.items():
                _number(f"logit_bias[{t}]", b, *_LOGIT_BIAS)
            object.__setattr__(self, "logit_bias", bias or None)

    def _shared_fields(self) -> dict[str, Any]:
        """The parameters both routes take, in vLLM's names and in order: the first three
        always, the others when set."""
        out: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": float(self.temperature),
                               "top_p": float(self.top_p)}
        if self.top_k is not None:
            out["top_k"] = self.top_k
        if self.min_p:
            out["min_p"] = float(self.min_p)
        if self.seed is not None:
            out["seed"] = self.seed
        if self.min_tokens:
            out["min_tokens"] = self.min_tokens
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            out["ignore_eos"] = True
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                out[name] = float(getattr(self, name))
        if self.repetition_penalty != 1.0:
            out["repetition_penalty"] = float(self.repetition_penalty)
        return out

    def openai_fields(self) -> dict[str, Any]:
        """The fields of an OpenAI completions or chat request (vLLM's names)."""
        out = self._shared_fields()
        if self.logit_bias:
            out["logit_bias"] = {str(t): float(b) for t, b in self.logit_bias.items()}
        if self.prompt_logprobs:
            out["prompt_logprobs"] = 0
        return out

    def sglang_params(self) -> dict[str, Any]:
        """`sampling_params` of a native SGLang /generate request."""
        if self.logit_bias:
            raise ValueError("logit_bias is sent on the OpenAI route only: use route='openai'")
        if self.routed_experts:
            raise ValueError("routed experts are asked for on the OpenAI route only: use "
                             "route='openai'")
        return {_SGLANG_NAMES.get(k, k): v for k, v in self._shared_fields().items()}


#: SGLang's names for the sampling parameters whose vLLM names differ
_SGLANG_NAMES = {"max_tokens": "max_new_tokens", "seed": "sampling_seed",
                 "min_tokens": "min_new_tokens"}


@dataclass(frozen=True)
class Chat:
    """Chat messages ({"role", "content"}, content a string or text parts), rendered by the
    worker with the served model's chat template; `chat_template_kwargs` go to the template
    (e.g. {"enable_thinking": False})."""

    messages: list[dict[str, Any]]
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.messages, list) or not self.messages:
            raise ValueError("Chat.messages must be a non-empty list of messages")
        _check_messages(self.messages)


def _check_messages(messages: list[Any]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a string 'role' (and 'content')")


@dataclass(frozen=True)
class NextTurn:
    """Continue an earlier admitted sample (multi-turn): its prompt IDs and the tokens of
    its completion `completion` exactly as the engine produced them, then the turn-closing
    tokens its chat template puts after an assistant message (those the completion does not
    already end with), then `messages` rendered by the worker's chat template (with the
    generation prompt)."""

    earlier: AdmittedSample
    messages: list[dict[str, Any]]
    completion: int = 0
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.messages, list) or not self.messages:
            raise ValueError("NextTurn.messages must be a non-empty list of messages")
        _check_messages(self.messages)
        if not 0 <= self.completion < len(self.earlier.completions):
            raise ValueError(f"the earlier sample has {len(self.earlier.completions)} "
                             f"completion(s); there is no completion {self.completion}")


#: token IDs | text | chat messages | Chat | NextTurn
Prompt: TypeAlias = "list[int] | str | list[dict[str, Any]] | Chat | NextTurn"


def prompt_kind(prompt: Any) -> str:
    """"ids", "text", "chat" or "next_turn"; ValueError for anything else."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty: send at least one character")
        return "text"
    if isinstance(prompt, Chat):
        return "chat"
    if isinstance(prompt, NextTurn):
        return "next_turn"
    if isinstance(prompt, list | tuple) and prompt:
        if all(type(t) is int and t >= 0 for t in prompt):
            return "ids"
        if all(isinstance(m, dict) for m in prompt):
            _check_messages(list(prompt))
            return "chat"
    raise ValueError("a prompt is a non-empty list of token IDs, a string, a list of chat "
                     "messages, a Chat or a NextTurn")


@dataclass(frozen=True)
class SampleRequest:
    """One sample for `RolloutClient.rollout` / `Fleet.rollout`; `prompt` as in the module
    doc."""

    sample_id: str
    prompt: Any  # Prompt
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    n: int = 1


@dataclass(frozen=True)
class Completion:
    """One generated sequence. `token_attempts[i]` is the attempt that produced token i
    (all the same unless the sample was resumed after a partial attempt)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    token_attempts: list[int]
    weight_spans: list[WeightSpan] | None = None  # from nvext.weight_versions or per attempt
    # with SamplingSpec.routed_experts: one row per token of `token_ids` (row i: the experts
    # of the forward pass that produced token i, at position len(prompt_ids) - 1 + i);
    # None when the engine returned none (not a MoE engine, or not started to)
    routed_experts: RoutedExperts | None = None


@dataclass(frozen=True)
class AdmittedSample:
    """A verified terminal result, admitted once in the ledger. Hand this to training."""

    sample_id: str
    attempt: int  # the attempt that was admitted
    request_id: str
    prompt_ids: list[int]
    completions: list[Completion]
    model: str
    policy: PolicyIdentity = UNKNOWN  # the policy the worker reported
    prompt_logprobs: list[float | None] | None = None  # position 0 is None
    worker_id: int | None = None
    # a NextTurn sample: the earlier turns' completion experts, kept from their samples
    # (each one's `start` is its position in prompt_ids; the engine is not asked again for
    # what its prefix cache may not recompute)
    prompt_routed_experts: tuple[RoutedExperts, ...] = ()

    @property
    def completion(self) -> Completion:
        return self.completions[0]


class SampleFailed(Exception):
    """No attempt of the sample was admitted. `reason` is the last attempt's reason,
    `reasons` one per attempt (in order); the ledger has the full record."""

    def __init__(self, sample_id: str, reason: str, reasons: list[str]) -> None:
        super().__init__(f"sample {sample_id!r} failed after {len(reasons)} attempt(s): {reason}")
        self.sample_id, self.reason, self.reasons = sample_id, reason, reasons


@dataclass(frozen=True)
class RolloutOutcome:
    """One sample's end in a batch: admitted (`sample`) or not (`error`, with a reason)."""

    sample_id: str
    sample: AdmittedSample | None = None
    error: Exception | None = None

    @property
    def admitted(self) -> bool:
        return self.sample is not None

    @property
    def reason(self) -> str | None:
        if self.error is None:
            return None
        return getattr(self.error, "reason", None) or f"{type(self.error).__name__}: {self.error}"
