"""A real vLLM worker (the tiny Qwen3-MoE model, CPU build) behind a KV-routing frontend:
vLLM's own KV events (--kv-events-config) fill and clear the router's view of it, and a
request for routed experts is served (vLLM's CPU build cannot return them: the field is
null, as vLLM leaves it when the engine does not record them)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from rlfleet.models import make_model
from rlfleet.testing.etcd import free_port
from tests.fleets import vllm_worker_args

MODEL = "tiny-moe"


@pytest.fixture(scope="module")
def fleet(start_module_fleet, tmp_path_factory):
    moe = make_model(tmp_path_factory.mktemp("models") / "moe", arch="qwen3-moe", seed=1)
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{free_port()}"})
    return start_module_fleet([vllm_worker_args(moe, MODEL, "--kv-events-config", events)],
                              kind="vllm", model=MODEL, frontend=("--router-mode", "kv"))


def _view(url: str) -> dict:
    (w,) = httpx.get(f"{url}/health", timeout=5).json()["workers"]
    return w["kv"]


def _until(url: str, ok, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        v = _view(url)
        if ok(v) or time.monotonic() > deadline:
            return v
        time.sleep(0.2)


def test_vllm_kv_events_fill_and_clear_the_view(fleet):
    v = _view(fleet.url)
    assert v["source"] == "events" and v["block_size"] > 0
    prompt = list(range(1000, 1000 + 4 * v["block_size"] + 3))
    r = httpx.post(f"{fleet.url}/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 4}, timeout=120)
    assert r.status_code == 200, r.text
    v = _until(fleet.url, lambda v: v["cached_blocks"] >= 4)
    assert v["cached_blocks"] >= 4, v  # the prompt's four full blocks, from vLLM's events
    (w,) = fleet.workers
    httpx.post(f"{w.ready['system_url']}/engine/flush_cache", json={},
               timeout=30).raise_for_status()
    # vLLM publishes its events with an engine step: the flush (AllBlocksCleared) comes
    # with the next request's, here a one-block prompt's (a refresh also changes the
    # worker's policy in discovery, which clears the view at once)
    one = list(range(3000, 3000 + v["block_size"] + 1))
    r = httpx.post(f"{fleet.url}/v1/completions", json={
        "model": MODEL, "prompt": one, "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
    v = _until(fleet.url, lambda v: v["cached_blocks"] == 1)
    assert v["cached_blocks"] == 1 and v["recorded_blocks"] <= 1, v


@pytest.mark.parametrize("stream", [False, True])
def test_routed_experts_asked_of_a_cpu_engine(fleet, stream):
    r = httpx.post(f"{fleet.url}/v1/completions", json={
        "model": MODEL, "prompt": [1000, 1001, 1002], "max_tokens": 3, "stream": stream,
        "nvext": {"extra_fields": ["routed_experts"]}}, timeout=120)
    assert r.status_code == 200, r.text
    if stream:
        last = [json.loads(line[6:]) for line in r.text.splitlines()
                if line.startswith("data: {") and '"finish_reason":"' in line][-1]
        choice = last["choices"][0]
    else:
        choice = r.json()["choices"][0]
    assert "routed_experts" in choice and choice["routed_experts"] is None
