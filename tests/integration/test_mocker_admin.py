"""The mocker's /engine routes on real `python -m rlfleet.mocker` processes, in both schemas:
the vLLM-flavoured lifecycle (pause, update from a mock checkpoint, version, resume) with
generation through the worker's request plane, pause modes with requests in flight, the
refusals, the admin token, fault injection `exit`; and the SGLang-flavoured table
(control/* routes, DYN_SGLANG_ENGINE_ROUTES allow-list, no `rl` registration).

The mocker is a simulator: these tests check the control contract, not engine behaviour."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlfleet.mocker.admin import EngineRoute, MockAdmin, parse_engine_routes, sglang_result
from rlfleet.mocker.engine import CHECKPOINT_FILE, MockEngine, write_mock_checkpoint
from rlfleet.runtime.discovery import open_discovery
from rlfleet.runtime.launch import Proc, spawn
from rlfleet.testing.fleet import LocalFleet
from rlfleet.worker.system_server import system_app

PROMPT = [1101, 1102, 1103, 1104]
TOKEN = "admin-s3cret"
SGLANG_ROUTES = "pause_generation:tm continue_generation:tm"


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, Path]:
    """Mock checkpoints under an allowed root, and things that are not loadable."""
    base = tmp_path_factory.mktemp("mock-weights")
    root = base / "root"
    outside = write_mock_checkpoint(base / "outside", 13)
    paths = {"root": root, "outside": outside,
             "s7": write_mock_checkpoint(root / "s7", 7),
             "s9": write_mock_checkpoint(root / "s9", 9),
             "empty": root / "empty", "malformed": root / "malformed",
             "link": root / "link-out", "missing": root / "missing"}
    paths["empty"].mkdir()
    paths["malformed"].mkdir()
    (paths["malformed"] / CHECKPOINT_FILE).write_text('{"seed": "seven"}')
    paths["link"].symlink_to(outside, target_is_directory=True)
    return paths


def start_sglang_worker(fleet: LocalFleet, name: str, *extra: str, routes: str = SGLANG_ROUTES) -> Proc:
    """An SGLang-schema mocker; env goes through `spawn` (DYN_SGLANG_ENGINE_ROUTES)."""
    argv = [sys.executable, "-m", "rlfleet.mocker", "--lease-ttl", str(fleet.lease_ttl),
            "--discovery", fleet.discovery, "--namespace", fleet.namespace,
            "--admin-schema", "sglang", *extra]
    p = spawn(name, argv, fleet.workdir / "logs",
              env={**os.environ, "DYN_SGLANG_ENGINE_ROUTES": routes})
    fleet.procs.append(p)
    return p


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, weights):
    """Mockers started together: vLLM schema (RL-enabled), vLLM schema with an admin token,
    vLLM schema with fault injection, SGLang schema (with --enable-rl, which it ignores)."""
    with LocalFleet(tmp_path_factory.mktemp("mock-admin"), lease_ttl=3) as f:
        common = ("--system-port", "0", "--token-delay", "0.02",
                  "--allowed-weights-root", str(weights["root"]))
        f.vllm = f.start_worker(*common, "--enable-rl", "--served-model-name", "mock-v",
                                kind="mocker", wait=False, name="vllm-schema")
        f.token = f.start_worker(*common, "--admin-token", TOKEN, kind="mocker", wait=False,
                                 name="with-token")
        f.faulty = f.start_worker(*common, "--enable-fault-injection", kind="mocker", wait=False,
                                  name="faulty")
        f.sglang = start_sglang_worker(f, "sglang-schema", *common, "--enable-rl",
                                       "--served-model-name", "mock-s")
        for p in (f.vllm, f.token, f.faulty, f.sglang):
            p.wait_ready(60)
        yield f


@pytest.fixture
def vw(fleet) -> Proc:
    """The vLLM-schema worker, resumed after each test."""
    yield fleet.vllm
    call(fleet.vllm, "resume_generation")


@pytest.fixture
def sw(fleet) -> Proc:
    """The SGLang-schema worker, continued after each test."""
    yield fleet.sglang
    call(fleet.sglang, "continue_generation")


# ---------------------------------------------------------------- helpers


def call(proc: Proc, route: str, body: Any = None, token: str | None = None,
         method: str = "POST") -> dict:
    """POST {system_url}/engine/<route>; asserts HTTP 200 and returns the body."""
    resp = raw_call(proc, route, body, token, method)
    assert resp.status_code == 200, (route, resp.status_code, resp.text)
    return resp.json()


def raw_call(proc: Proc, route: str, body: Any = None, token: str | None = None,
             method: str = "POST") -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, f"{proc.ready['system_url']}/engine/{route}",
                         json=body if body is not None else {}, headers=headers, timeout=10)


def generate(proc: Proc, max_tokens: int = 8, seed: int = 5) -> tuple[dict, list[int], str]:
    """One non-streaming request on the request plane: (first event, token IDs, finish)."""
    resp = httpx.post(f"{proc.ready['url']}/generate", timeout=15, json={
        "request_id": uuid.uuid4().hex, "prompt_token_ids": PROMPT, "stream": False,
        "sampling": {"max_tokens": max_tokens, "ignore_eos": True, "seed": seed}})
    assert resp.status_code == 200, resp.text
    events = [json.loads(line) for line in resp.text.splitlines() if line]
    assert events[-1].get("done")
    (choice,) = [c for ev in events[1:-1] for c in ev["choices"]]
    return events[0], choice["token_ids"], choice["finish_reason"]


class Stream:
    """A streaming request in a task, collecting tokens as they arrive."""

    def __init__(self, proc: Proc, max_tokens: int, seed: int = 5) -> None:
        self.head: dict | None = None
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.task = asyncio.create_task(self._run(proc, max_tokens, seed))

    async def _run(self, proc: Proc, max_tokens: int, seed: int) -> None:
        body = {"request_id": uuid.uuid4().hex, "prompt_token_ids": PROMPT, "stream": True,
                "sampling": {"max_tokens": max_tokens, "ignore_eos": True, "seed": seed}}
        async with httpx.AsyncClient(timeout=30) as c, \
                c.stream("POST", f"{proc.ready['url']}/generate", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line:
                    continue
                ev = json.loads(line)
                if self.head is None:
                    self.head = ev
                for ch in ev.get("choices", []):
                    self.tokens += ch["token_ids"]
                    self.finish = ch["finish_reason"] or self.finish

    async def until_tokens(self, n: int, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while len(self.tokens) < n:
            assert not self.task.done(), "the request ended early"
            assert time.monotonic() < deadline, f"{len(self.tokens)} tokens, waited for {n}"
            await asyncio.sleep(0.01)

    async def done(self, timeout: float = 10) -> None:
        await asyncio.wait_for(self.task, timeout)


async def acall(proc: Proc, route: str, body: Any = None) -> dict:
    async with httpx.AsyncClient(timeout=30) as c:
        resp = await c.post(f"{proc.ready['system_url']}/engine/{route}", json=body or {})
    assert resp.status_code == 200, resp.text
    return resp.json()


async def until_running(proc: Proc, n: int, timeout: float = 10) -> None:
    """Until the worker's engine holds `n` requests (its request-plane metrics)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as c:
        while True:
            text = (await c.get(f"{proc.ready['url']}/metrics")).text
            m = re.search(r"^rlfleet_worker_running_requests(?:{[^}]*})? (\S+)$", text, re.M)
            if m and float(m.group(1)) == n:
                return
            assert time.monotonic() < deadline, f"the worker never held {n} requests"
            await asyncio.sleep(0.01)


