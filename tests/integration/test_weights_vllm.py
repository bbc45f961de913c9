"""The weight plane end to end on a real two-worker vLLM fleet: a version published full and
then as two successive XOR deltas to a real S3 server reaches both workers through the staged
refresh path (staged while serving, installed in the gated window); a delta on the wrong
base is refused and the worker keeps serving; a worker started after the fleet moved gets
the version from a peer, with the S3 server down, and is admitted only once verified."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch

from rlfleet.journal import SqliteJournal
from rlfleet.refresh.coordinator import PolicyRefresh, reference_probe
from rlfleet.testing.fleet import LocalFleet
from rlfleet.testing.s3 import BUCKET
from rlfleet.train.checkpoint import save_checkpoint
from rlfleet.weights.digest import checkpoint_digest, iter_checkpoint_tensors
from rlfleet.weights.publish import Publisher, TrainerServer
from tests.fleets import VLLM_FLAGS, wait_for_workers, weight_versions

pytestmark = pytest.mark.engine

MODEL = "tiny-staged"
PROMPT = [151644, 8948, 198, 1, 2, 3]
N = 8
PREFIX = f"s3://{BUCKET}/e2e"


def _step(tensors: dict[str, torch.Tensor], seed: int, scale: float, only: str = ""):
    g = torch.Generator().manual_seed(seed)
    return {n: t + torch.randn(t.shape, generator=g) * scale if only in n else t
            for n, t in tensors.items()}


@pytest.fixture(scope="module")
def policies(tiny_model, tmp_path_factory):
    """v1 (far from the served base), v2 and v3 (a few layers changed each), v4 (a delta on
    v2, offered to a fleet on v3): tensors and an HF checkpoint of each for the reference."""
    root = tmp_path_factory.mktemp("staged-policies")
    base = dict(iter_checkpoint_tensors(tiny_model))
    t = {"v1": _step(base, 11, 0.05)}
    t["v2"] = _step(t["v1"], 12, 0.05, "layers.0.")
    t["v3"] = _step(t["v2"], 13, 0.05, "layers.1.")
    t["v4"] = _step(t["v2"], 14, 0.05, "layers.1.")
    ckpt = {v: save_checkpoint(ts, tiny_model, root / v) for v, ts in t.items()}
    probes = {v: reference_probe(ckpt[v], PROMPT, N) for v in t}
    assert len({tuple(p.token_ids) for p in probes.values()}) > 1  # the versions differ
    return {"tensors": t, "ckpt": ckpt, "probes": probes, "root": root}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, start_module_fleet, tiny_model, s3_server, policies):
    if s3_server.proc is None:
        s3_server.start()
    work = tmp_path_factory.mktemp("staged-fleet")
    catalog = f"sqlite://{work / 'catalog.sqlite'}"
    flags = ("--model", str(tiny_model), "--served-model-name", MODEL, "--enable-rl",
             "--system-port", "0", "--weights-catalog", catalog, *VLLM_FLAGS)
    fleet = start_module_fleet([flags] * 2, name="staged-fleet", kind="vllm", model=MODEL,
                               lease_ttl=3, enable_rl=True, worker_env=s3_server.env)
    coordinator = PolicyRefresh(fleet.rl_url, model=MODEL, path="vllm-staged",
                                journal=SqliteJournal(work / "journal.sqlite"),
                                probe_tokens=N, probe_tolerance=1e-4,
                                timeout=300)
    return {"fleet": fleet, "catalog": catalog, "coordinator": coordinator, "flags": flags}


@pytest.fixture(autouse=True)
def s3_env(monkeypatch, s3_server):
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)


def _greedy(fleet: LocalFleet, n_requests: int = 6) -> list[list[int]]:
    """Greedy completions of PROMPT through the frontend."""
    out = []
    for _ in range(n_requests):
        r = httpx.post(f"{fleet.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": N, "temperature": 0.0,
            "ignore_eos": True, "nvext": {"extra_fields": ["completion_token_ids"]}})
        assert r.status_code == 200, r.text
        out.append(r.json()["nvext"]["completion_token_ids"])
    return out


def _greedy_each(fleet: LocalFleet) -> list[list[int]]:
    """Greedy completion of PROMPT on every worker's own request plane."""
    out = []
    for p in fleet.workers:
        r = httpx.post(f"{p.ready['url']}/generate", timeout=60, json={
            "request_id": f"greedy-{p.ready['instance_id']}", "prompt_token_ids": PROMPT,
            "sampling": {"temperature": 0.0, "max_tokens": N, "ignore_eos": True},
            "stream": False})
        assert r.status_code == 200, r.text
        events = [json.loads(line) for line in r.text.splitlines() if line]
        out.append([t for e in events for c in e.get("choices", []) for t in c["token_ids"]])
    return out


