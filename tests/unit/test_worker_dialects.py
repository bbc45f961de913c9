"""What real clients send to a worker, taken as the real server takes it (issue 33), on a
mocker worker's system server in-process:

- Dynamo's `engine_rpc` on /engine/update_weights_from_disk and
  /engine/update_weights_from_distributed: the methods a worker runs (vLLM's reload_weights,
  prime-rl's update_weights_from_path) load the checkpoint with the usual digest, hold and
  self-check; any other, and prime-rl's NCCL receive, refused by name with HTTP 400;
- the flat /engine/is_paused (served, not listed) and `weight_version` in get_weight_version;
- at the worker's admin_base_url, vLLM's /reset_prefix_cache, /sleep, /wake_up and
  /is_sleeping as vLLM's CPU build answers them, and prime-rl's server routes
  (/update_weights with weight_dir, /liveness, /init_broadcaster), and SkyRL's
  /skyrl/v1/load_lora_adapter on a worker with LoRA."""

from __future__ import annotations

from pathlib import Path

import httpx

from rlfleet.mocker.admin import MockAdmin
from rlfleet.mocker.engine import MockEngine, write_mock_checkpoint
from rlfleet.models import make_adapter
from rlfleet.protocol import admin
from rlfleet.protocol.admin import EPOCH_HEADER, SET_ADMISSION
from rlfleet.protocol.engine import GenerateRequest, SamplingOptions, Step
from rlfleet.worker.native_rl import NativeRL
from rlfleet.worker.system_server import Route, system_app


def worker(tmp_path: Path, **engine_args) -> tuple[MockEngine, MockAdmin, httpx.AsyncClient]:
    engine = MockEngine(seed=4, **engine_args)
    mock = MockAdmin(engine, [str(tmp_path)])
    routes = [*mock.routes(), Route(SET_ADMISSION, mock.vllm.admission.set_admission)]
    app = system_app(routes, fence=mock.fence, mounted=NativeRL(mock.vllm))
    return engine, mock, httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                           base_url="http://w")


async def test_engine_rpc_runs_the_load_it_names(tmp_path: Path) -> None:
    engine, mock, http = worker(tmp_path)
    async with http:
        body = {"model_path": str(write_mock_checkpoint(tmp_path / "s7", 7)),
                "weight_version": "s7", "engine_rpc": "reload_weights"}
        said = (await http.post("/engine/update_weights_from_disk", json=body)).json()
        assert said["status"] == "error" and "pause" in said["message"]  # paused first
        await http.post("/engine/pause_generation", json={"mode": "keep"})
        for rpc, seed in (("reload_weights", 7), ("update_weights_from_path", 8)):
            body = {"model_path": str(write_mock_checkpoint(tmp_path / f"s{seed}", seed)),
                    "weight_version": f"s{seed}", "engine_rpc": rpc}
            said = (await http.post("/engine/update_weights_from_disk", json=body)).json()
            assert said == {"status": "ok", "version": f"s{seed}", "version_declared": True,
                            "weight_digest": f"mock:{seed}", "step": None}, rpc
            assert engine.applied().policy.digest == f"mock:{seed}"
            assert mock.vllm.check_pending  # held until the self-check passes on resume
        outside = await http.post("/engine/update_weights_from_disk", json={
            "model_path": "/etc", "engine_rpc": "update_weights_from_path"})
        assert "allowed" in outside.json()["message"]  # the same path checks
        await http.post("/engine/resume_generation")
        assert not mock.vllm.check_pending and mock.vllm.admission.hold_reason is None


async def test_the_distributed_route_loads_from_disk_with_an_engine_rpc(tmp_path: Path) -> None:
    engine, _, http = worker(tmp_path)
    ckpt = str(write_mock_checkpoint(tmp_path / "s5", 5))
    async with http:
        await http.post("/engine/pause_generation")
        # no group joined: an engine method is a load from disk, not a receive
        said = (await http.post("/engine/update_weights_from_distributed", json={
            "engine_rpc": "update_weights_from_path", "weight_path": ckpt,
            "weight_version": "5", "step": 5})).json()
        assert (said["status"], said["weight_digest"], said["version"], said["step"]) == \
            ("ok", "mock:5", "5", 5)
        assert engine.applied().policy.digest == "mock:5"
        for body, words in [
                ({"engine_rpc": "update_weights_from_path"}, "needs weight_path"),
                ({"engine_rpc": "reload_weights", "weight_path": ckpt},
                 "reload_weights takes weights_path, not weight_path"),
                ({"engine_rpc": "reload_weights", "names": ["w"], "dtypes": ["f"],
                  "shapes": [[1]]}, "names, dtypes and shapes announce rlfleet's own"),
                ({"weight_path": ckpt}, "names, dtypes and shapes are required")]:
            said = (await http.post("/engine/update_weights_from_distributed", json=body)).json()
            assert said["status"] == "error" and words in said["message"], (body, said)