def not_found(route: str) -> dict:
    return {"error": "Route not found", "message": f"Route /engine/{route} not found"}


# ---------------------------------------------------------------- vLLM schema


def test_vllm_route_table(vw) -> None:
    resp = httpx.get(f"{vw.ready['system_url']}/engine", timeout=5)
    assert resp.json() == {"routes": sorted([
        "abort_request", "destroy_weights_update_group", "flush_cache", "get_weight_version",
        "init_weights_update_group", "liveness_probe", "pause_generation", "resume_generation",
        "set_admission", "set_weight_version", "update_weights_from_disk",
        "update_weights_from_distributed", "stage_weights", "get_staged_weights",
        "apply_staged_weights", "release_staged_weights",
        # Dynamo 1.7's names (issue 22)
        "control/pause_generation", "control/resume_generation", "control/is_paused",
        "control/get_weight_version", "update/update_weight_version", "collective_rpc",
        "update/init_weight_transfer_engine", "update/start_weight_update",
        "update/update_weights", "update/finish_weight_update",
        # one call per worker for a synchronous refresh, and the relay tree (issue 35)
        "commit_policy", "relay"])}
    assert call(vw, "liveness_probe") == {"status": "ok", "alive": True}
    assert call(vw, "flush_cache") == {"status": "ok", "message": "Cache flushed"}
    assert call(vw, "liveness_probe", method="GET")["alive"] is True
    for route in ("control/update_weights_from_disk", "control/continue_generation"):
        resp = raw_call(vw, route)
        assert resp.status_code == 404 and resp.json() == not_found(route)
    # SGLang's names slime sends under /engine (issue 42): served, not listed
    assert call(vw, "continue_generation")["status"] == "ok"


