"""SGLang's native API, as SGLang 0.5 speaks it: the `/generate` request (pydantic) and the
answers the frontend renders (msgspec structs; UNSET fields are left out of the JSON).

Schemas followed (sgl-project/sglang, python/sglang/srt/):
- `managers/io_struct.py` `GenerateReqInput`: the request's fields. Each one is accepted:
  honoured, or refused by name with a 400 when this fleet cannot honour it (`REFUSED`);
  a name SGLang does not know is ignored, as SGLang's request dataclass ignores it.
- `sampling/sampling_params.py` `SamplingParams`: `sampling_params`. A name it does not
  know is refused (SGLang's constructor refuses it); a null value means the default.
- `managers/tokenizer_manager.py` (`_handle_batch_output`, `add_logprob_to_meta_info`):
  `meta_info` and its logprob entries `[logprob, token_id, text | null]`.
- `managers/schedule_batch.py` (`FINISH_*`.to_json): the finish reason's shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from msgspec import UNSET, Struct, UnsetType
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from rlfleet.protocol.engine import MAX_LOGPROBS, SamplingOptions, WeightSpan
from rlfleet.protocol.nvext import PolicyBound
from rlfleet.protocol.openai import MAX_PROMPTS

#: sampling_params SGLang takes as null for "the default" (its __post_init__)
_NULL_IS_DEFAULT = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                    "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
                    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                    "no_stop_trim")


class SglangSamplingParams(BaseModel):
    """SGLang's `SamplingParams`: every name it takes is accepted here, and each is honoured
    or refused by name; a name it does not take is refused, as SGLang refuses it."""

    model_config = ConfigDict(strict=True, extra="forbid")

    max_new_tokens: int | None = Field(128, ge=1)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # refused: the engine stops on strings only
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the text
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    sampling_seed: int | None = None
    json_schema: str | None = None  # structured output: one of json_schema, regex, ebnf
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None  # token ID (a string) -> bias
    stream_interval: int | None = Field(None, ge=1)
    custom_params: dict[str, Any] | None = None  # refused: for a custom logit processor

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in _NULL_IS_DEFAULT)}
        return data

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("sampling_params.n must be 1 on /generate; send one request per sample")
        return v

    @field_validator("stop_regex")
    @classmethod
    def _stop_regex(cls, v: Any) -> Any:
        if v:
            raise ValueError("stop_regex is not supported by this fleet's engines (they stop on "
                             "strings and token IDs): use stop or stop_token_ids")
        return v

    @field_validator("custom_params")
    @classmethod
    def _custom_params(cls, v: Any) -> Any:
        if v:
            raise ValueError("custom_params go to a custom logit processor, which this fleet "
                             "does not run: leave it out")
        return v

    def structured_outputs(self) -> dict[str, Any] | None:
        """json_schema / regex / ebnf / structural_tag, as the engine's structured outputs."""
        grammars = [k for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None]
        if len(grammars) > 1:
            raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
        out: dict[str, Any] = {}
        if self.json_schema is not None:
            try:
                out["json"] = json.loads(self.json_schema)
            except ValueError as e:
                raise ValueError(f"sampling_params.json_schema is not valid JSON: {e}") from None
        if self.regex is not None:
            out["regex"] = self.regex
        if self.ebnf is not None:
            out["grammar"] = self.ebnf
        if self.structural_tag is not None:
            out["structural_tag"] = self.structural_tag
        return out or None

    def bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        out = {}
        for k, v in self.logit_bias.items():
            try:
                out[int(k)] = v
            except ValueError:
                raise ValueError(f"sampling_params.logit_bias: key {k!r} is not a token ID"
                                 ) from None
        return out


