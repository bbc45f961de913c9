"""The routes a worker gained for this round's frameworks, in-process on a mocker worker's
system server: vLLM's newest dev RL routes (the weight checker, the draft model's update),
SGLang's names under /engine that slime sends through Dynamo's facade (server_info,
continue_generation, the pause modes, the group bodies) and SGLang 0.5.23's weight-update
session; the checksum reports' comparison (rlfleet.runtime.weight_checker)."""

from __future__ import annotations

import httpx
import pytest

from rlfleet.mocker.admin import MockAdmin
from rlfleet.mocker.engine import MockEngine
from rlfleet.protocol import admin
from rlfleet.protocol.admin import SET_ADMISSION, AdminRequestError, read_request
from rlfleet.runtime import weight_checker
from rlfleet.worker.native_rl import NativeRL
from rlfleet.worker.system_server import Route, system_app


def worker() -> tuple[MockEngine, httpx.AsyncClient]:
    engine = MockEngine(seed=4)
    mock = MockAdmin(engine)
    routes = [*mock.routes(), Route(SET_ADMISSION, mock.vllm.admission.set_admission)]
    app = system_app(routes, fence=mock.fence, mounted=NativeRL(mock.vllm))
    return engine, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w")


async def test_the_weight_checker_reports_and_compares_the_served_weights() -> None:
    engine, http = worker()
    async with http:
        said = (await http.post("/weight_checker", json={"action": "checksum"})).json()
        [(key, digest)] = said["checksums"].items()
        assert key == "dp0:pp0:pcp0:tp0:ep0:weights"
        assert digest == engine.applied().policy.digest
        same = await http.post("/weight_checker", json={"action": "compare",
                                                        "baseline": said["checksums"]})
        assert same.json() == {"match": True, "mismatches": [], "ranks": ["dp0:pp0:pcp0:tp0:ep0:"]}
        other = {key: "blake3:00"}
        diff = await http.post("/weight_checker", json={
            "action": "compare", "baseline": said["checksums"], "checksums": [other]})
        assert diff.json()["match"] is False and diff.json()["mismatches"] == [key]
        await http.post("/pause", params={"mode": "keep"})  # reads work while paused
        assert (await http.post("/weight_checker", json={"action": "checksum"})).json() == said
        for body, words in [({"action": "reset"}, "random values"),
                            ({"action": "sum"}, "checksum|reset|compare"),
                            ({"action": "compare"}, "'baseline' object"),
                            ({"action": "compare", "baseline": {}, "checksums": {}},
                             "'checksums' must be a list")]:
            refused = await http.post("/weight_checker", json=body)
            assert refused.status_code == 400 and words in refused.json()["detail"], body
        assert engine.applied().policy.digest == digest  # nothing was reset


def test_reports_compare_as_vllm_compares_them() -> None:
    a = {"dp0:pp0:pcp0:tp0:ep0:w": "1", "dp0:pp0:pcp0:tp1:ep0:w": "2"}
    assert weight_checker.compare([a, dict(a)]) == (
        True, [], ["dp0:pp0:pcp0:tp0:ep0:", "dp0:pp0:pcp0:tp1:ep0:"])
    assert weight_checker.compare([a, {"dp0:pp0:pcp0:tp0:ep0:w": "1"}])[1] == \
        ["dp0:pp0:pcp0:tp1:ep0:w"]  # a key one report lacks
    assert weight_checker.under_dp({"dp0:pp0:pcp0:tp0:ep0:w": "1", "bare": "2"}, 3) == {
        "dp3:pp0:pcp0:tp0:ep0:w": "1", "dp3:pp0:pcp0:tp0:ep0:bare": "2"}
    with pytest.raises(ValueError, match="duplicate"):
        weight_checker.merge([a, a])


async def test_a_draft_models_update_is_refused_by_name() -> None:
    _, http = worker()
    async with http:
        r = await http.post("/start_draft_weight_update")
        assert r.status_code == 400 and "draft model" in r.json()["error"]


async def test_slimes_sglang_names_under_engine() -> None:
    engine, http = worker()
    async with http:
        info = (await http.get("/engine/server_info")).json()
        assert info == (await http.get("/engine/get_server_info")).json()
        assert info["status"] == "ok" and info["served_model_name"] == engine.info.served_model_name
        assert (info["tp_size"], info["pp_size"], info["dp_size"]) == (1, 1, 1)
        for mode, engine_mode in [("retract", "keep"), ("in_place", "keep"), ("abort", "abort")]:
            said = (await http.post("/engine/pause_generation", json={"mode": mode})).json()
            assert said["status"] == "ok" and said["mode"] == mode
            assert engine._mode == engine_mode and await engine.is_paused()
            said = (await http.post("/engine/continue_generation", json={})).json()
            assert said["status"] == "ok" and not await engine.is_paused()
        assert (await http.post("/engine/pause_generation", json={})).json()["mode"] == "keep"
        await http.post("/engine/continue_generation", json={"torch_empty_cache": False})
        # the listing stays Dynamo's: these are served, not listed
        listed = (await http.get("/engine")).json()["routes"]
        assert not {"server_info", "continue_generation", "begin_weight_update"} & set(listed)
        nccl = await http.post("/engine/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
            "world_size": 2, "group_name": "g", "backend": "nccl"})
        assert nccl.status_code == 400 and "NCCL" in nccl.json()["message"]
        left = await http.post("/engine/destroy_weights_update_group", json={"group_name": "g"})
        assert left.json()["status"] == "ok"


def test_sglangs_distributed_body_is_taken() -> None:
    body = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g",
            "flush_cache": False, "weight_version": "v2"}
    req = read_request(admin.UPDATE_WEIGHTS_FROM_DISTRIBUTED, body)
    assert (req.group_name, req.reset_cache, req.version) == ("g", False, "v2")
    assert read_request(admin.UPDATE_WEIGHTS_FROM_DISTRIBUTED,
                        {**body, "flush_cache": None}).reset_cache is True
    with pytest.raises(AdminRequestError, match="load_format 'flattened_bucket'"):
        read_request(admin.UPDATE_WEIGHTS_FROM_DISTRIBUTED,
                     {**body, "load_format": "flattened_bucket"})


async def test_sglangs_weight_update_session_opens_once() -> None:
    _, http = worker()
    async with http:
        opened = (await http.post("/engine/begin_weight_update", json={})).json()
        assert opened == {"success": True, "message": "Success"}
        again = (await http.post("/engine/begin_weight_update", json={"selector": "target"})).json()
        assert again["success"] is False and "already open" in again["message"]
        assert (await http.post("/engine/end_weight_update", json={})).json()["success"]
        closed = (await http.post("/engine/end_weight_update", json={})).json()
        assert closed["success"] is False and "no weight-update session" in closed["message"]
        draft = (await http.post("/engine/begin_weight_update", json={"selector": "draft"})).json()
        assert draft["success"] is False and "draft" in draft["message"]
        bad = (await http.post("/engine/begin_weight_update", json={"selector": "both"})).json()
        assert bad["success"] is False and "selector" in bad["message"]