def test_vllm_lifecycle_from_disk(vw, weights) -> None:
    """The reference script's shape: pause(wait) -> update -> version -> resume, and
    generation on the request plane changes with the weights."""
    head0, before, _ = generate(vw)
    assert head0["weight_digest"] == "mock:0" and head0["weight_version"] is None
    assert call(vw, "get_weight_version") == {"status": "ok", "version": None,
                                              "version_declared": False,
                                              "weight_version": None,
                                              "weight_digest": "mock:0", "step": None,
                                              "fleet_epoch": 0}

    assert call(vw, "pause_generation", {"mode": "wait", "clear_cache": False}) == {
        "status": "ok", "message": "Engine paused", "mode": "wait", "clear_cache": False}
    out = call(vw, "update_weights_from_disk",
               {"model_path": str(weights["s7"]), "weight_version": "step-42", "step": 42})
    assert out == {"status": "ok", "version": "step-42", "version_declared": True,
                   "weight_digest": "mock:7", "step": 42}
    assert call(vw, "get_weight_version") == {"status": "ok", "version": "step-42",
                                              "version_declared": True,
                                              "weight_version": "step-42",
                                              "weight_digest": "mock:7", "step": 42,
                                              "fleet_epoch": 0}
    assert call(vw, "resume_generation") == {"status": "ok", "message": "Engine resumed"}

    head1, after, finish = generate(vw)
    assert (head1["weight_digest"], head1["weight_version"]) == ("mock:7", "step-42")
    assert head1["weight_step"] == 42
    assert len(after) == 8 and finish == "length" and after != before
    health = httpx.get(f"{vw.ready['system_url']}/health", timeout=5).json()
    assert (health["weight_version"], health["weight_digest"]) == ("step-42", "mock:7")
    assert health["weight_step"] == 42

    # an update without a version: "unknown", undeclared; then versions as metadata only
    call(vw, "pause_generation")
    assert call(vw, "update_weights_from_disk", {"model_path": str(weights["s9"])}) == {
        "status": "ok", "version": "unknown", "version_declared": False,
        "weight_digest": "mock:9", "step": None}  # new weights without a step: unknown
    assert call(vw, "get_weight_version") == {"status": "ok", "version": None,
                                              "version_declared": False,
                                              "weight_version": None,
                                              "weight_digest": "mock:9", "step": None,
                                              "fleet_epoch": 0}
    assert call(vw, "set_weight_version", {"weight_version": "named", "step": 9}) == \
        {"status": "ok", "version": "named", "step": 9}
    assert call(vw, "set_weight_version", {"weight_version": None}) == \
        {"status": "ok", "version": None, "step": 9}  # a relabel keeps the step
    assert call(vw, "get_weight_version") == {"status": "ok", "version": None,
                                              "version_declared": True,
                                              "weight_version": None,
                                              "weight_digest": "mock:9", "step": 9,
                                              "fleet_epoch": 0}
    assert call(vw, "set_weight_version", {"weight_version": "x", "step": -1})["message"] \
        .startswith("step must be a non-negative integer")
    assert call(vw, "set_weight_version", {})["message"].startswith("weight_version is required")
    assert call(vw, "set_weight_version", {"weight_version": 3})["status"] == "error"
    call(vw, "resume_generation")
    head2, again, _ = generate(vw)
    assert head2["weight_digest"] == "mock:9" and again not in (before, after)