async def test_what_the_worker_does_not_run_is_refused_by_name(tmp_path: Path) -> None:
    """HTTP 400 naming the method (prime-rl's NCCL broadcaster and receive among them); the
    weights stay as they were."""
    engine, _, http = worker(tmp_path)
    ckpt = str(write_mock_checkpoint(tmp_path / "s6", 6))
    async with http:
        await http.post("/engine/pause_generation")
        for route, body, words in [
                ("update_weights_from_disk", {"model_path": ckpt, "engine_rpc": "load_from_s3"},
                 ["'load_from_s3'", "reload_weights, update_weights_from_path"]),
                ("update_weights_from_distributed",
                 {"engine_rpc": "receive_tensors", "weight_version": "6"}, ["'receive_tensors'"]),
                # prime-rl's NCCL path (its DynamoAdminAPI): group, then receive
                ("init_weights_update_group",
                 {"host": "127.0.0.1", "port": 29501, "rank_offset": 0,
                  "inference_world_size": 1, "timeout": 60,
                  "quantize_in_weight_transfer": False, "engine_rpc": "init_broadcaster"},
                 ["'init_broadcaster'", "NCCL", "master_address"]),
                ("update_weights_from_distributed",
                 {"weight_version": "6", "weight_dir": str(tmp_path),
                  "engine_rpc": "update_weights_from_path"}, ["weight_dir", "NCCL receive"]),
                ("update_weights_from_distributed",
                 {"engine_rpc": "update_weights_from_path", "weight_path": ckpt,
                  "allow_unpaused": True, "reset_prefix_cache": False}, ["allow_unpaused"])]:
            resp = await http.post(f"/engine/{route}", json=body)
            assert resp.status_code == 400, (route, resp.text)
            assert resp.json()["error"] == "Unsupported request", resp.text
            for w in words:
                assert w in resp.json()["message"], (w, resp.text)
        assert engine.applied().policy.digest == "mock:4"
        said = (await http.post("/engine/update_weights_from_disk", json={
            "model_path": ckpt, "engine_rpc": 5})).json()
        assert said["status"] == "error" and "engine_rpc must be a string" in said["message"]
        # a field no server takes stays refused, as before
        said = (await http.post("/engine/update_weights_from_disk", json={
            "model_path": ckpt, "engine_rpcs": "reload_weights"})).json()
        assert "unknown field 'engine_rpcs'" in said["message"]
        assert "engine_rpc" in said["message"]  # among the fields the route takes


async def test_flat_is_paused_and_weight_version(tmp_path: Path) -> None:
    _, _, http = worker(tmp_path)
    async with http:
        listed = (await http.get("/engine")).json()["routes"]
        assert "control/is_paused" in listed and "is_paused" not in listed
        assert (await http.post("/engine/is_paused", json={})).json() == \
            {"status": "ok", "is_paused": False}
        await http.post("/engine/pause_generation")
        assert (await http.post("/engine/is_paused")).json()["is_paused"] is True
        said = (await http.post("/engine/get_weight_version")).json()
        assert (said["version"], said["weight_version"]) == (None, None)
        await http.post("/engine/set_weight_version", json={"weight_version": "v3"})
        said = (await http.post("/engine/get_weight_version")).json()
        assert (said["version"], said["weight_version"]) == ("v3", "v3")
        # the same label as Dynamo 1.7's control route
        assert (await http.post("/engine/control/get_weight_version")).json()[
            "weight_version"] == "v3"


def test_every_route_names_the_schema_it_follows() -> None:
    assert set(admin.FOLLOWS) == set(admin.ROUTES)
    assert all(isinstance(s, str) and s for s in admin.FOLLOWS.values())
    assert "handlers.py" in admin.FOLLOWS["update_weights_from_disk"]


