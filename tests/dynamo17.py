"""Dynamo 1.7's side of the wire, as the clients that speak it read and drive it (for the
tests of tests/integration/test_dynamo17_*.py):

- `Dynamo17Worker`: the listing schema, strictly: Dynamo 1.7's `RlWorkerInfo` fields (lib/llm
  rl discovery) with `world_size`, `admin_base_url` and `weight_transfer_backend` required, as
  newer clients require them, plus rlfleet's documented extensions, and nothing else;
- `DynamoWeightSync`: an RL framework's Dynamo weight sync, call by call as prime-rl's Dynamo
  inference pool (2026) makes them: it validates the listing as that client does (extra
  fields ignored, its strict types), binds the workers of its model, and moves them to a
  version through the `/engine/control/*` and `/engine/update/*` routes."""

from __future__ import annotations

import asyncio
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from rlfleet.protocol.rl import RlWorker

#: the control routes a 1.7 client requires of every worker it binds
CONTROL_ROUTES = frozenset({"control/pause_generation", "control/resume_generation",
                            "control/is_paused", "control/get_weight_version"})
#: the weight-transfer routes (prime-rl requires them; an older client's optional "native
#: NCCL routes")
TRANSFER_ROUTES = frozenset({"update/init_weight_transfer_engine", "update/start_weight_update",
                             "update/update_weights", "update/finish_weight_update"})
#: what the strict schema requires: both, and the relabel route the older client requires
REQUIRED_ROUTES = CONTROL_ROUTES | TRANSFER_ROUTES | {"update/update_weight_version"}


class Dynamo17Worker(BaseModel):
    """One worker of GET /v1/rl/workers, strictly: Dynamo 1.7's fields, and beside them
    only rlfleet's documented extensions (the fields of protocol.rl.RlWorker that 1.7
    lacks: the policy applied, the fleet epoch, admission)."""

    model_config = ConfigDict(extra="allow", strict=True)

    namespace: str = Field(min_length=1)
    component: str = Field(min_length=1)
    endpoint: str = Field(min_length=1)
    instance_id: int = Field(ge=0, lt=2**64)
    transport: dict[str, str] = Field(min_length=1, max_length=1)
    request_plane_url: str = Field(min_length=1)
    system_url: str = Field(min_length=1)
    admin_base_url: str = Field(min_length=1)
    model: str = Field(min_length=1)
    routes: list[str]
    world_size: int = Field(gt=0)
    weight_transfer_backend: str = Field(min_length=1)
    error: str | None = None

    @model_validator(mode="after")
    def _only_declared_extensions(self) -> Dynamo17Worker:
        unknown = set(self.model_extra or {}) - set(RlWorker.model_fields)
        if unknown:
            raise ValueError(f"extra fields not permitted: {sorted(unknown)}")
        missing = REQUIRED_ROUTES - set(self.routes)
        if self.error is None and missing:
            raise ValueError(f"routes lack {sorted(missing)}")
        return self

    @field_validator("admin_base_url")
    @classmethod
    def _admin_url(cls, v: str) -> str:
        """As 1.7's RlAdminBaseUrl: http(s) with a host, no user info, query or fragment."""
        u = urlsplit(v)
        assert u.scheme in ("http", "https") and u.hostname, v
        assert not (u.username or u.password or u.query or u.fragment), v
        return v