#: GenerateReqInput fields this fleet cannot honour: set to anything but their default,
#: they are refused by name (400) with the reason
_MULTIMODAL = "multimodal input is not served by this fleet (text and token IDs only)"
_PD = "prefill/decode disaggregation is not how this fleet serves; send the request whole"
REFUSED: dict[str, str] = {
    "input_embeds": "embeddings as input are not served: send text or input_ids",
    **{k: _MULTIMODAL for k in (
        "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
        "modalities", "use_audio_in_video", "video_config", "positional_embed_overrides",
        "images_config", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
        "video_max_dynamic_patch", "need_wait_for_mm_inputs", "num_items_assigned",
        "encoder_urls")},
    **{k: _PD for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room",
                        "bootstrap_pair_key", "decode_tp_size", "disagg_prefill_dp_rank")},
    "token_ids_logprob": "logprobs of chosen token IDs are not returned by this fleet's "
                         "engines: use top_logprobs_num",
    "return_sampling_mask": "the sampling mask is not returned by this fleet's engines",
    "return_flat_raw_top_logprobs": "flat top-logprob arrays are not rendered: use the "
                                    "nested input_top_logprobs",
    "return_flat_raw_top_logprobs_b64": "flat top-logprob arrays are not rendered",
    "return_hidden_states": "hidden states are not returned by this fleet's engines",
    "return_routed_experts": "routed experts are returned on the OpenAI routes only "
                             "(nvext.extra_fields routed_experts)",
    "routed_experts_start_len": "routed experts are returned on the OpenAI routes only",
    "return_indexer_topk": "indexer top-k is not returned by this fleet's engines",
    "return_entropy": "entropy is not returned by this fleet's engines",
    "return_prompt_token_ids": "not rendered: the prompt's IDs are what you sent, or "
                               "POST /tokenize for text",
    "return_bytes": "image generation is not served",
    "session_params": "SGLang sessions are not kept by this fleet: send the whole prompt",
    "custom_logit_processor": "custom logit processors are not run by this fleet",
    "lora_id": "internal to SGLang: name the adapter with lora_path (or model)",
    "routed_dp_rank": "this fleet routes by worker, not by data-parallel rank",
    "data_parallel_rank": "this fleet routes by worker, not by data-parallel rank",
    "priority": "this fleet's engines do not schedule by SGLang priority",
    "extra_key": "use cache_salt to keep a request's prefix cache apart",
    "require_reasoning": "reasoning is not enforced by this fleet",
    "max_thinking_tokens": "a thinking budget is not enforced by this fleet",
    "background": "background requests belong to the Responses API",
    "multi_item_delimiter_indices": "multi-item scoring is not served",
}
#: GenerateReqInput fields that change nothing in the answer (logging, tracing and
#: routing hints): accepted and ignored, as a single SGLang server without those
#: features ignores them
IGNORED = ("log_metrics", "no_logs", "custom_labels", "conversation_id", "routing_key",
           "kv_router_hint", "external_trace_header", "received_time", "http_worker_ipc")


def _is_set(v: Any) -> bool:
    return v not in (None, False, 0, "", [], {})


@dataclass(frozen=True)
class Item:
    """One prompt of a /generate request, with its own options."""

    input_ids: list[int] | None
    text: str | None
    sampling: SglangSamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    cache_salt: str | None