def test_full_then_two_deltas_from_s3_through_the_staged_path(setup, policies, s3_server):
    fleet, coordinator = setup["fleet"], setup["coordinator"]
    pub = Publisher(PREFIX, catalog=setup["catalog"], model=MODEL,
                    endpoint_url=s3_server.endpoint_url)
    for step, (v, base) in enumerate((("v1", None), ("v2", "v1"), ("v3", "v2"))):
        published = pub.publish(policies["tensors"][v], v, base=base)
        assert published["digest"] == checkpoint_digest(policies["ckpt"][v])
        source = {"kind": "s3", "uri": f"{PREFIX}/{v}", "endpoint_url": s3_server.endpoint_url}
        result = asyncio.run(coordinator.refresh(None, v, digest=published["digest"],
                                                 probe=policies["probes"][v], source=source,
                                                 step=step))
        assert result.ok and result.fleet_moved, result.reason
        steps = result.step_seconds()
        assert "stage" in steps and "apply" in steps
        # each worker staged from S3 (a delta for v2 and v3) and serves the catalog's digest
        for w in result.workers:
            [staged] = [c["body"] for c in w["calls"] if c["route"] == "staged"]
            assert staged["state"] == "READY" and staged["source"]["kind"] == "s3"
            assert staged["format"] == ("full" if base is None else "xor-delta")
            assert staged["digest"] == published["digest"]
            assert staged["prepared"] == "swap"  # prepared while serving, swapped in gated
        assert weight_versions(fleet) == [(v, published["digest"])] * 2
        expected = policies["probes"][v].token_ids
        assert _greedy(fleet) == [expected] * 6 and _greedy_each(fleet) == [expected] * 2, v
    # the journal holds stage and apply times and each worker's source
    [last] = coordinator.journal.recent(1)
    assert {s["name"] for s in last["steps"]} >= {"stage", "apply"}
    assert all(any(c["route"] == "staged" and c["body"]["source"]["kind"] == "s3"
                   for c in w["calls"]) for w in last["workers"].values())


def test_a_delta_on_the_wrong_base_is_refused(setup, policies, s3_server):
    fleet, coordinator = setup["fleet"], setup["coordinator"]
    pub = Publisher(PREFIX, catalog=setup["catalog"], model=MODEL,
                    endpoint_url=s3_server.endpoint_url)
    v4 = pub.publish(policies["tensors"]["v4"], "v4", base="v2")  # the fleet serves v3
    before = _greedy(fleet)
    source = {"kind": "s3", "uri": f"{PREFIX}/v4", "endpoint_url": s3_server.endpoint_url}
    w0 = fleet.workers[0].ready["system_url"]
    r = httpx.post(f"{w0}/engine/stage_weights", json={"version": "v4", "source": source},
                   timeout=30).json()
    assert r["status"] == "error"
    assert r["message"].startswith("this delta needs base v2; the worker serves v3")
    # the same through the coordinator: nothing is gated, the fleet keeps serving v3
    result = asyncio.run(coordinator.refresh(None, "v4", digest=v4["digest"], source=source))
    assert not result.ok and result.decision == "held"
    assert "this delta needs base v2" in result.reason and "gate" not in result.step_seconds()
    assert coordinator.current.version == "v3"
    after = _greedy(fleet)
    assert after == before == [policies["probes"]["v3"].token_ids] * len(before)
    assert _greedy_each(fleet) == [policies["probes"]["v3"].token_ids] * 2
    assert {v for v, _ in weight_versions(fleet)} == {"v3"}


