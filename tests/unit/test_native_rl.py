"""vLLM 0.32's native RL routes (rlfleet.worker.native_rl) on a mocker worker's system server,
in-process: vLLM's bodies and replies, the admin token, the fleet-epoch fence, the refresh
hold (409), reload_weights through update_weights_from_disk's checks, and the weight-transfer
steps refused by an engine that has none."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from rlfleet.mocker.admin import MockAdmin
from rlfleet.mocker.engine import MockEngine, write_mock_checkpoint
from rlfleet.protocol.admin import EPOCH_HEADER, SET_ADMISSION
from rlfleet.worker.native_rl import NativeRL
from rlfleet.worker.system_server import Route, system_app

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def worker(tmp_path: Path | None = None, token: str | None = None
           ) -> tuple[MockEngine, MockAdmin, httpx.AsyncClient]:
    engine = MockEngine(seed=4)
    roots = [str(tmp_path)] if tmp_path is not None else None
    mock = MockAdmin(engine, roots)
    routes = [*mock.routes(), Route(SET_ADMISSION, mock.vllm.admission.set_admission)]
    app = system_app(routes, fence=mock.fence, admin_token=token,
                     mounted=NativeRL(mock.vllm))
    return engine, mock, httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                           base_url="http://w")


async def test_pause_resume_and_is_paused_answer_as_vllm() -> None:
    engine, _, http = worker()
    async with http:
        assert (await http.get("/is_paused")).json() == {"is_paused": False}
        resp = await http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        assert resp.status_code == 200 and resp.json() == {"status": "paused"}
        assert await engine.is_paused() and engine._mode == "keep"
        assert (await http.get("/is_paused")).json() == {"is_paused": True}
        resp = await http.post("/resume")
        assert resp.status_code == 200 and resp.json() == {"status": "resumed"}
        assert not await engine.is_paused()
        await http.post("/pause")  # vLLM's default mode: abort
        assert engine._mode == "abort"
        bad = await http.post("/pause", params={"mode": "sideways"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == 400
        assert "mode" in bad.json()["error"]["message"]


async def test_versions_world_size_and_abort() -> None:
    _, _, http = worker()
    async with http:
        assert (await http.get("/weight_info")).json() == {"weight_version": "default"}
        resp = await http.post("/update_weight_version", json={"new_version": "v7"})
        assert resp.json() == {"success": True, "new_version": "v7"}
        assert (await http.get("/weight_info")).json() == {"weight_version": "v7"}
        assert (await http.get("/engine/get_weight_version")).json()["version"] == "v7"
        missing = await http.post("/update_weight_version", json={})
        assert missing.status_code == 400 and "new_version" in missing.json()["error"]["message"]
        assert (await http.get("/get_world_size")).json() == {"world_size": 1}
        assert (await http.get("/get_world_size", params={"include_dp": "false"})).json() == \
            {"world_size": 1}
        resp = await http.post("/abort_requests", json={})
        assert resp.json() == {"status": "aborted", "aborted": 0}
        resp = await http.post("/abort_requests", json={"request_ids": ["a", "b"]})
        assert resp.json() == {"status": "aborted", "aborted": 2}
        resp = await http.post("/abort_requests", content=b"{no")
        assert resp.status_code == 400


async def test_workers_of_one_process_share_the_routes_and_answer_each_for_itself() -> None:
    """The routes are built once per process (a mocker's --replicas runs 1,024 workers in
    one): each app's copy answers for the worker it mounts, not for the last one built."""
    (e1, _, h1), (e2, _, h2) = worker(), worker()
    async with h1, h2:
        assert (await h1.post("/update_weight_version", json={"new_version": "one"})).is_success
        assert (await h2.post("/update_weight_version", json={"new_version": "two"})).is_success
        assert (await h1.get("/weight_info")).json() == {"weight_version": "one"}
        assert (await h2.get("/weight_info")).json() == {"weight_version": "two"}
        assert (await h1.post("/pause", params={"mode": "keep"})).is_success
        assert await e1.is_paused() and not await e2.is_paused()
        assert (await h2.get("/is_paused")).json() == {"is_paused": False}
    assert [r for r in h1._transport.app.routes if getattr(r, "path", "") == "/weight_info"] \
        == [r for r in h2._transport.app.routes if getattr(r, "path", "") == "/weight_info"]


