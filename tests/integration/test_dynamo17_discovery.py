"""Dynamo 1.7's discovery and route layout, as a 1.7 client reads and drives them, on mocker
workers (the mocker is a simulator: this checks the contract, not an engine).

The listing schema below is the client's side: Dynamo 1.7's `RlWorkerInfo` fields
(lib/llm rl discovery) with `world_size` and `admin_base_url` required, as newer clients
require them, plus rlfleet's documented extensions, and nothing else. The driving client
follows a 1.7 client's refresh (prime-rl's Dynamo admin plane): pause, confirm paused,
reload from disk through `collective_rpc` (vLLM's body: `reload_weights` with
`kwargs.weights_path`), set and read the version, resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.protocol.rl import RlWorker
from tests.inprocess import InProcessFleet

MODEL = "mock-dynamo17"
#: what a Dynamo 1.7 client requires of every worker it binds (its REQUIRED_ROUTES)
REQUIRED_ROUTES = frozenset({"control/pause_generation", "control/resume_generation",
                             "control/is_paused", "control/get_weight_version",
                             "update/update_weight_version"})


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
    error: str | None = None

    @model_validator(mode="after")
    def _only_declared_extensions(self) -> Dynamo17Worker:
        unknown = set(self.model_extra or {}) - set(RlWorker.model_fields)
        if unknown:
            raise ValueError(f"extra fields not permitted: {sorted(unknown)}")
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


class Dynamo17Admin:
    """A 1.7 client's admin calls on one worker: POST a JSON object to
    <system_url>/engine/<route>, and an HTTP error or `status: "error"` fails the step."""

    def __init__(self, worker: Dynamo17Worker) -> None:
        missing = REQUIRED_ROUTES - set(worker.routes)
        assert not missing, f"the worker does not advertise {sorted(missing)}"
        self.http = httpx.AsyncClient(base_url=worker.system_url.rstrip("/"), timeout=10)

    async def call(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        r = await self.http.post(f"/engine/{route}", json=body)
        r.raise_for_status()
        payload = r.json()
        assert isinstance(payload, dict) and payload.get("status") != "error", (route, payload)
        return payload

    async def refresh(self, checkpoint: Path, version: str) -> None:
        await self.call("control/pause_generation", {"mode": "keep", "clear_cache": False})
        assert (await self.call("control/is_paused", {}))["is_paused"] is True
        reloaded = await self.call("collective_rpc", {
            "method": "reload_weights", "timeout": 60.0, "args": [],
            "kwargs": {"weights_path": str(checkpoint)}})
        assert reloaded["results"] == [None]  # one rank
        await self.call("update/update_weight_version", {"new_version": version})
        assert (await self.call("control/get_weight_version", {}))["weight_version"] == version
        await self.call("control/resume_generation", {})
        assert (await self.call("control/is_paused", {}))["is_paused"] is False


async def served_policy(url: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 2, "ignore_eos": True,
            "nvext": {"extra_fields": ["engine_data"]}}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["nvext"]["engine_data"]


async def test_listing_validates_against_the_strict_schema(tmp_path: Path) -> None:
    async with InProcessFleet(tmp_path, MODEL, 2) as fleet:
        workers = await listed(fleet.rl_url)
        assert len(workers) == 2
        for w in workers:
            assert w.world_size == 1  # the mocker: one rank
            assert w.admin_base_url == w.system_url  # vLLM's native RL routes live there
            assert REQUIRED_ROUTES <= set(w.routes) and w.error is None
            assert {"pause_generation", "get_weight_version"} <= set(w.routes)  # 1.6's stay
            assert "collective_rpc" in w.routes  # 1.7's reload route
        # the schema has teeth: 1.6's listing (no world_size, no admin_base_url) fails it
        old = workers[0].model_dump(exclude={"world_size", "admin_base_url"})
        with pytest.raises(ValidationError, match="world_size|admin_base_url"):
            Dynamo17Worker.model_validate(old)
        with pytest.raises(ValidationError, match="extra"):
            Dynamo17Worker.model_validate({**workers[0].model_dump(), "surprise": 1})


async def test_a_dynamo17_client_moves_a_worker_to_the_new_policy(tmp_path: Path) -> None:
    async with InProcessFleet(tmp_path, MODEL, 1) as fleet:
        [worker] = await listed(fleet.rl_url)
        before = await served_policy(fleet.url)
        checkpoint = write_mock_checkpoint(fleet.weights / "step-7", seed=7)
        admin = Dynamo17Admin(worker)
        try:
            await admin.refresh(checkpoint, "7")
            flat = await admin.call("get_weight_version", {})
        finally:
            await admin.http.aclose()
        after = await served_policy(fleet.url)
        assert after["weight_version"] == "7" != before["weight_version"]
        assert after["weight_digest"] == flat["weight_digest"] != before["weight_digest"]
        [relisted] = await listed(fleet.rl_url)
        policy = relisted.model_extra or {}
        assert (policy["weight_version"], policy["weight_digest"]) == ("7", flat["weight_digest"])


async def test_the_namespaced_routes_refuse_bad_bodies_by_name(tmp_path: Path) -> None:
    async with InProcessFleet(tmp_path, MODEL, 1) as fleet:
        [worker] = await listed(fleet.rl_url)
        async with httpx.AsyncClient(base_url=worker.system_url, timeout=10) as c:
            for body, said in (({}, "new_version is required"),
                               ({"new_version": ""}, "new_version is required"),
                               ({"new_version": "8", "weight_version": "8"},
                                "unknown field 'weight_version'")):
                r = await c.post("/engine/update/update_weight_version", json=body)
                assert r.status_code == 200 and r.json()["status"] == "error", r.text
                assert said in r.json()["message"]
            r = await c.post("/engine/control/is_paused", json={"chain": True})
            assert "unknown field 'chain'" in r.json()["message"]
            # collective_rpc runs reload_weights only, and only while paused
            for body, said in (({"method": "sleep"}, "for 'reload_weights' only"),
                               ({"method": "reload_weights", "kwargs": {"turbo": 1}},
                                "unknown kwargs ['turbo']"),
                               ({"method": "reload_weights", "chain": True},
                                "unknown field 'chain'"),
                               ({"method": "reload_weights"},
                                "reload_weights: generation is not paused")):
                r = await c.post("/engine/collective_rpc", json=body)
                assert r.status_code == 200 and r.json()["status"] == "error", r.text
                assert said in r.json()["message"], r.text
            # the version is unchanged, and null until one is declared
            r = await c.post("/engine/control/get_weight_version", json={})
            assert r.json() == {"status": "ok", "weight_version": None}
