"""The modelexpress weight-transfer backend an rlfleet worker runs itself
(rlfleet.worker.modelexpress, behind vLLM's native routes), in-process on a mocker worker
that declares it: init_info checked as ModelExpress checks it (400 naming the field), the
steps in vLLM's order with vLLM's refusals (500, its words), rlfleet's pause rule (409) and
admin token, and the state table. Staging from S3 and applying: tests/integration/
test_modelexpress_transfer_vllm.py."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from rlfleet.mocker.admin import MockAdmin
from rlfleet.mocker.engine import MockEngine, write_mock_checkpoint
from rlfleet.protocol import modelexpress, vllm_rl
from rlfleet.weights.staging import StagingArea
from rlfleet.worker import modelexpress as mx
from rlfleet.worker.native_rl import NativeRL
from rlfleet.worker.system_server import system_app

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class MxMockEngine(MockEngine):
    """A mocker that declares the backend, as a vLLM worker on the CPU build started with
    --weight-transfer-config '{"backend": "modelexpress"}' does."""

    def own_transfer_backend(self) -> str | None:
        return modelexpress.BACKEND


def worker(tmp_path: Path, token: str | None = None) -> tuple[NativeRL, httpx.AsyncClient]:
    engine = MxMockEngine(seed=4)
    staging = StagingArea(tmp_path / "staging", engine=engine)
    mock = MockAdmin(engine, [str(tmp_path)], staging=staging)
    native = NativeRL(mock.vllm)
    app = system_app(mock.routes(), fence=mock.fence, admin_token=token, mounted=native)
    return native, httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://w", headers=AUTH if token else None)


def init_info(tmp_path: Path, **changes) -> dict:
    seed = write_mock_checkpoint(tmp_path / "seed", seed=4)
    info = {"object_storage_type": "S3", "initial_base_version_id": "seed",
            "seed_checkpoint_path": str(seed), "refit_checkpoint_dir": str(tmp_path / "refit"),
            "object_storage_uri_prefix": "s3://weights/mx",
            "object_storage_endpoint_url": "http://127.0.0.1:1"}
    return {k: v for k, v in {**info, **changes}.items() if v is not None}


def error(resp: httpx.Response) -> str:
    return resp.json()["error"]["message"]


@pytest.mark.parametrize(("changes", "named"), [
    ({"bogus": 1}, "bogus"),
    ({"seed_checkpoint_path": None, "refit_checkpoint_dir": None},
     "seed_checkpoint_path, refit_checkpoint_dir are required"),
    ({"object_storage_uri_prefix": None}, "object_storage_uri_prefix is required"),
    ({"object_storage_type": "NFS"}, "unsupported object_storage_type='NFS'"),
    ({"object_storage_type": "GCS"}, "only S3"),
    ({"object_storage_uri_prefix": "/local/dir"}, "object_storage_uri_prefix"),
    ({"server_url": "mx:8001"}, "server_url"),
    ({"max_transfer_attempts": 0}, "max_transfer_attempts must be positive"),
    ({"rpc_timeout_seconds": "soon"}, "rpc_timeout_seconds"),
    ({"seed_checkpoint_path": "/etc"}, "seed_checkpoint_path"),
])
async def test_init_info_that_does_not_fit_is_a_400_naming_the_field(tmp_path: Path, changes,
                                                                      named) -> None:
    native, http = worker(tmp_path)
    async with http:
        resp = await http.post("/init_weight_transfer_engine",
                               json={"init_info": init_info(tmp_path, **changes)})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["type"] == "BadRequestError"
        assert named in error(resp), error(resp)
        assert native.admin.transfer.modelexpress.state is mx.TransferState.OFF


async def test_steps_in_vllms_order_with_vllms_refusals(tmp_path: Path) -> None:
    native, http = worker(tmp_path, token=TOKEN)
    async with http:
        start = await http.post("/start_weight_update")
        assert start.status_code == 500 and error(start) == mx.NOT_INITIALIZED
        # out of the update's order: vLLM's RL state machine answers 409 before the step runs
        update = await http.post("/update_weights", json={"update_info": {"version_id": "v1"}})
        assert update.status_code == 409 and update.json()["detail"] == \
            vllm_rl.out_of_order("update", False)
        finish = await http.post("/finish_weight_update")
        assert finish.status_code == 409 and "preceding start_weight_update" in \
            finish.json()["detail"]
        unauthorized = await http.post("/init_weight_transfer_engine", headers={"Authorization": ""},
                                       json={"init_info": init_info(tmp_path)})
        assert unauthorized.status_code == 401
        resp = await http.post("/init_weight_transfer_engine",
                               json={"init_info": init_info(tmp_path)})
        assert resp.json() == {"message": "Weight transfer initialized"}
        assert (await http.post("/start_weight_update")).json() == \
            {"message": "Weight update started"}
        again = await http.post("/start_weight_update")
        assert again.status_code == 409 and "already in progress" in again.json()["detail"]
        # rlfleet applies weights only while paused: refused, the update stays open
        unpaused = await http.post("/update_weights", json={"update_info": {"version_id": "v1"}})
        assert unpaused.status_code == 409 and "pause" in error(unpaused)
        busy = await http.post("/shutdown_weight_transfer_engine")
        assert busy.status_code == 500 and error(busy) == mx.IN_UPDATE
        await http.post("/pause", params={"mode": "keep"})
        bad = await http.post("/update_weights", json={"update_info": {"version": "v1"}})
        assert bad.status_code == 400 and "version" in error(bad)
        # as in vLLM, a failed update ends it
        assert native.admin.transfer.modelexpress.state is mx.TransferState.READY
        assert (await http.post("/finish_weight_update")).status_code == 409
        await http.post("/resume")
        assert (await http.post("/shutdown_weight_transfer_engine")).json() == \
            {"message": "Weight transfer shut down"}
        assert (await http.post("/start_weight_update")).status_code == 500  # settings dropped
        assert (await http.get("/weight_info")).json() == {"weight_version": "default"}


async def test_finish_sets_the_label_given(tmp_path: Path) -> None:
    native, http = worker(tmp_path)
    async with http:
        await http.post("/init_weight_transfer_engine", json={"init_info": init_info(tmp_path)})
        await http.post("/start_weight_update")
        resp = await http.post("/finish_weight_update", json={"weight_version": "w2"})
        assert resp.json() == {"message": "Weight update finished"}
        assert (await http.get("/weight_info")).json() == {"weight_version": "w2"}
        assert native.admin.transfer.modelexpress.state is mx.TransferState.READY


async def test_dynamo17_routes_drive_the_same_backend(tmp_path: Path) -> None:
    """/engine/update/* (Dynamo 1.7's names) and vLLM's native routes run the same steps on
    one backend state; /engine answers in the contract's shape, refusals included."""
    native, http = worker(tmp_path)

    async def engine(step: str, body: dict) -> dict:
        resp = await http.post(f"/engine/update/{step}", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()
    async with http:
        bad = await engine("init_weight_transfer_engine",
                           {"init_info": init_info(tmp_path, bogus=1)})
        assert bad["status"] == "error" and "bogus" in bad["message"]
        assert await engine("init_weight_transfer_engine",
                            {"init_info": init_info(tmp_path)}) == {
            "status": "ok", "message": "Weight transfer initialized"}
        assert (await http.post("/start_weight_update")).status_code == 200  # natively
        assert await engine("start_weight_update", {}) == {
            "status": "error", "message": mx.ALREADY_ACTIVE}
        unpaused = await engine("update_weights", {"update_info": {"version_id": "v1"}})
        assert unpaused == {"status": "error", "message": mx.NOT_PAUSED}
        assert await engine("finish_weight_update", {"weight_version": "w3"}) == {
            "status": "ok", "message": "Weight update finished"}
        assert native.admin.transfer.modelexpress.state is mx.TransferState.READY
        said = await http.post("/engine/control/get_weight_version", json={})
        assert said.json() == {"status": "ok", "weight_version": "w3"}
        again = await engine("finish_weight_update", {})
        assert again == {"status": "error", "message": mx.NO_START}


def test_update_info_as_modelexpress_and_vllm_send_it() -> None:
    read = modelexpress.read_update_info
    assert read({"version_id": "v3"}).version_id == "v3"
    assert read([{"version_id": "v3"}, {"version_id": "v3"}]).version_id == "v3"  # per rank
    for bad, why in [({}, "version_id is required"), ({"version_id": " "}, "required"),
                     ({"version_id": "a/b"}, "no '/'"), ([], "empty"),
                     ([{"version_id": "a"}, {"version_id": "b"}], "different versions")]:
        with pytest.raises(ValueError, match=why):
            read(bad)


def test_transitions_are_the_table() -> None:
    t = mx.TransferState
    assert set(mx.TRANSITIONS) == set(t)
    assert mx.TRANSITIONS[t.APPLIED] == {t.READY}  # only finish leaves an applied update
    assert t.APPLIED not in mx.TRANSITIONS[t.READY]  # nothing is applied outside an update