def test_abort_requests_finds_a_request_by_the_id_vllm_would_give_it(monkeypatch) -> None:
    """vLLM's engine ID of a request (`chatcmpl-<base>`, `cmpl-<base>-<i>`) reaches the
    request rlfleet's frontend named (its response id: `cmpl-<random>`, or the
    X-Request-Id as given); an ID the engine has is taken as it is; one it has not is kept."""
    engine, mock, _ = worker()
    running = {"cmpl-abc", "chatcmpl-def", "R", "B-1", "cmpl-S-0"}
    monkeypatch.setattr(engine, "tracks", lambda rid: rid in running)
    native = NativeRL(mock.vllm)
    for vllm_id, ours in [("cmpl-abc-0", "cmpl-abc"), ("cmpl-abc", "cmpl-abc"),
                          ("chatcmpl-def", "chatcmpl-def"), ("chatcmpl-R", "R"),
                          ("cmpl-R-0", "R"), ("cmpl-B-1", "B-1"), ("R", "R"),
                          ("cmpl-S-0", "cmpl-S-0"), ("cmpl-zzz-0", "cmpl-zzz-0"),
                          ("other", "other")]:
        assert native.engine_request_id(vllm_id) == ours, vllm_id


async def test_weight_transfer_is_refused_by_an_engine_without_one() -> None:
    _, _, http = worker()
    async with http:
        for path, body in [("/init_weight_transfer_engine", {"init_info": {"master_port": 1}}),
                           ("/start_weight_update", None),
                           ("/update_weights", {"update_info": {"names": []}}),
                           ("/finish_weight_update", {"weight_version": "v2"})]:
            resp = await http.post(path, json=body)
            assert resp.status_code == 400, path
            assert "weight-transfer" in resp.json()["error"], path
        assert (await http.get("/weight_info")).json() == {"weight_version": "default"}


async def test_reload_weights_goes_through_the_disk_checks(tmp_path: Path) -> None:
    engine, mock, http = worker(tmp_path)
    ckpt = write_mock_checkpoint(tmp_path / "ckpt", seed=9)
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(ckpt)}}
    async with http:
        resp = await http.post("/collective_rpc", json=rpc)
        assert resp.status_code == 409 and "pause" in resp.json()["error"]  # not paused
        await http.post("/pause", params={"mode": "keep"})
        outside = await http.post("/collective_rpc", json={
            "method": "reload_weights", "kwargs": {"weights_path": "/etc"}})
        assert outside.status_code == 400 and "allowed" in outside.json()["error"]["message"]
        other = await http.post("/collective_rpc", json={"method": "sleep"})
        assert other.status_code == 400 and "reload_weights" in other.json()["error"]["message"]
        extra = await http.post("/collective_rpc", json={
            "method": "reload_weights", "kwargs": {"weights_path": str(ckpt), "turbo": "1"}})
        assert extra.status_code == 400 and "turbo" in extra.json()["error"]["message"]
        resp = await http.post("/collective_rpc", json=rpc)
        assert resp.status_code == 200 and resp.json() == {"results": [None]}
        assert engine.applied().policy.digest == "mock:9"
        assert mock.vllm.check_pending  # the self-check runs on resume, held until then
        assert mock.vllm.admission.hold_reason is not None
        await http.post("/resume")
        assert not mock.vllm.check_pending and mock.vllm.admission.hold_reason is None


async def test_admin_token_and_fence_apply() -> None:
    _, mock, http = worker(token=TOKEN)
    async with http:
        assert (await http.post("/pause")).status_code == 401
        assert (await http.get("/is_paused")).status_code == 200  # reads need no token
        resp = await http.post("/pause", headers={**AUTH, EPOCH_HEADER: "5"})
        assert resp.status_code == 200 and mock.fence.newest == 5
        stale = await http.post("/update_weight_version", json={"new_version": "x"},
                                headers={**AUTH, EPOCH_HEADER: "4"})
        assert stale.status_code == 409 and stale.json()["error"] == "Stale fleet epoch"


