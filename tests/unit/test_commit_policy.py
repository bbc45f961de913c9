"""commit_policy (an rlfleet extension): one admin call that closes, pauses, installs,
resets, verifies and resumes a worker, each step through the worker's own route under its
rules (armed faults, the fleet epoch), stopping at the first that fails; and the refresh
coordinator's reading of it (rlfleet.refresh.control.WorkerControl.commit), which judges and
journals each step as the step's own call. In-process, over the mocker's simulated
engine."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from rlfleet.mocker.admin import MockAdmin
from rlfleet.mocker.engine import MockEngine, write_mock_checkpoint
from rlfleet.protocol import admin, admin_faults
from rlfleet.protocol.admin import read_request
from rlfleet.protocol.admin_base import AdminRequestError
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.refresh.control import Channel, FleetFenced, FleetWorker, VllmControl
from rlfleet.refresh.policy import Policy
from rlfleet.worker.admission import Admission
from rlfleet.worker.system_server import FaultInjector, Route, system_app

STEPS = ["gate", "pause", "apply", "reset_cache", "verify", "verify", "resume"]


class Worker:
    """A mocker worker's system server in-process: its engine, admission and faults."""

    def __init__(self, root: Path) -> None:
        self.engine = MockEngine(seed=1)
        self.admission = Admission()
        self.faults = FaultInjector()
        mock = MockAdmin(self.engine, [str(root)])
        routes = mock.routes() + [Route(admin.SET_ADMISSION, self.admission.set_admission)]
        self.app = system_app(routes, faults=self.faults, fence=mock.fence)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                 base_url="http://w")

    async def arm(self, route: str, mode: str = "error", **kw) -> None:
        await self.faults.arm(admin_faults.FaultRequest(route=route, mode=mode, **kw))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_mock_checkpoint(tmp_path / "B", 2)


def body(ckpt: Path, **over) -> dict:
    return {"install": "update_weights_from_disk",
            "body": {"model_path": str(ckpt), "weight_version": "B", "step": 3},
            "expect_version": "B", "expect_digest": "mock:2", "close_reason": "refresh to B",
            **over}


async def test_one_call_moves_the_worker_and_answers_with_its_identity(tmp_path, ckpt):
    w = Worker(tmp_path)
    async with w.client() as http:
        r = (await http.post("/engine/commit_policy", json=body(ckpt))).json()
    assert r["status"] == "ok", r
    assert [s["step"] for s in r["steps"]] == STEPS
    assert all(s["http_status"] == 200 for s in r["steps"])
    assert (r["version"], r["weight_digest"], r["step"]) == ("B", "mock:2", 3)
    assert not await w.engine.is_paused()  # resumed
    assert w.admission.gated and w.admission.gate_reason == "refresh to B"  # closed: the
    # coordinator reopens it once the fleet is probed


async def test_it_stops_at_the_first_step_that_fails(tmp_path, ckpt):
    w = Worker(tmp_path)
    await w.arm("pause_generation")
    async with w.client() as http:
        r = (await http.post("/engine/commit_policy", json=body(ckpt))).json()
        assert r["status"] == "error" and r["failed_step"] == "pause"
        assert [s["step"] for s in r["steps"]] == ["gate", "pause"]
        assert "injected failure of pause_generation" in r["message"]
        assert w.engine.applied().policy.digest == "mock:1"  # nothing installed

        await w.arm("update_weights_from_disk", "http500")
        r = (await http.post("/engine/commit_policy", json=body(ckpt))).json()
        assert r["failed_step"] == "apply" and r["steps"][-1]["http_status"] == 500
        assert await w.engine.is_paused()  # left paused, as a failed transfer leaves it

        # a version the worker does not report: verify fails, nothing resumes
        await w.arm("get_weight_version", "respond",
                    body={"status": "ok", "version": "B", "weight_digest": "mock:999"})
        r = (await http.post("/engine/commit_policy", json=body(ckpt))).json()
        assert r["failed_step"] == "verify" and "mock:999" in r["message"]
        assert [s["step"] for s in r["steps"]][-1] == "verify" and await w.engine.is_paused()


async def test_an_older_fleet_epoch_is_refused_before_any_step(tmp_path, ckpt):
    w = Worker(tmp_path)
    async with w.client() as http:
        assert (await http.post("/engine/flush_cache", headers={"X-Fleet-Epoch": "5"})
                ).status_code == 200
        r = await http.post("/engine/commit_policy", json=body(ckpt),
                            headers={"X-Fleet-Epoch": "4"})
    assert r.status_code == 409 and r.json()["newest_fleet_epoch"] == 5
    assert w.engine.applied().policy.digest == "mock:1" and not w.admission.gated


@pytest.mark.parametrize(("over", "words"), [
    ({"install": "flush_cache"}, "is not an install route"),
    ({"body": {"model_path": "/w/B", "chain": True}},
     "body \\(the update_weights_from_disk request\\): .*unknown field 'chain'"),
    ({"expect_digest": ""}, "expect_digest is required"),
    ({"pause_mode": "later"}, "pause_mode must be one of"),
    ({"deadline_s": 0}, "deadline_s must be a positive"),
])
def test_a_bad_commit_is_refused_by_what_to_fix(ckpt, over, words):
    with pytest.raises(AdminRequestError, match=words):
        read_request(admin.COMMIT_POLICY, body(ckpt, **over))


async def test_the_coordinator_judges_and_journals_each_step(tmp_path, ckpt):
    w = Worker(tmp_path)
    target = Policy(PolicyIdentity(version="B", digest="mock:2", step=3), path=str(ckpt))
    control = VllmControl("http://rl")
    async with w.client() as http:
        ch = Channel(http, 10.0)
        fw = FleetWorker(1, "http://w", None, routes=frozenset({admin.COMMIT_POLICY.name}))
        assert control.commits(fw, target)
        assert await control.commit(ch, fw, target, "refresh to B", "wait") == (False, None)
        assert fw.active and fw.holds == target.identity
        assert [c["step"] for c in fw.calls] == STEPS
        assert {c["via"] for c in fw.calls} == {"commit_policy"}

        await w.arm("flush_cache")  # a failed step excludes the worker, named as its own call
        again = FleetWorker(1, "http://w", None, routes=fw.routes)
        assert await control.commit(ch, again, target, "refresh to B", "wait") == (False, None)
        assert again.status == "excluded" and again.reason.startswith("cache reset failed")

        await w.arm("update_weights_from_disk")  # the transfer's failure: the failure policy's
        third = FleetWorker(1, "http://w", None, routes=fw.routes)
        failed, _ = await control.commit(ch, third, target, "refresh to B", "wait")
        assert failed and third.active and "transfer failed" in third.reason

        stale = Channel(http, 10.0, epoch=0)
        await http.post("/engine/flush_cache", headers={"X-Fleet-Epoch": "9"})
        with pytest.raises(FleetFenced, match="refused commit_policy"):
            await control.commit(stale, FleetWorker(1, "http://w", None, routes=fw.routes),
                                 target, "refresh to B", "wait")

    legacy = FleetWorker(2, "http://w", None, routes=frozenset({"pause_generation"}))
    assert not control.commits(legacy, target)  # no route: the lifecycle calls each step
    assert not VllmControl("http://rl", distributed=True).commits(fw, target)