def test_a_new_worker_takes_the_version_from_a_peer(setup, policies, s3_server):
    """S3 is down and no trainer serves: the worker started after the fleet moved to v3 is
    gated, stages v3 from a peer, is verified, and only then admitted."""
    fleet, coordinator = setup["fleet"], setup["coordinator"]
    s3_server.kill()
    try:
        late = fleet.start_worker(*setup["flags"], "--start-gated", env=s3_server.env,
                                  timeout=600)
        iid = int(late.ready["instance_id"])
        listed = {w["instance_id"]: w for w in httpx.get(
            f"{fleet.rl_url}/v1/rl/workers", timeout=10).json()["workers"]}
        deadline = time.monotonic() + 30  # the frontend learns of it on its next poll
        while True:
            health = httpx.get(f"{fleet.url}/health", timeout=10).json()["workers"]
            if any(w["instance_id"] == iid for w in health) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert [w["usable"] for w in health if w["instance_id"] == iid] == [False]  # gated
        assert iid in listed
        result = asyncio.run(coordinator.admit_new_workers())
        assert result.ok, result.reason
        [new] = result.workers
        assert new["instance_id"] == iid and new["status"] == "verified"
        [staged] = [c["body"] for c in new["calls"] if c["route"] == "staged"]
        assert staged["source"]["kind"] == "peer" and staged["state"] == "READY"
        assert staged["source"]["url"] in {p.ready["system_url"] for p in fleet.workers[:2]}
        wait_for_workers(fleet.url, MODEL, 3)
        digest = checkpoint_digest(policies["ckpt"]["v3"])
        assert weight_versions(fleet) == [("v3", digest)] * 3
        expected = policies["probes"]["v3"].token_ids
        assert _greedy_each(fleet) == [expected] * 3 and _greedy(fleet) == [expected] * 6
    finally:
        s3_server.start()


def test_a_trainer_version_fans_out_over_a_chain(setup, policies, tmp_path):
    """`stage_fanout=1` with a trainer source (its TrainerServer): the first worker in
    discovery stages the version from the trainer, each other one from the worker before it
    (never from the trainer), and the fleet serves it verified. (Last: the fleet moves on.)"""
    fleet, journal = setup["fleet"], setup["coordinator"].journal
    with TrainerServer(tmp_path / "trainer") as trainer:
        published = Publisher(trainer.uri, model=MODEL).publish(policies["tensors"]["v1"], "t1")
        assert published["digest"] == checkpoint_digest(policies["ckpt"]["v1"])
        chain = PolicyRefresh(fleet.rl_url, model=MODEL, path="vllm-staged", journal=journal,
                              probe_tokens=N, probe_tolerance=1e-4, timeout=300,
                              stage_fanout=1)
        result = asyncio.run(chain.refresh(None, "t1", digest=published["digest"],
                                           probe=policies["probes"]["v1"], step=10,
                                           source={"kind": "trainer", "url": trainer.url}))
    assert result.ok and result.fleet_moved, result.reason
    staged = sorted(([c["body"] for c in w["calls"] if c["route"] == "staged"][0]
                     for w in result.workers), key=lambda s: s["source"]["kind"] != "trainer")
    assert [s["source"]["kind"] for s in staged] == ["trainer"] + ["peer"] * (len(staged) - 1)
    for s in staged[1:]:  # from a peer, chunk by chunk, with the trainer only as the origin
        assert s["state"] == "READY" and s["digest"] == published["digest"], s
        assert s["source"]["fanout"]["origin"]["uri"] == f"{trainer.url}/t1"
        assert s["fanout"]["origin_chunks"] == 0, s["fanout"]
    n = len(fleet.workers)
    assert weight_versions(fleet) == [("t1", published["digest"])] * n
    expected = policies["probes"]["v1"].token_ids
    assert _greedy_each(fleet) == [expected] * n and _greedy(fleet) == [expected] * 6