async def test_pause_keep_freezes_and_continues(vw) -> None:
    # 150 tokens (3 s of token delays): the pause lands mid-request, however busy the box
    reference = Stream(vw, 150, seed=11)
    await reference.done()
    s = Stream(vw, 150, seed=11)
    await s.until_tokens(3)
    assert await acall(vw, "pause_generation", {"mode": "keep"}) == {
        "status": "ok", "message": "Engine paused", "mode": "keep", "clear_cache": False}
    frozen = len(s.tokens)
    await asyncio.sleep(0.3)  # 15 token delays: a running request would have moved on
    assert len(s.tokens) <= frozen + 1 and not s.task.done()
    await acall(vw, "resume_generation")
    await s.done()
    assert s.finish == "length" and s.tokens == reference.tokens


async def test_pause_wait_lets_running_requests_finish_and_holds_new_ones(vw) -> None:
    s = Stream(vw, 20)
    await s.until_tokens(3)
    out = await acall(vw, "pause_generation", {"mode": "wait", "clear_cache": True})
    assert out == {"status": "ok", "message": "Engine paused", "mode": "wait",
                   "clear_cache": True}
    await s.done(5)  # finished while the engine stays paused
    assert s.finish == "length" and len(s.tokens) == 20
    held = Stream(vw, 4)
    await until_running(vw, 1)
    await asyncio.sleep(0.1)
    assert held.head is None and not held.task.done()
    await acall(vw, "resume_generation")
    await held.done()
    assert len(held.tokens) == 4 and held.finish == "length"


async def test_pause_abort_ends_running_requests_with_partial_output(vw) -> None:
    s = Stream(vw, 40)
    await s.until_tokens(3)
    assert (await acall(vw, "pause_generation", {"mode": "abort"}))["mode"] == "abort"
    await s.done(5)  # ended while the engine stays paused
    assert s.finish == "abort" and 3 <= len(s.tokens) < 40
    await acall(vw, "resume_generation")


def test_vllm_refusals(vw, weights) -> None:
    digest = call(vw, "get_weight_version")["weight_digest"]
    ckpt = {"model_path": str(weights["s7"])}
    out = call(vw, "update_weights_from_disk", ckpt)
    assert out == {"status": "error",
                   "message": "generation is not paused: call pause_generation first"}
    assert call(vw, "pause_generation", {"mode": "slow"}) == {
        "status": "error", "message": "Invalid mode 'slow'; expected keep|wait|abort"}
    assert call(vw, "pause_generation", {"clear_cache": "yes"}) == {
        "status": "error", "message": "clear_cache must be a boolean"}
    call(vw, "pause_generation")

    def refused(body: dict, words: str) -> None:
        out = call(vw, "update_weights_from_disk", body)
        assert out["status"] == "error" and words in out["message"], out

    refused({}, "model_path is required")
    refused({"model_path": str(weights["missing"])}, "does not exist or is not a directory")
    refused({"model_path": str(weights["outside"])}, "outside the allowed weights roots")
    refused({"model_path": str(weights["link"])}, "outside the allowed weights roots")
    refused({"model_path": str(weights["empty"])},
            "does not fit the served model's architecture")
    refused({"model_path": str(weights["malformed"])},
            "does not fit the served model's architecture")
    refused({**ckpt, "weight_version": 5}, "weight_version must be a string")
    assert call(vw, "get_weight_version")["weight_digest"] == digest  # nothing changed

    assert call(vw, "abort_request", {})["status"] == "error"
    assert call(vw, "abort_request", {"request_id": "no-such"}) == \
        {"status": "ok", "request_id": "no-such"}