async def test_cache_and_sleep_answer_as_vllms_cpu_build(tmp_path: Path) -> None:
    engine, _, http = worker(tmp_path)
    async with http:
        assert (await http.post("/reset_prefix_cache")).json() == {"success": True}
        assert (await http.post("/reset_prefix_cache", params={
            "reset_running_requests": "true", "reset_external": "true"})).json() == \
            {"success": True}
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": False}
        said = await http.post("/sleep")
        assert said.status_code == 200 and said.json() == {"status": "sleeping", "level": 1}
        assert engine._mode == "abort"  # vLLM's default mode: abort
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
        assert (await http.post("/sleep", params={"level": "2"})).json()["level"] == 2
        # one pool back: still asleep, still paused
        said = await http.post("/wake_up", params={"tags": "weights"})
        assert said.json() == {"status": "sleeping", "tags": ["weights"]}
        assert await engine.is_paused()
        # a pool that is not asleep: nothing changes (vLLM warns)
        said = await http.post("/wake_up", params={"tags": "weights"})
        assert said.json() == {"status": "sleeping", "tags": ["weights"]}
        said = await http.post("/wake_up", params=[("tags", "kv_cache"), ("tags", "scheduling")])
        assert said.json() == {"status": "awake", "tags": ["kv_cache", "scheduling"]}
        assert not await engine.is_paused()
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": False}
        # level 0: the scheduler only, woken by the scheduling tag
        said = await http.post("/sleep", params={"level": "0", "mode": "keep"})
        assert said.json() == {"status": "sleeping", "level": 0} and engine._mode == "keep"
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
        said = await http.post("/wake_up", params={"tags": "scheduling"})
        assert said.json() == {"status": "awake", "tags": ["scheduling"]}
        assert not await engine.is_paused()
        bad = await http.post("/sleep", params={"level": "3"})
        assert bad.status_code == 400 and "level" in bad.json()["error"]["message"]
        # an rlfleet refresh holds the worker: the calls that change it are refused
        await http.post("/engine/pause_generation", headers={EPOCH_HEADER: "2"})
        for path in ("/sleep", "/wake_up", "/reset_prefix_cache"):
            assert (await http.post(path)).status_code == 409, path
        assert (await http.get("/is_sleeping")).status_code == 200


async def test_prime_rls_server_routes(tmp_path: Path) -> None:
    engine, mock, http = worker(tmp_path)
    ckpt = str(write_mock_checkpoint(tmp_path / "step_3", 3))
    async with http:
        await http.post("/update_weight_version", json={"new_version": "2"})
        resp = await http.post("/update_weights", json={"weight_dir": ckpt})
        assert resp.status_code == 409 and "pause" in resp.json()["error"]
        await http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        resp = await http.post("/update_weights", json={"weight_dir": ckpt})
        assert resp.status_code == 200 and resp.json() == {"status": "ok"}
        applied = engine.applied()
        assert (applied.policy.digest, applied.policy.version) == ("mock:3", "2")  # label stays
        outside = await http.post("/update_weights", json={"weight_dir": "/etc"})
        assert outside.status_code == 400 and "allowed" in outside.json()["error"]["message"]
        nixl = await http.post("/update_weights", json={"weight_dir": None})
        assert nixl.status_code == 400 and "weight_dir is required" in \
            nixl.json()["error"]["message"]
        # neither field: vLLM's own answer for a body without update_info
        missing = await http.post("/update_weights", json={})
        assert missing.status_code == 400
        assert "body.update_info: Field required" in missing.json()["error"]["message"]
        await http.post("/resume")
        assert mock.vllm.admission.hold_reason is None  # the self-check passed
        assert (await http.get("/liveness")).json() == {"status": "ok"}
        refused = await http.post("/init_broadcaster", json={"host": "h", "port": 1})
        assert refused.status_code == 400 and "init_broadcaster" in refused.json()["error"]


async def _tokens(engine: MockEngine, rid: str, adapter: str | None) -> list[int]:
    req = GenerateRequest(request_id=rid, prompt_token_ids=[5, 6, 7], adapter=adapter,
                          sampling=SamplingOptions(max_tokens=6, ignore_eos=True, seed=1))
    ids: list[int] = []
    async for ev in engine.generate(req, list(req.prompt_token_ids)):
        for c in ev.choices if type(ev) is Step else ():
            ids += c.token_ids
    return ids


