"""GET /v1/rl/workers, protocol version 1."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, field_validator, model_validator

PROTOCOL_VERSION = 1


class RlWorker(BaseModel):
    namespace: str
    component: str
    endpoint: str
    instance_id: int = Field(ge=0, lt=2**64)
    transport: dict[str, str]
    request_plane_url: str
    routes: list[str] = Field(default_factory=list)
    system_url: str | None = None
    admin_base_url: str | None = None
    model: str | None = None
    world_size: int | None = Field(None, gt=0)
    error: str | None = None
    # rlfleet extensions, from the worker's own entry: the policy it applied and the newest
    # fleet epoch it has seen (what a refresh coordinator starts from), its admission flag
    weight_version: str | None = None
    weight_digest: str | None = None
    weight_step: int | None = Field(None, ge=0)
    fleet_epoch: int | None = Field(None, ge=0)
    gated: bool | None = None

    @field_validator("transport")
    @classmethod
    def _one_transport(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) != 1:
            raise ValueError("transport names exactly one transport")
        return v

    @field_validator("admin_base_url")
    @classmethod
    def _admin(cls, v: str | None) -> str | None:
        if v is not None:
            u = urlsplit(v)
            if u.scheme not in ("http", "https") or u.username or u.password or u.query or u.fragment:
                raise ValueError("admin_base_url must be http(s) without userinfo, query or fragment")
        return v

    @model_validator(mode="after")
    def _check(self) -> RlWorker:
        if self.admin_base_url is not None and self.world_size is None:
            raise ValueError("admin_base_url requires world_size")
        self.routes = sorted(set(self.routes))
        return self

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> RlWorker:
        """The listing of one discovery entry; routes are filled in by the probe."""
        keys = set(cls.model_fields) - {"routes", "error"}
        return cls(**{k: v for k, v in entry.items() if k in keys and v is not None})

    def dump(self) -> dict[str, Any]:
        """Optional fields are omitted when absent, never null."""
        return self.model_dump(exclude_none=True)


class SkippedEntry(BaseModel):
    """A discovery entry the listener could not list (unreadable, or failing the schema
    above); the rest of the listing is unaffected. An rlfleet extension to version 1."""

    where: str  # the file, etcd key or instance it came from
    error: str
    key: str | None = None  # namespace/component/endpoint/instance_id, when known


class RlWorkers(BaseModel):
    protocol_version: int
    namespace: str
    workers: list[RlWorker]
    skipped: list[SkippedEntry] = Field(default_factory=list)
