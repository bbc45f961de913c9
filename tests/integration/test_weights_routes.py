"""The staged-weights routes of a worker's system server (stage_weights, get_staged_weights,
apply_staged_weights, release_staged_weights, GET /weights/<version>/<file>) on real
`python -m rlfleet.mocker` processes over their simulated weights (one tensor holding the
seed). The mocker is a simulator: these tests check the control contract, not the engine."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from rlfleet.mocker.engine import SEED_TENSOR
from rlfleet.weights.publish import Publisher

TOKEN = "admin-s3cret"
STAGED_ROUTES = {"stage_weights", "get_staged_weights", "apply_staged_weights",
                 "release_staged_weights"}


def _seed(seed: int) -> dict[str, torch.Tensor]:
    return {SEED_TENSOR: torch.tensor([seed], dtype=torch.int64)}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mock-versions")
    catalog = f"sqlite://{root / 'catalog.sqlite'}"
    pub = Publisher(f"file://{root / 'versions'}", catalog=catalog, model="mock")
    res = {v: pub.publish(_seed(s), v, base=b)
           for v, s, b in (("s1", 1, None), ("s2", 2, "s1"), ("s3", 3, "s2"))}
    return {"root": root / "versions", "catalog": catalog, **res}


@pytest.fixture(scope="module")
def fleet(start_module_fleet, store):
    return start_module_fleet([("--model-name", "mock", "--enable-rl", "--system-port", "0",
                                "--admin-token", TOKEN, "--weights-catalog", store["catalog"],
                                "--allowed-weights-root", str(store["root"]))] * 2,
                              lease_ttl=10, enable_rl=True)


def _post(url: str, route: str, body: dict | None = None, token: str | None = TOKEN) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = httpx.post(f"{url}/engine/{route}", json=body or {}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _wait(url: str, handle: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        [h] = _post(url, "get_staged_weights", {"handle": handle})["staged"]
        if h["state"] != "STAGING":
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.05)


def test_routes_are_advertised_in_discovery(fleet):
    workers = httpx.get(f"{fleet.rl_url}/v1/rl/workers", timeout=10).json()["workers"]
    assert len(workers) == 2
    for w in workers:
        assert STAGED_ROUTES <= set(w["routes"])


def test_stage_apply_and_serve_to_a_peer(fleet, store):
    a, b = (w.ready["system_url"] for w in fleet.workers)
    r = _post(a, "stage_weights", {"version": "s1",
                                   "source": {"kind": "disk", "path": str(store["root"] / "s1")}})
    assert r["status"] == "ok" and r["state"] == "STAGING" and r["handle"]
    h = _wait(a, r["handle"])
    assert h["state"] == "READY" and h["digest"] == store["s1"]["digest"]
    assert h["source"] == {"kind": "disk", "path": str(store["root"] / "s1")}
    # applying needs a paused engine
    refused = _post(a, "apply_staged_weights", {"handle": r["handle"]})
    assert refused["status"] == "error" and "pause_generation first" in refused["message"]
    _post(a, "pause_generation", {"mode": "keep"})
    applied = _post(a, "apply_staged_weights", {"handle": r["handle"]})
    assert applied["status"] == "ok" and applied["version"] == "s1"
    assert applied["weight_digest"] == "mock:1"  # the mocker's own identity of seed 1
    v = _post(a, "get_weight_version")
    assert v["version"] == "s1" and v["weight_digest"] == "mock:1"
    _post(a, "resume_generation")
    # a delta on the applied version, then the peer route serves it to the other worker
    r2 = _post(a, "stage_weights", {"version": "s2", "source": {
        "kind": "disk", "path": str(store["root"] / "s2")}})
    assert _wait(a, r2["handle"])["state"] == "READY"
    _post(a, "pause_generation", {"mode": "keep"})
    assert _post(a, "apply_staged_weights", {"handle": r2["handle"]})["weight_digest"] == "mock:2"
    _post(a, "resume_generation")
    files = httpx.get(f"{a}/weights/s2/model.safetensors.index.json", timeout=10)
    assert files.status_code == 401  # the admin token guards the weights too
    files = httpx.get(f"{a}/weights/s2/model.safetensors.index.json", timeout=10,
                      headers={"Authorization": f"Bearer {TOKEN}"})
    assert files.status_code == 200 and files.json()["metadata"]["checksum_format"] == "adler32"
    gone = httpx.get(f"{a}/weights/s1/model.safetensors.index.json", timeout=10,
                     headers={"Authorization": f"Bearer {TOKEN}"})
    assert gone.status_code == 404 and "not served here" in gone.json()["message"]
    # the other worker takes s2 from any peer the catalog lists
    r3 = _post(b, "stage_weights", {"version": "s2", "source": {"kind": "peer"}})
    h3 = _wait(b, r3["handle"])
    assert h3["state"] == "READY", h3
    assert h3["source"]["url"] == a and h3["digest"] == store["s2"]["digest"]
    _post(b, "release_staged_weights", {"handle": r3["handle"]})


def test_refusals_in_the_contract_error_shape(fleet, store):
    b = fleet.workers[1].ready["system_url"]
    for body, message in [
        ({}, "version is required"),
        ({"version": "s1"}, "source is required"),
        ({"version": "s1", "source": {"kind": "nfs"}}, "source.kind must be one of"),
        ({"version": "s1", "source": {"kind": "disk", "path": "/etc"}},
         "outside the allowed weights roots"),
        # the catalog says s3 is a delta on s2; this worker serves no s2
        ({"version": "s3", "source": {"kind": "disk", "path": str(store["root"] / "s3")}},
         "this delta needs base s2; the worker serves"),
    ]:
        r = _post(b, "stage_weights", body)
        assert r["status"] == "error" and message in r["message"], (body, r)
    for route in ("apply_staged_weights", "release_staged_weights"):
        r = _post(b, route, {"handle": "nope"})
        assert r["status"] == "error" and "unknown staging handle 'nope'" in r["message"]
        r = _post(b, route, {})
        assert r["status"] == "error" and "handle is required" in r["message"]
    r = httpx.post(f"{b}/engine/stage_weights", json={"version": "s1", "source": {
        "kind": "disk", "path": str(store["root"] / "s1")}}, timeout=10)
    assert r.status_code == 401
    # a FAILED handle cannot be applied; release is idempotent
    r = _post(b, "stage_weights", {"version": "s1", "digest": "blake3:" + "0" * 64,
                                   "source": {"kind": "disk", "path": str(store["root"] / "s1")}})
    assert r["status"] == "error" and "differs from the catalog" in r["message"]
    bad = store["root"] / "s1-bad"
    bad.mkdir(exist_ok=True)
    (bad / "model.safetensors.index.json").write_text('{"weight_map": {"x": "../x"}}')
    r = _post(b, "stage_weights", {"version": "s1b", "source": {"kind": "disk", "path": str(bad)}})
    h = _wait(b, r["handle"])
    assert h["state"] == "FAILED" and "bad shard name" in h["error"]
    _post(b, "pause_generation", {"mode": "keep"})
    try:
        r2 = _post(b, "apply_staged_weights", {"handle": r["handle"]})
        assert r2["status"] == "error" and "is FAILED" in r2["message"]
    finally:
        _post(b, "resume_generation")
    for _ in range(2):
        rel = _post(b, "release_staged_weights", {"handle": r["handle"]})
        assert rel["status"] == "ok" and rel["state"] == "RELEASED"
