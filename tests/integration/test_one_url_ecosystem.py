"""The one URL (a frontend forwarding control routes to `rlfleet control`) answers the newest
single-server control routes for the whole fleet, on two mocker workers (the declared
simulator: the fleet's bookkeeping, not an engine's numbers):
- vLLM's dev RL routes (vllm/entrypoints/serve/dev/rlhf/api_router.py): /abort_requests ends
  the requests in flight on every worker, the weight checker merges every worker's report
  (each under its own data-parallel rank) and compares it, /update_weight_version relabels
  every worker, /start_draft_weight_update is refused by name, /get_world_size?include_dp;
- SGLang 0.5.23's weight-update session (/begin_weight_update, /end_weight_update) opened
  and closed on every worker, refused out of order."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.clients import mock_one_url, wait_in_flight
from tests.fleets import RL_MOCK_MODEL as MODEL
from tests.fleets import mock_args


@pytest.fixture(scope="module")
def one(start_module_fleet, tmp_path_factory):
    root = tmp_path_factory.mktemp("one-url-eco")
    yield from mock_one_url(start_module_fleet, tmp_path_factory, "one-url-eco", MODEL,
                            mock_args(root, "--token-delay", "0.01"))


def test_abort_requests_ends_the_requests_in_flight_on_every_worker(one) -> None:
    out: dict = {}

    def long() -> None:
        out["r"] = httpx.post(f"{one.url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True})
    t = threading.Thread(target=long)
    t.start()
    wait_in_flight(one.url)
    said = httpx.post(f"{one.url}/abort_requests", json={}, timeout=60)
    t.join(60)
    assert said.status_code == 200 and said.json() == {"status": "aborted", "aborted": 1}
    choice = out["r"].json()["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["text"]) < 1000 * 8
    named = httpx.post(f"{one.url}/abort_requests", json={"request_ids": ["x", "y"]}, timeout=60)
    assert named.json() == {"status": "aborted", "aborted": 2}
    bad = httpx.post(f"{one.url}/abort_requests", json={"request_ids": "x"}, timeout=60)
    assert bad.status_code == 400 and "request_ids" in bad.json()["error"]
    assert httpx.get(f"{one.url}/is_paused").json() == {"is_paused": False}


def test_the_weight_checker_covers_every_worker(one) -> None:
    said = httpx.post(f"{one.url}/weight_checker", json={"action": "checksum"}, timeout=60)
    checksums = said.json()["checksums"]
    assert sorted(checksums) == ["dp0:pp0:pcp0:tp0:ep0:weights", "dp1:pp0:pcp0:tp0:ep0:weights"]
    assert len(set(checksums.values())) == 1  # one policy on both
    same = httpx.post(f"{one.url}/weight_checker", timeout=60,
                      json={"action": "compare", "baseline": checksums}).json()
    assert same == {"match": True, "mismatches": [],
                    "ranks": ["dp0:pp0:pcp0:tp0:ep0:", "dp1:pp0:pcp0:tp0:ep0:"]}
    one_off = {**checksums, "dp1:pp0:pcp0:tp0:ep0:weights": "blake3:00"}
    diff = httpx.post(f"{one.url}/weight_checker", timeout=60,
                      json={"action": "compare", "baseline": one_off}).json()
    assert diff["match"] is False and diff["mismatches"] == ["dp1:pp0:pcp0:tp0:ep0:weights"]
    reset = httpx.post(f"{one.url}/weight_checker", json={"action": "reset"}, timeout=60)
    assert reset.status_code == 400 and "random values" in reset.json()["error"]


def test_versions_world_size_and_the_draft_model(one) -> None:
    said = httpx.post(f"{one.url}/update_weight_version", json={"new_version": "eco-7"},
                      timeout=60)
    assert said.json() == {"success": True, "new_version": "eco-7"}
    assert httpx.get(f"{one.url}/weight_info", timeout=60).json() == {"weight_version": "eco-7"}
    for w in one.fleet.workers:
        assert httpx.get(f"{w.ready['system_url']}/weight_info").json()["weight_version"] == \
            "eco-7"
    assert httpx.post(f"{one.url}/update_weight_version", json={}, timeout=60).status_code == 400
    for dp in ("true", "false"):
        assert httpx.get(f"{one.url}/get_world_size", params={"include_dp": dp}).json() == \
            {"world_size": 2}
    draft = httpx.post(f"{one.url}/start_draft_weight_update", timeout=60)
    assert draft.status_code == 400 and "draft model" in draft.json()["error"]


def test_sglangs_weight_update_session_on_every_worker(one) -> None:
    opened = httpx.post(f"{one.url}/begin_weight_update", json={}, timeout=60)
    assert opened.status_code == 200 and opened.json()["success"] is True
    again = httpx.post(f"{one.url}/begin_weight_update", json={}, timeout=60)
    assert again.status_code == 400 and "already open" in again.json()["message"]
    for w in one.fleet.workers:  # every worker holds the session: it cannot open another
        r = httpx.post(f"{w.ready['system_url']}/engine/begin_weight_update", json={}).json()
        assert r["success"] is False
    assert httpx.post(f"{one.url}/end_weight_update", json={}, timeout=60).json()["success"]
    closed = httpx.post(f"{one.url}/end_weight_update", json={}, timeout=60)
    assert closed.status_code == 400 and "no weight-update session" in closed.json()["message"]
    bad = httpx.post(f"{one.url}/begin_weight_update", json={"selector": 3}, timeout=60)
    assert bad.status_code == 400
