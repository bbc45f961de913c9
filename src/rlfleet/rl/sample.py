"""What the trainer asks for (a sample and its sampling parameters) and what it gets back
(an admitted sample, or the reason there is none)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters of one sample, in vLLM's terms. `prompt_logprobs=True` asks for
    the logprob of every prompt token (checked by `prompt_logprobs_unshifted`)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    prompt_logprobs: bool = False

    def openai_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature,
                               "top_p": self.top_p}
        if self.top_k is not None:
            out["top_k"] = self.top_k
        if self.seed is not None:
            out["seed"] = self.seed
        if self.min_tokens:
            out["min_tokens"] = self.min_tokens
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.prompt_logprobs:
            out["prompt_logprobs"] = 0
        return out

    def sglang_params(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_new_tokens": self.max_tokens, "temperature": self.temperature,
                               "top_p": self.top_p}
        if self.top_k is not None:
            out["top_k"] = self.top_k
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        if self.min_tokens:
            out["min_new_tokens"] = self.min_tokens
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out


@dataclass(frozen=True)
class SampleRequest:
    """One sample for `RolloutClient.rollout`."""

    sample_id: str
    prompt_ids: list[int]
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    n: int = 1


@dataclass(frozen=True)
class WeightSpan:
    """Generated positions [start, end) were produced by policy `version` / `digest`."""

    version: Any
    digest: Any
    start: int
    end: int


@dataclass(frozen=True)
class Completion:
    """One generated sequence. `token_attempts[i]` is the attempt that produced token i
    (all the same unless the sample was resumed after a partial attempt)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    token_attempts: list[int]
    weight_spans: list[WeightSpan] | None = None  # from nvext.weight_versions or per attempt


@dataclass(frozen=True)
class AdmittedSample:
    """A verified terminal result, admitted once in the ledger. Hand this to training."""

    sample_id: str
    attempt: int  # the attempt that was admitted
    request_id: str
    prompt_ids: list[int]
    completions: list[Completion]
    model: str
    weight_version: Any = None
    weight_digest: Any = None
    prompt_logprobs: list[float | None] | None = None  # position 0 is None
    worker_id: int | None = None

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