async def test_skyrls_load_lora_adapter_loads_in_place(tmp_path: Path) -> None:
    """SkyRL 0.3's /skyrl/v1/load_lora_adapter {lora_name, lora_path}: vLLM's load, in place
    (a second load under the name replaces the first); JSON on success (SkyRL reads it as
    text), a bad body refused by name in vLLM's error shape (SkyRL reads error.message)."""
    a1 = make_adapter(tmp_path / "a1", rank=4, seed=1)
    a2 = make_adapter(tmp_path / "a2", rank=4, seed=2)
    engine, _, http = worker(tmp_path, enable_lora=True, max_loras=2)
    async with http:
        base = await _tokens(engine, "b", None)
        ok = await http.post("/skyrl/v1/load_lora_adapter",
                             json={"lora_name": "sky", "lora_path": str(a1)})
        assert ok.status_code == 200 and ok.json() == {"status": "ok", "lora_name": "sky"}
        first = await _tokens(engine, "x1", "sky")
        assert first != base
        again = await http.post("/skyrl/v1/load_lora_adapter",
                                json={"lora_name": "sky", "lora_path": str(a2)})
        assert again.status_code == 200
        second = await _tokens(engine, "x2", "sky")
        assert second not in (first, base)
        for body, named in [({"lora_name": "sky"}, "lora_path"),
                            ({"lora_path": str(a1)}, "lora_name"),
                            ({"lora_name": "", "lora_path": str(a1)}, "lora_name"),
                            ({"lora_name": "sky", "lora_path": str(a1), "load_inplace": False},
                             "load_inplace"),
                            ({"lora_name": 7, "lora_path": str(a1)}, "lora_name")]:
            bad = await http.post("/skyrl/v1/load_lora_adapter", json=body)
            assert bad.status_code == 400, (body, bad.text)
            assert named in bad.json()["error"]["message"], (body, bad.text)
        missing = await http.post("/skyrl/v1/load_lora_adapter",
                                  json={"lora_name": "gone", "lora_path": str(tmp_path / "no")})
        assert missing.status_code == 400 and missing.json()["error"]["message"]
        assert await _tokens(engine, "x3", "sky") == second  # refusals changed nothing
    _, _, plain = worker(tmp_path)  # without LoRA the route is not served
    async with plain:
        assert (await plain.post("/skyrl/v1/load_lora_adapter", json={
            "lora_name": "sky", "lora_path": str(a1)})).status_code == 404


async def test_leaving_a_group_refuses_dynamos_engine_rpc_by_name(tmp_path: Path) -> None:
    _, _, http = worker(tmp_path)
    async with http:
        resp = await http.post("/engine/destroy_weights_update_group",
                               json={"engine_rpc": "destroy_broadcaster"})
        assert resp.status_code == 400 and "'destroy_broadcaster'" in resp.json()["message"]
        said = (await http.post("/engine/destroy_weights_update_group", json={})).json()
        assert said == {"status": "ok", "message": "Weight update group destroyed"}


async def test_vllms_transfer_steps_by_engine_rpc_reach_the_weight_transfer(tmp_path: Path) -> None:
    """NeMo RL's Dynamo refit names vLLM's weight-transfer methods in `engine_rpc`; they run
    the worker's weight-transfer steps, which the mocker (no backend) refuses as its
    update/* routes do; bodies that do not fit a step are refused by name."""
    _, _, http = worker(tmp_path)
    common = {"allow_unpaused": True, "reset_prefix_cache": False}
    async with http:
        # weights are applied only while paused: allow_unpaused is refused by name then
        resp = await http.post("/engine/update_weights_from_distributed", json={
            "engine_rpc": "update_weights", "update_info": {"names": []}, **common})
        assert resp.status_code == 400 and "allow_unpaused" in resp.json()["message"]
        await http.post("/engine/pause_generation")
        for route, body in [
                ("init_weights_update_group", {"engine_rpc": "init_weight_transfer_engine",
                                               "init_info": {"master_address": "h"}}),
                ("update_weights_from_distributed",
                 {"engine_rpc": "start_weight_update", "is_checkpoint_format": True, **common}),
                ("update_weights_from_distributed",
                 {"engine_rpc": "update_weights", "update_info": {"names": []}, **common}),
                ("update_weights_from_distributed",
                 {"engine_rpc": "finish_weight_update", "weight_version": "7", **common}),
                ("destroy_weights_update_group",
                 {"engine_rpc": "shutdown_weight_transfer_engine"})]:
            said = (await http.post(f"/engine/{route}", json=body)).json()
            dynamo17 = (await http.post("/engine/update/start_weight_update")).json()
            assert said["status"] == "error" and "weight-transfer" in said["message"], said
            assert said["message"] == dynamo17["message"]  # the same refusal as update/*
        for route, body, words in [
                ("init_weights_update_group", {"engine_rpc": "init_weight_transfer_engine"},
                 "init_info is required"),
                ("init_weights_update_group", {"engine_rpc": "init_weight_transfer_engine",
                                               "init_info": {}, "master_port": 1},
                 "master_port is rlfleet's own group"),
                ("update_weights_from_distributed", {"engine_rpc": "update_weights"},
                 "update_info is required"),
                ("update_weights_from_distributed",
                 {"engine_rpc": "finish_weight_update", "update_info": {}},
                 "update_info goes with engine_rpc update_weights")]:
            said = (await http.post(f"/engine/{route}", json=body)).json()
            assert said["status"] == "error" and words in said["message"], (body, said)
        resp = await http.post("/engine/update_weights_from_distributed", json={
            "engine_rpc": "start_weight_update", "is_checkpoint_format": False, **common})
        assert resp.status_code == 400 and "is_checkpoint_format" in resp.json()["message"]