class Dynamo17Workers(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    protocol_version: Literal[1]
    namespace: str
    workers: list[Dynamo17Worker]
    skipped: list[dict[str, Any]] = Field(default_factory=list)  # rlfleet: unreadable entries
    discovery: str | None = None  # rlfleet: the store the committed policy is published in


async def listed(rl_url: str) -> list[Dynamo17Worker]:
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.get(f"{rl_url}/v1/rl/workers")
    assert r.status_code == 200, r.text
    return Dynamo17Workers.model_validate(r.json()).workers


async def served_policy(url: str, model: str) -> dict[str, Any]:
    """The policy a completion through the frontend at `url` ran on (its engine_data)."""
    body = {"model": model, "prompt": [11, 12, 13], "max_tokens": 2, "ignore_eos": True,
            "nvext": {"extra_fields": ["engine_data"]}}
    async with httpx.AsyncClient(timeout=120) as c:
        r = await c.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["nvext"]["engine_data"]


# ---------------------------------------------------------------- an RL framework's client


class PoolWorker(BaseModel):
    """One worker as the framework's client validates it: its fields, its strict types,
    every other field ignored."""

    model_config = ConfigDict(extra="ignore")

    namespace: str
    component: str = Field(min_length=1)
    instance_id: StrictInt = Field(ge=0)
    model: str
    system_url: str
    world_size: StrictInt = Field(gt=0)
    weight_transfer_backend: StrictStr = Field(min_length=1)
    routes: tuple[str, ...]
    error: str | None = None


class PoolListing(BaseModel):
    model_config = ConfigDict(extra="ignore")

    protocol_version: StrictInt = Field(ge=1, le=1)
    workers: list[dict[str, Any]]


class DynamoClientError(RuntimeError):
    """What the client raises: a worker it cannot bind, or a step a worker refused."""


class DynamoWeightSync:
    """The client for one model's workers. `backend`: the weight-transfer backend it speaks
    (prime-rl's: nccl; the test of ModelExpress's backend configures modelexpress)."""

    def __init__(self, rl_url: str, model: str, backend: str = "nccl") -> None:
        self.rl_url, self.model, self.backend = rl_url, model, backend
        self.workers: list[PoolWorker] = []
        self.initialized = False
        self.http = httpx.AsyncClient(timeout=300)

    async def __aenter__(self) -> DynamoWeightSync:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def discover(self) -> list[PoolWorker]:
        """GET the listing and bind the workers of the client's model."""
        r = await self.http.get(f"{self.rl_url}/v1/rl/workers")
        r.raise_for_status()
        listing = PoolListing.model_validate(r.json())
        workers = [PoolWorker.model_validate(w) for w in listing.workers
                   if w.get("model") == self.model]
        if not workers:
            raise DynamoClientError(f"no worker serves {self.model}")
        for w in workers:
            if w.error is not None:
                raise DynamoClientError(f"worker {w.instance_id} is not ready: {w.error}")
            if w.weight_transfer_backend != self.backend:
                raise DynamoClientError(f"worker {w.instance_id} transfers weights over "
                                        f"{w.weight_transfer_backend}, not {self.backend}")
            missing = (CONTROL_ROUTES | TRANSFER_ROUTES) - set(w.routes)
            if missing:
                raise DynamoClientError(f"worker {w.instance_id} lacks {sorted(missing)}")
        if len({w.system_url for w in workers}) != len(workers):
            raise DynamoClientError("two workers share a system_url")
        self.workers = workers
        return workers

    async def call(self, worker: PoolWorker, route: str, body: dict[str, Any]) -> dict[str, Any]:
        r = await self.http.post(f"{worker.system_url.rstrip('/')}/engine/{route}", json=body)
        payload = r.json()
        if not r.is_success or not isinstance(payload, dict):
            raise DynamoClientError(f"{route}: HTTP {r.status_code} {r.text}")
        if payload.get("status") == "error":
            raise DynamoClientError(f"{route}: {payload.get('message')}")
        return payload

    async def each(self, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self.call(w, route, body) for w in self.workers)))

    async def sync(self, version: str, chunks: list[dict[str, Any]],
                   init_info: dict[str, Any]) -> None:
        """Move every bound worker to `version`: pause, confirm, init the transfer (the first
        time), start, one update per chunk, finish, confirm the version, resume."""
        await self.each("control/pause_generation", {"mode": "keep", "clear_cache": False})
        for said in await self.each("control/is_paused", {}):
            if said.get("is_paused") is not True:
                raise DynamoClientError(f"a worker did not pause: {said}")
        if not self.initialized:
            await self.each("update/init_weight_transfer_engine", {"init_info": init_info})
            self.initialized = True
        await self.each("update/start_weight_update", {})
        for chunk in chunks:
            await self.each("update/update_weights", {"update_info": chunk})
        await self.each("update/finish_weight_update", {"weight_version": version})
        for said in await self.each("control/get_weight_version", {}):
            if said.get("weight_version") != version:
                raise DynamoClientError(f"a worker serves {said}, not {version}")
        await self.each("control/resume_generation", {})