def test_vllm_distributed_update(vw) -> None:
    tensors = {"names": ["w"], "dtypes": ["float32"], "shapes": [[4, 4]], "mock_seed": 21}
    group = {"master_address": "127.0.0.1", "master_port": 29999, "world_size": 2}

    def err(route: str, body: dict, words: str) -> None:
        out = call(vw, route, body)
        assert out["status"] == "error" and words in out["message"], out

    call(vw, "destroy_weights_update_group")
    err("update_weights_from_distributed", tensors, "call init_weights_update_group first")
    err("init_weights_update_group", {}, "master_address (string), master_port (int) and "
                                         "world_size (int) are required")
    err("init_weights_update_group", {**group, "rank_offset": 2}, "rank_offset must be")
    err("init_weights_update_group", {**group, "backend": "mpi"}, "backend must be gloo or nccl")
    err("init_weights_update_group", {**group, "timeout": 0}, "timeout must be a positive")
    assert call(vw, "init_weights_update_group", group) == {
        "status": "ok", "message": "Weight update group initialized"}

    err("update_weights_from_distributed", {**tensors, "shapes": []},
        "names, dtypes and shapes are required")
    err("update_weights_from_distributed", {**tensors, "mock_seed": None}, "mock_seed is required")
    err("update_weights_from_distributed", {**tensors, "allow_unpaused": True},
        "allow_unpaused cannot be combined with reset_prefix_cache")
    err("update_weights_from_distributed", tensors, "generation is not paused")

    call(vw, "pause_generation")
    assert call(vw, "update_weights_from_distributed",
                {**tensors, "weight_version": "d-1", "step": 5}) == {
        "status": "ok", "version": "d-1", "version_declared": True, "weight_digest": "mock:21",
        "step": 5}
    call(vw, "resume_generation")
    assert generate(vw)[0]["weight_digest"] == "mock:21"
    # allow_unpaused without the cache reset: applied while generating
    out = call(vw, "update_weights_from_distributed",
               {**tensors, "mock_seed": 22, "allow_unpaused": True, "reset_prefix_cache": False})
    assert out == {"status": "ok", "version": "unknown", "version_declared": False,
                   "weight_digest": "mock:22", "step": None}
    assert call(vw, "destroy_weights_update_group") == {
        "status": "ok", "message": "Weight update group destroyed"}
    err("update_weights_from_distributed", tensors, "call init_weights_update_group first")


def test_admin_token(fleet) -> None:
    w = fleet.token
    for token in (None, "wrong"):
        resp = raw_call(w, "pause_generation", token=token)
        assert resp.status_code == 401 and resp.json()["error"] == "Unauthorized"
    assert call(w, "pause_generation", token=TOKEN)["status"] == "ok"
    # reads need no token
    assert call(w, "liveness_probe") == {"status": "ok", "alive": True}
    assert call(w, "get_weight_version")["status"] == "ok"
    assert raw_call(w, "resume_generation").status_code == 401
    assert call(w, "resume_generation", token=TOKEN)["status"] == "ok"


def test_fault_injection_exit_ends_the_process(fleet) -> None:
    w = fleet.faulty
    assert call(w, "fault_injection", {"route": "liveness_probe", "mode": "exit"}) == {
        "status": "ok", "route": "liveness_probe", "mode": "exit", "times": 1}
    with pytest.raises(httpx.TransportError):
        raw_call(w, "liveness_probe")
    assert w.popen.wait(10) == 17


# ---------------------------------------------------------------- SGLang schema


