"""Dynamo 1.7's discovery and route layout, as a 1.7 client reads and drives them, on mocker
workers (the mocker is a simulator: this checks the contract, not an engine).

The listing schema (tests.dynamo17.Dynamo17Worker) is the client's side: Dynamo 1.7's
`RlWorkerInfo` fields with `world_size`, `admin_base_url` and `weight_transfer_backend`
required and the control/* and update/* routes listed, as newer clients require them, plus
rlfleet's documented extensions, and nothing else. The driving client follows a 1.7
client's refresh (prime-rl's Dynamo admin plane): pause, confirm paused, reload from disk
through `collective_rpc` (vLLM's body: `reload_weights` with `kwargs.weights_path`), set and
read the version, resume. The mocker has no weight-transfer engine: its entry says
`weight_transfer_backend: "none"`, so a client that transfers over nccl refuses to bind it
(its update/* routes refuse every step). The weight-transfer sequence on a real vLLM worker:
test_dynamo17_vllm.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.protocol.vllm_rl import NO_TRANSFER_BACKEND
from tests.dynamo17 import (
    REQUIRED_ROUTES,
    TRANSFER_ROUTES,
    Dynamo17Worker,
    DynamoClientError,
    DynamoWeightSync,
    listed,
    served_policy,
)
from tests.inprocess import InProcessFleet

MODEL = "mock-dynamo17"


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


async def test_listing_validates_against_the_strict_schema(tmp_path: Path) -> None:
    async with InProcessFleet(tmp_path, MODEL, 2) as fleet:
        workers = await listed(fleet.rl_url)
        assert len(workers) == 2
        for w in workers:
            assert w.world_size == 1  # the mocker: one rank
            assert w.weight_transfer_backend == NO_TRANSFER_BACKEND  # it has none
            assert TRANSFER_ROUTES <= set(w.routes)  # served: each step refused, saying why
            assert w.admin_base_url == w.system_url  # vLLM's native RL routes live there
            assert REQUIRED_ROUTES <= set(w.routes) and w.error is None
            assert {"pause_generation", "get_weight_version"} <= set(w.routes)  # 1.6's stay
            assert "collective_rpc" in w.routes  # 1.7's reload route
        # the schema has teeth: 1.6's listing (no world_size, no admin_base_url) fails it,
        # and so does a listing without the backend or the weight-transfer routes
        old = workers[0].model_dump(exclude={"world_size", "admin_base_url"})
        with pytest.raises(ValidationError, match="world_size|admin_base_url"):
            Dynamo17Worker.model_validate(old)
        with pytest.raises(ValidationError, match="weight_transfer_backend"):
            Dynamo17Worker.model_validate(workers[0].model_dump(
                exclude={"weight_transfer_backend"}))
        for route in sorted(TRANSFER_ROUTES):
            routes = [r for r in workers[0].routes if r != route]
            with pytest.raises(ValidationError, match=route):
                Dynamo17Worker.model_validate({**workers[0].model_dump(), "routes": routes})
        with pytest.raises(ValidationError, match="extra"):
            Dynamo17Worker.model_validate({**workers[0].model_dump(), "surprise": 1})


async def test_a_dynamo17_client_moves_a_worker_to_the_new_policy(tmp_path: Path) -> None:
    async with InProcessFleet(tmp_path, MODEL, 1) as fleet:
        [worker] = await listed(fleet.rl_url)
        before = await served_policy(fleet.url, MODEL)
        checkpoint = write_mock_checkpoint(fleet.weights / "step-7", seed=7)
        admin = Dynamo17Admin(worker)
        try:
            await admin.refresh(checkpoint, "7")
            flat = await admin.call("get_weight_version", {})
        finally:
            await admin.http.aclose()
        after = await served_policy(fleet.url, MODEL)
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


async def test_a_weight_transfer_client_refuses_to_bind_the_mocker(tmp_path: Path) -> None:
    """The mocker says it has no backend: a client that transfers over nccl (prime-rl's)
    refuses it at discovery, before it pauses anything; its update/* routes refuse too."""
    async with InProcessFleet(tmp_path, MODEL, 1) as fleet:
        async with DynamoWeightSync(fleet.rl_url, MODEL) as client:
            with pytest.raises(DynamoClientError, match="over none, not nccl"):
                await client.discover()
        [worker] = await listed(fleet.rl_url)
        async with httpx.AsyncClient(base_url=worker.system_url, timeout=10) as c:
            r = await c.post("/engine/update/init_weight_transfer_engine",
                             json={"init_info": {"master_address": "127.0.0.1"}})
            assert r.status_code == 200 and r.json()["status"] == "error", r.text
            assert "no vLLM weight-transfer engine" in r.json()["message"]
            assert (await c.post("/engine/control/is_paused", json={})).json()["is_paused"] is False
