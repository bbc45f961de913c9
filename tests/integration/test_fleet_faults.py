"""The session's two-worker vLLM fleet (conftest's vllm_fleet: etcd discovery, the RL
listener probing with a 2 s timeout): the RL listener, request-ID retries, client
disconnects, and a worker killed mid-stream. The kill comes last (tests run in order)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import httpx
import pytest

from rlfleet.runtime.launch import spawn
from tests.fleets import (
    MODEL_NAME,
    RL_PROBE_ENV,
    VLLM_FLEET_LEASE,
    fleet_metric,
    wait_for_workers,
    worker_metric,
)

pytestmark = [pytest.mark.engine, pytest.mark.kills_session_worker]

MODEL = MODEL_NAME
LEASE = VLLM_FLEET_LEASE
ROUTES = sorted(["abort_request", "destroy_weights_update_group", "flush_cache",
                 "get_weight_version", "init_weights_update_group", "liveness_probe",
                 "pause_generation", "resume_generation", "set_admission", "set_weight_version",
                 "update_weights_from_disk", "update_weights_from_distributed",
                 # staged weights (issue 11)
                 "stage_weights", "get_staged_weights", "apply_staged_weights",
                 "release_staged_weights",
                 # Dynamo 1.7's names (issue 22)
                 "control/pause_generation", "control/resume_generation",
                 "control/is_paused", "control/get_weight_version",
                 "update/update_weight_version", "collective_rpc",
                 "update/init_weight_transfer_engine", "update/start_weight_update",
                 "update/update_weights", "update/finish_weight_update",
                 # the relay tree (issue 35)
                 "relay",
                 # a worker moved in one call per refresh (issue 35)
                 "commit_policy"])


@pytest.fixture(scope="module")
def fleet(vllm_fleet):
    """The session's fleet: a test here kills one of its workers, which the next module
    that takes vllm_fleet finds replaced."""
    return vllm_fleet


def rl_workers(fleet) -> list[dict]:
    r = httpx.get(f"{fleet.rl_url}/v1/rl/workers", timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["protocol_version"] == 1 and body["namespace"] == "dynamo"
    return body["workers"]


def test_rl_listener_lists_both_workers(fleet):
    workers = rl_workers(fleet)
    by_id = {w["instance_id"]: w for w in workers}
    assert set(by_id) == {int(p.ready["instance_id"]) for p in fleet.workers}
    for p in fleet.workers:
        w = by_id[int(p.ready["instance_id"])]
        assert w["system_url"] == p.ready["system_url"]
        assert w["model"] == MODEL and w["routes"] == ROUTES
        assert (w["namespace"], w["component"], w["endpoint"]) == ("dynamo", "backend", "rl")
        assert w["request_plane_url"] == "dyn://dynamo.backend.rl"
        assert len(w["transport"]) == 1 and "error" not in w
        # Dynamo 1.7: vLLM's native RL routes are on the system server; one rank (TP=PP=DP=1)
        assert w["admin_base_url"] == p.ready["system_url"] and w["world_size"] == 1
    assert httpx.get(f"{fleet.url}/v1/rl/workers", timeout=5).status_code == 404
    # the control plane is not reachable through the frontend
    for port_url in (fleet.url, fleet.rl_url):
        r = httpx.post(f"{port_url}/engine/pause_generation", json={}, timeout=5)
        assert r.status_code == 404
    for path in ("/v1/rl/engine", "/v1/rl/engines"):
        assert httpx.get(f"{fleet.rl_url}{path}", timeout=5).status_code == 404


def test_hung_worker_stays_listed_with_an_error(fleet):
    """A listener probes a worker's routes once in the worker's life: a fresh listener (its
    own frontend over the fleet's store) whose first probe of a worker hangs lists that
    worker with an error, after its probe timeout, not after the hang."""
    hung = fleet.workers[0]
    r = httpx.post(f"{hung.ready['system_url']}/engine/fault_injection",
                   json={"route": "engine", "mode": "hang", "hang_seconds": 10, "times": 1},
                   timeout=5)
    assert r.json()["status"] == "ok"
    argv = [sys.executable, "-m", "rlfleet.frontend", "--http-port", "0", "--enable-rl",
            "--rl-port", "0", "--discovery", fleet.discovery, "--namespace", fleet.namespace]
    listener = spawn("frontend-fresh-listener", argv, fleet.workdir / "logs",
                     env={**os.environ, **RL_PROBE_ENV})
    try:
        listener.wait_ready(60)
        t0 = time.monotonic()
        r = httpx.get(f"{listener.ready['rl_url']}/v1/rl/workers", timeout=30)
        assert time.monotonic() - t0 < 8  # the probe timeout (2 s), not the hang
        workers = {w["instance_id"]: w for w in r.json()["workers"]}
    finally:
        listener.stop()
    w = workers[int(hung.ready["instance_id"])]
    assert w["routes"] == [] and "failed" in w["error"]
    other = workers[int(fleet.workers[1].ready["instance_id"])]
    assert other["routes"] == ROUTES and "error" not in other
    # the fleet's own listener probed both before: it lists them as they are
    assert all("error" not in w for w in rl_workers(fleet))


def test_retry_with_the_same_request_id_generates_nothing_new(fleet):
    body = {"model": MODEL, "prompt": [151644, 8948, 198], "max_tokens": 300,
            "temperature": 1.0, "seed": 3, "ignore_eos": True,
            "nvext": {"extra_fields": ["completion_token_ids"]}}
    headers = {"X-Request-Id": "retry-me-1"}
    reqs0 = fleet_metric(fleet, "rlfleet_worker_requests_total")
    toks0 = fleet_metric(fleet, "rlfleet_worker_generated_tokens_total")
    with pytest.raises(httpx.TimeoutException):  # the client gives up early
        httpx.post(f"{fleet.url}/v1/completions", json=body, headers=headers, timeout=0.5)
    r = httpx.post(f"{fleet.url}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200 and r.headers["x-request-id"] == "retry-me-1"
    first = r.json()
    assert first["id"] == "retry-me-1" and len(first["nvext"]["completion_token_ids"]) == 300
    again = httpx.post(f"{fleet.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert again.json()["nvext"]["completion_token_ids"] == first["nvext"]["completion_token_ids"]
    assert fleet_metric(fleet, "rlfleet_worker_requests_total") - reqs0 == 1
    assert fleet_metric(fleet, "rlfleet_worker_generated_tokens_total") - toks0 == 300
    reused = httpx.post(f"{fleet.url}/v1/completions", json={**body, "seed": 4},
                        headers=headers, timeout=10)
    assert reused.status_code == 409 and "different request" in reused.json()["error"]["message"]


def test_cancel_by_request_id_returns_partial_output(fleet):
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1500, "ignore_eos": True,
            "nvext": {"extra_fields": ["completion_token_ids", "detailed_finish_reason"]}}
    headers = {"X-Request-Id": "cancel-me-1", "X-Cancel-Token": "owner-secret"}
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(httpx.post(
        f"{fleet.url}/v1/completions", json=body, headers=headers, timeout=120).json()))
    t.start()
    time.sleep(0.8)
    # another client knows the request ID, not the token: refused (issue 10 finding 9)
    for other in ({}, {"X-Cancel-Token": "guess"}):
        stranger = httpx.post(f"{fleet.url}/v1/requests/cancel-me-1/cancel", headers=other,
                              timeout=10)
        assert stranger.status_code == 403, stranger.text
        assert "X-Cancel-Token" in stranger.json()["error"]["message"]
    r = httpx.post(f"{fleet.url}/v1/requests/cancel-me-1/cancel",
                   headers={"X-Cancel-Token": "owner-secret"}, timeout=10).json()
    assert r["cancelled"] is True
    t.join(30)
    assert out["choices"][0]["finish_reason"] == "abort"
    assert out["nvext"]["detailed_finish_reason"] == "cancelled"
    assert 0 < len(out["nvext"]["completion_token_ids"]) < 1500


def test_client_disconnect_aborts_in_the_engine(fleet):
    toks0 = fleet_metric(fleet, "rlfleet_worker_generated_tokens_total")
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1900, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{fleet.url}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break
    deadline = time.monotonic() + 10
    while fleet_metric(fleet, "rlfleet_worker_running_requests") > 0:
        assert time.monotonic() < deadline, "the engine kept generating after the client left"
        time.sleep(0.1)
    assert fleet_metric(fleet, "rlfleet_worker_generated_tokens_total") - toks0 < 1900


def test_sigkill_mid_stream_ends_the_stream_and_survivor_serves(fleet):
    body = {"model": MODEL, "prompt": [151644, 8948, 198], "max_tokens": 1900,
            "ignore_eos": True, "stream": True,
            "nvext": {"extra_fields": ["completion_token_ids"]}}
    events: list[dict] = []
    with httpx.stream("POST", f"{fleet.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
            if len(events) >= 3:
                break
        victim = next(p for p in fleet.workers
                      if worker_metric(p, "rlfleet_worker_running_requests") > 0)
        t0 = time.monotonic()
        victim.signal(signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    assert time.monotonic() - t0 < 15  # ended, not hung
    assert rest and rest[-1] != "data: [DONE]"
    err = json.loads(rest[-1][6:])
    assert "error" in err and err["error"]["message"]
    survivor = next(p for p in fleet.workers if p is not victim)
    # the frontend saw the broken connection: new requests go to the survivor at once
    for _ in range(4):
        r = httpx.post(f"{fleet.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": [1, 2], "max_tokens": 2,
            "nvext": {"extra_fields": ["worker_id"]}})
        assert r.status_code == 200, r.text
        assert r.json()["nvext"]["worker_id"]["decode_worker_id"] == \
            int(survivor.ready["instance_id"])
    # and once the lease expires, discovery drops the dead worker everywhere
    deadline = time.monotonic() + LEASE + 10
    while True:
        listed = [w["instance_id"] for w in rl_workers(fleet)]
        if listed == [int(survivor.ready["instance_id"])]:
            break
        assert time.monotonic() < deadline, listed
        time.sleep(0.3)
    assert len(wait_for_workers(fleet.url, MODEL, 1)) == 1
