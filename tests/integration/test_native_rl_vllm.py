"""vLLM 0.32's native RL routes: an rlfleet vLLM worker's system server against
`VLLM_SERVER_DEV_MODE=1 vllm serve` on the same tiny model, route by route (status, body
shape, effect), and vLLM's own HTTPVLLMWeightSyncClient driving an rlfleet worker.

Intended differences (rlfleet's safety rules), not compared as equal:
- the weight-transfer steps with a backend that needs a GPU, on the CPU build (the worker
  here is started with `--weight-transfer-config '{"backend": "nccl"}'`): vLLM's server (no
  backend configured) fails them; rlfleet refuses them with HTTP 400 saying they need a GPU.
  The backend the CPU build runs, modelexpress, is test_modelexpress_transfer_vllm.py's: the
  client's public methods move a worker through pause -> update -> resume there, and vLLM's
  server with that backend is compared step by step;
- `collective_rpc` runs `reload_weights` only, and only while paused (HTTP 409 otherwise).
Here the client drives pause -> reload_weights (collective_rpc) -> update_weight_version ->
resume through its transport (it has no method for those routes), and its
init_weight_transfer_engine for nccl is shown refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from rlfleet.weights.digest import checkpoint_digest
from tests.fleets import MODEL_NAME, vllm_serve, vllm_worker_args

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def vllm_dev_url(tiny_model: Path, tmp_path_factory):
    """vLLM's own server in dev mode (its RL routes), with the workers' engine flags."""
    with vllm_serve(tiny_model, tmp_path_factory.mktemp("vllm-dev"),
                    env={"VLLM_SERVER_DEV_MODE": "1"}) as url:
        yield url


@pytest.fixture(scope="module")
def worker_url(start_module_fleet, tiny_model: Path) -> str:
    """One rlfleet vLLM worker (no frontend): its admin_base_url (the system server)."""
    nccl = ("--weight-transfer-config", '{"backend": "nccl"}')  # a backend needing a GPU
    fleet = start_module_fleet([vllm_worker_args(tiny_model, MODEL_NAME, *nccl)], kind="vllm",
                               frontend=None, name="native-rl")
    return fleet.workers[0].ready["system_url"]


def shape(x: Any) -> Any:
    """A body's shape: keys and value types, not values."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [shape(v) for v in x]
    return type(x).__name__


def call(url: str, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, url + path, timeout=120, **kw)


# (method, path, request kwargs, whether the bodies must be equal, not only alike)
SEQUENCE = [
    ("GET", "/is_paused", {}, True),
    ("GET", "/weight_info", {}, True),
    ("GET", "/get_world_size", {}, True),
    ("GET", "/get_world_size", {"params": {"include_dp": "false"}}, True),
    ("POST", "/pause", {"params": {"mode": "sideways"}}, False),
    ("POST", "/pause", {"params": {"mode": "keep", "clear_cache": "false"}}, True),
    ("GET", "/is_paused", {}, True),
    ("POST", "/update_weight_version", {"json": {}}, False),
    ("POST", "/update_weight_version", {"json": {"new_version": "v2"}}, True),
    ("GET", "/weight_info", {}, True),
    ("POST", "/collective_rpc", {"json": {}}, False),
    ("POST", "/collective_rpc", {"json": {"method": "reload_weights"}}, True),
    ("GET", "/weight_info", {}, True),
    ("POST", "/abort_requests", {"content": b"{no"}, False),
    ("POST", "/abort_requests", {"json": {}}, True),
    ("POST", "/resume", {}, True),
    ("GET", "/is_paused", {}, True),
    ("POST", "/pause", {}, True),  # vLLM's default: abort, clear the cache
    ("POST", "/resume", {}, True),
]


def test_native_routes_answer_as_vllm_does(vllm_dev_url: str, worker_url: str) -> None:
    for method, path, kw, equal in SEQUENCE:
        ref, got = call(vllm_dev_url, method, path, **kw), call(worker_url, method, path, **kw)
        where = f"{method} {path} {kw}: vLLM {ref.status_code} {ref.text[:300]} / " \
                f"rlfleet {got.status_code} {got.text[:300]}"
        assert got.status_code == ref.status_code, where
        if equal:
            assert got.json() == ref.json(), where
        else:
            assert shape(got.json()) == shape(ref.json()), where


def test_weight_transfer_is_refused_on_the_cpu_build(vllm_dev_url: str, worker_url: str) -> None:
    """A backend other than modelexpress on the CPU build: vLLM fails (no weight-transfer
    engine configured: its backends need a GPU); rlfleet refuses with a 4xx that says so and
    names the backend the CPU build runs, and nothing changes."""
    for path, body in [("/init_weight_transfer_engine", {"init_info": {}}),
                       ("/start_weight_update", None),
                       ("/update_weights", {"update_info": {"names": []}}),
                       ("/finish_weight_update", None)]:
        ref, got = call(vllm_dev_url, "POST", path, json=body), \
            call(worker_url, "POST", path, json=body)
        assert ref.status_code >= 400, (path, ref.text)
        assert got.status_code == 400 and "need a GPU" in got.json()["error"], (path, got.text)
        assert "modelexpress" in got.json()["error"], got.text
    assert call(worker_url, "GET", "/is_paused").json() == {"is_paused": False}


def test_vllms_weight_sync_client_drives_a_worker(worker_url: str, tiny_model_b: Path) -> None:
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    client = HTTPVLLMWeightSyncClient(worker_url, timeout=120)
    with pytest.raises(requests.HTTPError) as refused:
        client.init_weight_transfer_engine({"master_address": "127.0.0.1", "master_port": 1})
    assert refused.value.response.status_code == 400
    client._post("pause?mode=keep")
    client._post("collective_rpc", {"method": "reload_weights",
                                    "kwargs": {"weights_path": str(tiny_model_b)}})
    client._post("update_weight_version", {"new_version": "policy-b"})
    client._post("resume")
    version = httpx.get(f"{worker_url}/engine/get_weight_version", timeout=30).json()
    assert version["version"] == "policy-b"
    assert version["weight_digest"] == checkpoint_digest(tiny_model_b)
    assert httpx.get(f"{worker_url}/weight_info", timeout=30).json() == \
        {"weight_version": "policy-b"}
    probe = httpx.post(f"{worker_url}/engine/liveness_probe", timeout=30).json()
    assert probe["status"] == "ok" and "self_check" not in probe, probe  # it passed on resume
