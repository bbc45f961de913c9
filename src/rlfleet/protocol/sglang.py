"""Native SGLang `/generate`: the request schema (pydantic) and the response the frontend
renders (msgspec structs; UNSET fields are left out of the JSON)."""

from __future__ import annotations

from typing import Any

from msgspec import UNSET, Struct, UnsetType
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlfleet.protocol.engine import MAX_LOGPROBS, SamplingOptions, WeightSpan


class SglangSamplingParams(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    max_new_tokens: int | None = Field(128, ge=1)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    sampling_seed: int | None = None

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("sampling_params.n must be 1 on /generate; send one request per sample")
        return v


class SglangGenerateRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    input_ids: list[int]
    model: str | None = None
    sampling_params: SglangSamplingParams = Field(default_factory=SglangSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0, le=MAX_LOGPROBS)
    rid: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("input_ids")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("input_ids is empty: send at least one token ID")
        return v

    def sampling(self) -> SamplingOptions:
        sp = self.sampling_params
        stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        return SamplingOptions(
            temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
            seed=sp.sampling_seed, max_tokens=sp.max_new_tokens, min_tokens=sp.min_new_tokens,
            stop=stop, stop_token_ids=list(sp.stop_token_ids or []), ignore_eos=sp.ignore_eos,
            skip_special_tokens=sp.skip_special_tokens,
            presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty,
            logprobs=self.top_logprobs_num if self.return_logprob else None,
            prompt_logprobs=self.top_logprobs_num
            if self.return_logprob and self.logprob_start_len >= 0 else None,
        )


# ------------------------------------------------------------------------ responses

LogprobEntry = list[float | int | None]  # [logprob, token_id, decoded text: never sent (null)]


class MetaInfo(Struct, kw_only=True):
    id: str
    finish_reason: dict[str, Any] | None  # {"type": "length"|"stop"|"abort", ...}
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: Any = None
    weight_digest: str | None = None
    weight_versions: list[WeightSpan] | UnsetType = UNSET  # once finished
    output_token_logprobs: list[LogprobEntry] | UnsetType = UNSET
    output_top_logprobs: list[list[LogprobEntry]] | UnsetType = UNSET
    input_token_logprobs: list[LogprobEntry] | UnsetType = UNSET


class GenerateResponse(Struct, kw_only=True):
    """The whole output so far: the unary answer, and each event of a stream (SGLang
    streams cumulatively: the last event's output_ids is the whole completion)."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