def test_engine_route_descriptors() -> None:
    assert parse_engine_routes(None) == parse_engine_routes("  ") == []
    assert parse_engine_routes("pause_generation:tm  flush_cache\nadmin/v=get_weight_version:engine") == [
        EngineRoute("pause_generation", "pause_generation", "tm"),
        EngineRoute("flush_cache", "flush_cache", "engine"),
        EngineRoute("admin/v", "get_weight_version", "engine")]
    for raw, words in [("=m", "both the route path and method"), ("r=", "both the route"),
                       ("r=a=b", "at most one '='"), ("r:tm:engine", "at most one ':'"),
                       ("r:gpu", "unknown target"), ("/r=m", "route path"), ("r/=m", "route path"),
                       ("r=bad-name", "Python identifier"), ("r=_private", "private methods"),
                       ("r r=m", "configured more than once")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            parse_engine_routes(raw)


def test_native_result_mapping() -> None:
    assert sglang_result(None) == {"status": "ok"}
    assert sglang_result((True, "done")) == {"success": True, "message": "done"}
    assert sglang_result((False, "busy", 3)) == {"success": False, "message": "busy",
                                                 "num_paused_requests": 3}
    assert sglang_result({"weight_version": "v"}) == {"weight_version": "v"}
    assert sglang_result(7) == {"result": 7}



def test_sglang_route_table(sw) -> None:
    resp = httpx.get(f"{sw.ready['system_url']}/engine", timeout=5)
    assert resp.json() == {"routes": [
        "continue_generation", "control/update_weight_version",
        "control/update_weights_from_disk", "control/update_weights_from_distributed",
        "control/update_weights_from_ipc", "control/update_weights_from_tensor",
        "pause_generation", "relay", "set_admission"]}
    for route in ("flush_cache", "get_weight_version", "resume_generation", "liveness_probe",
                  "update_weights_from_disk", "control/pause_generation"):
        resp = raw_call(sw, route)
        assert resp.status_code == 404 and resp.json() == not_found(route)
    for route in ("control/update_weights_from_tensor", "control/update_weights_from_distributed"):
        out = call(sw, route, {"names": ["w"]})
        assert out["success"] is False and "not supported by the mocker" in out["message"]


async def test_sglang_reference_flow(sw, weights) -> None:
    """pause_generation -> control/update_weights_from_disk (flush_cache, keep_pause) ->
    continue_generation, as in the reference document."""
    _, before, _ = generate(sw)
    running = Stream(sw, 40)
    await running.until_tokens(2)
    assert await acall(sw, "pause_generation") == {"status": "ok"}
    await running.done(5)
    assert running.finish == "abort"  # SGLang's default pause mode aborts running requests
    held = Stream(sw, 4)
    await until_running(sw, 1)

    out = await acall(sw, "control/update_weights_from_disk", {
        "model_path": str(weights["s7"]), "weight_version": "step-42", "step": 42,
        "flush_cache": True, "keep_pause": True})
    assert out == {"success": True, "message": "Succeeded to update model weights. Weight "
                                               "version updated to step-42.",
                   "num_paused_requests": 1}
    await asyncio.sleep(0.1)
    assert held.head is None  # still paused
    health = httpx.get(f"{sw.ready['system_url']}/health", timeout=5).json()
    assert (health["weight_version"], health["weight_digest"]) == ("step-42", "mock:7")
    assert health["weight_step"] == 42

    assert await acall(sw, "continue_generation", {"torch_empty_cache": False}) == \
        {"status": "ok"}
    await held.done()
    assert (held.head["weight_digest"], held.head["weight_version"]) == ("mock:7", "step-42")
    head, after, _ = generate(sw)
    assert head["weight_digest"] == "mock:7" and after != before


def test_sglang_update_without_a_prior_pause(sw, weights) -> None:
    call(sw, "control/update_weight_version", {"weight_version": "v1"})
    out = call(sw, "control/update_weights_from_disk", {"model_path": str(weights["s9"])})
    assert out == {"success": True, "message": "Succeeded to update model weights.",
                   "num_paused_requests": 0}
    # it paused itself around the update and resumed; the version stays without a new one
    head, tokens, finish = generate(sw, max_tokens=3)
    assert (head["weight_digest"], head["weight_version"]) == ("mock:9", "v1")
    assert len(tokens) == 3 and finish == "length"

    out = call(sw, "control/update_weights_from_disk",
               {"model_path": str(weights["s7"]), "keep_pause": True, "abort_all_requests": True})
    assert out["success"] is True
    # keep_pause: now paused, so a request waits until continue_generation
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{sw.ready['url']}/generate", timeout=0.3, json={
            "request_id": uuid.uuid4().hex, "prompt_token_ids": PROMPT, "stream": False,
            "sampling": {"max_tokens": 1}})
    call(sw, "continue_generation")
    assert generate(sw, max_tokens=2)[0]["weight_digest"] == "mock:7"