@pytest.mark.parametrize("hold", ["pause", "control/pause", "close"])
async def test_a_refresh_that_holds_the_worker_refuses_native_changes(hold: str) -> None:
    """A fenced pause (Dynamo 1.6's flat name or 1.7's control/ one) or close holds the
    worker against native changes until the same names resume or reopen it."""
    _, _, http = worker()
    fenced = {EPOCH_HEADER: "3"}
    prefix = "control/" if hold.startswith("control/") else ""
    async with http:
        if hold.endswith("pause"):
            held = await http.post(f"/engine/{prefix}pause_generation", json={}, headers=fenced)
        else:
            held = await http.post("/engine/set_admission", json={"open": False}, headers=fenced)
        assert held.json()["status"] == "ok"
        for path, body in [("/resume", None), ("/pause", None),
                           ("/update_weight_version", {"new_version": "x"}),
                           ("/abort_requests", {}), ("/collective_rpc", {"method": "x"})]:
            resp = await http.post(path, json=body)
            assert resp.status_code == 409, path
            assert resp.json()["error"] == "Refresh in progress" and resp.json()["fleet_epoch"] == 3
            assert "refresh holds this worker" in resp.json()["message"]
        assert (await http.get("/weight_info")).status_code == 200  # reads still answer
        if hold.endswith("pause"):
            await http.post(f"/engine/{prefix}resume_generation", json={}, headers=fenced)
        else:
            await http.post("/engine/set_admission", json={"open": True}, headers=fenced)
        resp = await http.post("/update_weight_version", json={"new_version": "x"})
        assert resp.status_code == 200


async def test_an_unfenced_pause_does_not_hold_the_worker() -> None:
    _, _, http = worker()
    async with http:
        paused = await http.post("/engine/pause_generation", json={})  # an operator, no epoch
        assert paused.status_code == 200 and paused.json()["status"] == "ok", paused.text
        assert (await http.get("/is_paused")).json() == {"is_paused": True}
        resumed = await http.post("/resume")  # native: not refused as a refresh's hold
        assert resumed.status_code == 200, resumed.text
        assert (await http.get("/is_paused")).json() == {"is_paused": False}


async def test_dynamo17_update_routes_run_the_native_steps_in_the_contracts_shape() -> None:
    """/engine/update/* and the native weight-transfer routes are one implementation: the
    same refusal, as the contract's expected failure on /engine (HTTP 200, status error)
    and as vLLM's 400 natively; the /engine rules apply (admin token, fence), and an
    rlfleet refresh's hold does not (it guards the native calls only)."""
    _, mock, http = worker(token=TOKEN)
    steps = [("init_weight_transfer_engine", {"init_info": {"master_port": 1}}),
             ("start_weight_update", {}),
             ("update_weights", {"update_info": {"names": []}}),
             ("finish_weight_update", {"weight_version": "v2"})]
    async with http:
        held = await http.post("/engine/pause_generation", json={},
                               headers={**AUTH, EPOCH_HEADER: "3"})
        assert held.json()["status"] == "ok"
        for step, body in steps:
            native = await http.post(f"/{step}", json=body, headers=AUTH)
            assert native.status_code == 409  # held: the native call is refused
            engine = await http.post(f"/engine/update/{step}", json=body, headers=AUTH)
            assert engine.status_code == 200, engine.text
            said = engine.json()
            assert said["status"] == "error", step
            assert said["message"] == mock.vllm.engine.weight_transfer_refusal(), step
            assert (await http.post(f"/engine/update/{step}", json=body)).status_code == 401
            stale = await http.post(f"/engine/update/{step}", json=body,
                                    headers={**AUTH, EPOCH_HEADER: "2"})
            assert stale.status_code == 409 and stale.json()["error"] == "Stale fleet epoch"
        await http.post("/engine/resume_generation", json={}, headers={**AUTH, EPOCH_HEADER: "3"})
        native = await http.post("/init_weight_transfer_engine", json=steps[0][1], headers=AUTH)
        assert native.status_code == 400
        assert native.json()["error"] == mock.vllm.engine.weight_transfer_refusal()
        listing = (await http.get("/engine")).json()["routes"]
        assert {f"update/{step}" for step, _ in steps} <= set(listing)
