"""nvext: the request extension and response fields that carry token authority."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ALLOWED_EXTRA_FIELDS = frozenset({
    "completion_token_ids", "prompt_token_ids", "prompt_logprobs", "worker_id", "timing",
    "detailed_finish_reason", "stop_reason", "engine_data", "weight_versions",
    "routed_experts",  # in each choice (vLLM's place and encoding), see RoutedExperts
})


class PolicyBound(BaseModel):
    """`nvext.policy`: which policies may serve the request. `min_step`: a fleet step the
    worker's policy must be at or above; `max_lag`: how many steps behind the newest step
    any serving worker of the model it may be (both: both hold). `on_stale`: what happens
    when the worker moves out of the bound mid-generation (an update under a keep-pause):
    "abort" ends the choice (finish reason abort, detailed_finish_reason "stale_policy"),
    "finish" completes it, marked (nvext.stale_policy)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    min_step: int | None = Field(None, ge=0)
    max_lag: int | None = Field(None, ge=0)
    on_stale: Literal["abort", "finish"] = "abort"

    @model_validator(mode="after")
    def _some_bound(self) -> PolicyBound:
        if self.min_step is None and self.max_lag is None:
            raise ValueError("policy needs min_step and/or max_lag (non-negative integers)")
        return self

    def floor(self, newest: int | None) -> int | None:
        """The lowest step within the bound when the newest step served is `newest`."""
        lows = [s for s in (self.min_step, None if self.max_lag is None or newest is None
                            else newest - self.max_lag) if s is not None]
        return max(lows) if lows else None

    def allows(self, steps: list[int | None]) -> bool:
        """Whether tokens from these steps (one choice's spans) stay within the bound."""
        if any(s is None for s in steps):
            return False
        if self.min_step is not None and min(steps, default=self.min_step) < self.min_step:
            return False
        return self.max_lag is None or not steps or max(steps) - min(steps) <= self.max_lag

    def nvext(self) -> dict[str, Any]:
        """As a request's `nvext.policy` (what the rollout client sends)."""
        return self.model_dump(exclude_none=True)

    def describe(self) -> str:
        parts = [f"min_step {self.min_step}" if self.min_step is not None else "",
                 f"max_lag {self.max_lag}" if self.max_lag is not None else ""]
        return " and ".join(p for p in parts if p)


class NvExt(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    token_data: list[int] | None = None
    extra_fields: list[str] | None = None
    policy: PolicyBound | None = None  # rlfleet: a staleness bound

    @field_validator("token_data")
    @classmethod
    def _token_data(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and not v:
            raise ValueError("nvext.token_data is empty: send at least one token ID")
        return v

    @field_validator("extra_fields")
    @classmethod
    def _fields(cls, v: list[str] | None) -> list[str] | None:
        for f in v or []:
            if f not in ALLOWED_EXTRA_FIELDS:
                raise ValueError(f"unknown nvext.extra_fields entry {f!r}; known: "
                                 f"{', '.join(sorted(ALLOWED_EXTRA_FIELDS))}")
        return v

    def wants(self, field: str) -> bool:
        return field in (self.extra_fields or ())
