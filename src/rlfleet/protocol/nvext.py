"""nvext: the request extension and response fields that carry token authority."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator

EXTRA_FIELDS = frozenset({
    "completion_token_ids", "prompt_token_ids", "prompt_logprobs", "worker_id", "timing",
    "detailed_finish_reason", "stop_reason", "engine_data", "weight_versions",
})


class NvExt(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    token_data: list[int] | None = None
    extra_fields: list[str] | None = None

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
            if f not in EXTRA_FIELDS:
                raise ValueError(f"unknown nvext.extra_fields entry {f!r}; known: "
                                 f"{', '.join(sorted(EXTRA_FIELDS))}")
        return v

    def wants(self, field: str) -> bool:
        return field in (self.extra_fields or ())
