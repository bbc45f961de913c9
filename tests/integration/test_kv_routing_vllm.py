"""vLLM's own KV events (--kv-events-config) reach the KV router's view of the worker:
blocks stored by a request, cleared by a cache flush (what every refresh does)."""

from __future__ import annotations

import json
import time

import httpx

from tests.etcd_server import free_port
from tests.fleets import MODEL_NAME, vllm_worker_args


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


def test_vllm_kv_events_fill_and_clear_the_view(start_fleet, tiny_model):
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{free_port()}"})
    fleet = start_fleet([vllm_worker_args(tiny_model, MODEL_NAME, "--kv-events-config",
                                          events)],
                        kind="vllm", model=MODEL_NAME, frontend=("--router-mode", "kv"))
    v = _view(fleet.url)
    assert v["source"] == "events" and v["block_size"] > 0
    prompt = list(range(1000, 1000 + 4 * v["block_size"] + 3))
    r = httpx.post(f"{fleet.url}/v1/completions", json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 4}, timeout=120)
    assert r.status_code == 200, r.text
    v = _until(fleet.url, lambda v: v["cached_blocks"] >= 4)
    assert v["cached_blocks"] >= 4, v  # the prompt's four full blocks, from vLLM's events
    (w,) = fleet.workers
    httpx.post(f"{w.ready['system_url']}/engine/flush_cache", json={},
               timeout=30).raise_for_status()
    v = _until(fleet.url, lambda v: v["cached_blocks"] == 0)
    assert v["cached_blocks"] == 0 and v["recorded_blocks"] == 0, v