class SglangGenerateRequest(BaseModel):
    """SGLang's `GenerateReqInput`: one prompt (`text` a string, `input_ids` a list of
    IDs) or a batch (a list of strings, a list of ID lists), with per-prompt options given
    once or as a list. rlfleet adds `model` (which model, when the frontend serves several)
    and `policy` (a staleness bound, as nvext.policy)."""

    model_config = ConfigDict(strict=True, extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    model: str | None = None
    sampling_params: SglangSamplingParams | list[SglangSamplingParams] = Field(
        default_factory=SglangSamplingParams)
    stream: bool = False
    return_logprob: bool | list[bool] | None = False
    logprob_start_len: int | list[int] | None = -1
    top_logprobs_num: int | list[int] | None = 0
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    session_id: str | None = Field(None, min_length=1, max_length=256)
    cache_salt: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None  # the LoRA adapter, by its served name
    policy: PolicyBound | None = None  # rlfleet: a staleness bound (as nvext.policy)
    _items: list[Item] | None = PrivateAttr(None)  # items(), made once

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("sampling_params", 0) is None:
            data = {**data}
            del data["sampling_params"]
        return data

    @field_validator("input_ids")
    @classmethod
    def _ids(cls, v: list | None) -> list | None:
        if v is not None and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("input_ids is empty: send at least one token ID")
        return v

    @field_validator("text")
    @classmethod
    def _text(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and not v:
            raise ValueError("text is an empty batch: send at least one prompt")
        return v

    @field_validator("rid")
    @classmethod
    def _rid(cls, v: str | list[str] | None) -> str | list[str] | None:
        for r in [v] if isinstance(v, str) else v or []:
            if not 0 < len(r) <= 256:
                raise ValueError("each rid must be 1 to 256 characters")
        if isinstance(v, list) and len(set(v)) != len(v):
            dup = sorted({r for r in v if v.count(r) > 1})
            raise ValueError(f"Duplicate request IDs detected within the request: {dup}")
        return v

    @model_validator(mode="after")
    def _check(self) -> SglangGenerateRequest:
        if self.text is None and self.input_ids is None:
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        for name, value in (self.model_extra or {}).items():
            if name in REFUSED and _is_set(value):
                raise ValueError(f"{name}: {REFUSED[name]}")
        n = self.batch_size
        if n > MAX_PROMPTS:
            raise ValueError(f"a batch of {n} prompts: this frontend takes at most "
                             f"{MAX_PROMPTS} per request; split the batch")
        for name in ("sampling_params", "return_logprob", "logprob_start_len",
                     "top_logprobs_num", "rid", "cache_salt", "lora_path"):
            v = getattr(self, name)
            if isinstance(v, list) and (self.is_single or len(v) != n):
                raise ValueError(f"{name} is a list of {len(v)}: give one value, or (for a "
                                 f"batch) one per prompt ({n})" if not self.is_single else
                                 f"{name} is a list, for a single prompt: give one value")
        for top in self._each(self.top_logprobs_num):
            if top is not None and not 0 <= top <= MAX_LOGPROBS:
                raise ValueError(f"top_logprobs_num must be 0 to {MAX_LOGPROBS}, got {top}")
        adapters = {a for a in self._each(self.lora_path) if a is not None}
        if len(adapters) > 1:
            raise ValueError("lora_path names several adapters: this frontend serves one "
                             "model or adapter per request; send one request per adapter")
        return self

    # ---------------------------------------------------------------- the prompts

    @property
    def is_single(self) -> bool:
        if self.input_ids is not None:
            return not isinstance(self.input_ids[0], list)
        return isinstance(self.text, str)

    @property
    def batch_size(self) -> int:
        if self.is_single:
            return 1
        return len(self.input_ids if self.input_ids is not None else self.text)  # type: ignore[arg-type]

    def _each(self, v: Any) -> list:
        return list(v) if isinstance(v, list) else [v] * self.batch_size

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter `lora_path` names (SGLang's adapter name), if any."""
        return next((a for a in self._each(self.lora_path) if a is not None), None)

    def items(self) -> list[Item]:
        """Each prompt with its options (input_ids win over text, as in SGLang's tokenizer
        manager)."""
        if self._items is not None:
            return self._items
        n = self.batch_size
        ids = [self.input_ids] if self.is_single and self.input_ids is not None else \
            self.input_ids or [None] * n
        texts = [self.text] if isinstance(self.text, str) else self.text or [None] * n
        out = []
        for i, (sp, lp, start, top, salt) in enumerate(zip(
                self._each(self.sampling_params), self._each(self.return_logprob),
                self._each(self.logprob_start_len), self._each(self.top_logprobs_num),
                self._each(self.cache_salt), strict=True)):
            p = ids[i] if i < len(ids) else None
            out.append(Item(input_ids=p,  # type: ignore[arg-type]
                            text=None if p is not None else texts[i],
                            sampling=sp, return_logprob=bool(lp),
                            logprob_start_len=-1 if start is None else start,
                            top_logprobs_num=top or 0, cache_salt=salt or None))
        self._items = out
        return out

    def item(self, index: int = 0) -> Item:
        return self.items()[index]

    def sampling(self, index: int = 0) -> SamplingOptions:
        """The engine's sampling options for prompt `index`."""
        it = self.item(index)
        sp = it.sampling
        stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        top = it.top_logprobs_num
        return SamplingOptions(
            temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
            seed=sp.sampling_seed, max_tokens=sp.max_new_tokens, min_tokens=sp.min_new_tokens,
            stop=stop, stop_token_ids=list(sp.stop_token_ids or []), ignore_eos=sp.ignore_eos,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
            include_stop_str_in_output=sp.no_stop_trim,
            presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty, logit_bias=sp.bias(),
            stream_interval=sp.stream_interval, structured_outputs=sp.structured_outputs(),
            logprobs=top if it.return_logprob else None,
            prompt_logprobs=top if it.return_logprob and it.logprob_start_len >= 0 else None,
        )


# ------------------------------------------------------------------------ responses

LogprobEntry = list[float | int | str | None]  # [logprob, token_id, text (with
# return_text_in_logprobs) | null]


#: the version SGLang labels weights that were never given one with (its `weight_version`
#: server argument's default), in `meta_info.weight_versions` spans
UNVERSIONED_LABEL = "default"


class MetaInfo(Struct, kw_only=True):
    """SGLang's meta_info (tokenizer_manager.py), then rlfleet's policy stamp and spans."""

    id: str
    finish_reason: dict[str, Any] | None  # {"type": "length"|"stop"|"abort", ...}
    prompt_tokens: int
    weight_version: Any = None
    total_retractions: int = 0  # the engine never retracts a running request here
    # reasoning tokens among the completion's (SGLang counts them with a reasoning parser;
    # this fleet does not separate them: 0)
    reasoning_tokens: int = 0
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache
    e2e_latency: float | UnsetType = UNSET  # seconds, once finished
    weight_digest: str | None = None
    weight_step: int | None = None
    weight_adapter: str | UnsetType = UNSET  # the LoRA adapter it ran on (its own policy)
    weight_versions: list[WeightSpan] | UnsetType = UNSET  # once finished
    stale_policy: bool | UnsetType = UNSET  # the request left its policy bound
    input_token_logprobs: list[LogprobEntry] | UnsetType = UNSET
    output_token_logprobs: list[LogprobEntry] | UnsetType = UNSET
    output_token_logprobs_length: int | UnsetType = UNSET
    input_top_logprobs: list[list[LogprobEntry] | None] | UnsetType = UNSET
    output_top_logprobs: list[list[LogprobEntry]] | UnsetType = UNSET


class GenerateResponse(Struct, kw_only=True):
    """The whole output so far: the unary answer, and each event of a stream (SGLang
    streams cumulatively: the last event's output_ids is the whole completion). `index`:
    which prompt of a streamed batch the event is for."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | UnsetType = UNSET


class AbortRequest(BaseModel):
    """SGLang's `AbortReq` (io_struct.py) as POST /abort_request takes it."""

    model_config = ConfigDict(strict=True, extra="ignore")

    rid: str = ""  # "" with abort_all false: nothing to abort (answered 200, as SGLang)
    abort_all: bool = False