def test_sglang_refusals_and_version(sw, weights) -> None:
    def refused(body: dict, words: str) -> None:
        out = call(sw, "control/update_weights_from_disk", body)
        assert out["success"] is False and out["num_paused_requests"] == 0, out
        assert words in out["message"], out

    refused({}, "model_path is required")
    refused({"model_path": str(weights["outside"])}, "outside the allowed weights roots")
    refused({"model_path": str(weights["malformed"])}, "does not fit")
    refused({"model_path": str(weights["s7"]), "keep_pause": "yes"}, "keep_pause must be a boolean")
    assert call(sw, "control/update_weight_version", {"weight_version": "v2"}) == {
        "success": True, "message": "Weight version updated to v2", "new_version": "v2"}
    assert call(sw, "control/update_weight_version", {})["success"] is False
    # a native method with a bad argument: a 400 naming it (issue 43; it was a 500)
    resp = raw_call(sw, "pause_generation", {"mode": "sideways"})
    assert resp.status_code == 400 and resp.json()["error"] == "Bad request"
    assert "mode" in resp.json()["message"] and "sideways" in resp.json()["message"]
    resp = raw_call(sw, "continue_generation", {"unknown": 1})
    assert resp.status_code == 400 and "unknown" in resp.json()["message"]


async def test_sglang_pause_in_place_keeps_running_requests(sw) -> None:
    s = Stream(sw, 150)  # ~3 s of tokens: a pause call that a loaded box delays still finds it
    await s.until_tokens(2)
    assert await acall(sw, "pause_generation", {"mode": "in_place"}) == {"status": "ok"}
    await asyncio.sleep(0.2)
    assert not s.task.done()
    await acall(sw, "continue_generation")
    await s.done()
    assert s.finish == "length" and len(s.tokens) == 150


async def test_sglang_other_native_methods_in_process() -> None:
    admin = MockAdmin(MockEngine(seed=4), schema="sglang",
                      engine_routes="fc=flush_cache weights/version=get_weight_version:tm")
    app = system_app(admin.routes(), admin_token=TOKEN)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c:
        resp = await c.post("/engine/fc", headers={"Authorization": f"Bearer {TOKEN}"})
        assert resp.json() == {"success": True, "message": "Cache flushed."}
        assert (await c.post("/engine/fc")).status_code == 401
        await c.post("/engine/control/update_weight_version", json={"new_version": "n1"},
                     headers={"Authorization": f"Bearer {TOKEN}"})
        resp = await c.get("/engine/weights/version")  # a read: no token needed
        assert resp.json() == {"weight_version": "n1"}
        assert (await c.get("/engine/flush_cache")).status_code == 404


async def test_sglang_worker_is_not_in_rl_discovery(fleet) -> None:
    async with open_discovery(fleet.discovery) as d:
        rl = {e["instance_id"] for e in await d.list(endpoint="rl")}
        served = {e["instance_id"] for e in await d.list(endpoint="generate")}
    sglang_id, vllm_id = (int(p.ready["instance_id"]) for p in (fleet.sglang, fleet.vllm))
    assert sglang_id in served and sglang_id not in rl
    assert vllm_id in rl  # the vLLM-schema worker started with --enable-rl is listed
    assert "--enable-rl ignored" in fleet.sglang.log_path.read_text()


@pytest.mark.parametrize(("routes", "words"), [
    ("pause_generation:tm resume_everything:tm", "has no method 'resume_everything'"),
    ("pause_generation:worker", "unknown target 'worker'"),
    ("p=pause_generation p=continue_generation", "configured more than once"),
    ("control/update_weights_from_disk=flush_cache", "already taken"),
])
def test_sglang_worker_refuses_bad_engine_routes(fleet, routes: str, words: str) -> None:
    p = start_sglang_worker(fleet, f"bad-routes-{abs(hash(routes))}", "--system-port", "0",
                            routes=routes)
    assert p.popen.wait(30) == 2
    deadline = time.monotonic() + 5  # the log is written by a reader thread
    while words not in p.log_path.read_text():
        assert time.monotonic() < deadline, p.tail()
        time.sleep(0.05)
